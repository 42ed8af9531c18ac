"""Sparse MLA attention over the 656-byte FP8 cache (DESIGN.md §4), as a Triton kernel.

For token t and head h: softmax over the valid (>= 0) slots s of indices[t] of
(q[t, h] . k[s]) * softmax_scale, times the first 512 values of k[s], where k[s] is the
de-quantized 576-wide record (512 latent, 64 rope). lse is the natural-log sum of the exps; a
row with no valid slot gives out 0 and lse +inf.

Layout of one program: BLOCK_H heads of one token; it walks the token's index row in tiles of
BLOCK_N slots with an online softmax (exp2 domain), de-quantizing each gathered tile in
registers. Masked loads (other=0) never touch an invalid slot's bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops.launcher import interpret_mode, launch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _sparse_mla_kernel(
    q_ptr, cache_ptr, idx_ptr, out_ptr, lse_ptr,
    H, topk, qk_scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    d = tl.arange(0, 512)
    r = tl.arange(0, 64)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + h[:, None] * stride_qh
    q_nope = tl.load(q_row + d[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE)
    q_pe = tl.load(q_row + 512 + r[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    idx_row = idx_ptr + t.to(tl.int64) * topk
    for start in range(0, topk, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_row + j, mask=j < topk, other=-1)
        ok = slot >= 0
        rec = cache_ptr + slot.to(tl.int64) * 656
        codes = tl.load(rec[:, None] + d[None, :], mask=ok[:, None], other=0)
        scale = tl.load(
            (rec + 512).to(tl.pointer_type(tl.float32))[:, None] + d[None, :] // 128, mask=ok[:, None], other=0.0
        )
        kv = (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale).to(DOT_DTYPE)  # [BLOCK_N, 512]
        pe = tl.load((rec + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + r[None, :], mask=ok[:, None], other=0.0)
        pe = pe.to(tl.float32).to(DOT_DTYPE)
        s = tl.dot(q_nope, tl.trans(kv)) + tl.dot(q_pe, tl.trans(pe))  # [BLOCK_H, BLOCK_N] fp32
        s = tl.where(ok[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet: keep exps at 0
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), kv)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("inf"))
    o_row = out_ptr + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh
    tl.store(o_row + d[None, :], out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    tl.store(lse_ptr + t.to(tl.int64) * H + h, lse, mask=h_ok)


def launch_sparse_mla(
    q,
    cache,
    indices,
    out,
    lse,
    softmax_scale: float,
    block_h: int | None = None,
    block_n: int = 64,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Framework-neutral launch: q bf16 [T, H, 576] (last dim contiguous), cache uint8
    [..., 656], indices int32 [T, topk] contiguous, out bf16 [T, H, 512], lse float32 [T, H]."""
    T, H = int(q.shape[0]), int(q.shape[1])
    topk = int(indices.shape[1])
    if T == 0:
        return
    if block_h is None:
        block_h = max(16, min(64, triton.next_power_of_2(H)))
    stride = (lambda x, i: int(x.strides[i])) if hasattr(q, "strides") else (lambda x, i: x.stride(i))
    meta = {}
    if num_warps is not None:
        meta["num_warps"] = num_warps
    if num_stages is not None:
        meta["num_stages"] = num_stages
    # The interpreter computes bf16 wrongly; on GPU, bf16 tensor-core dots (fp32 accumulate).
    dot_dtype = tl.float32 if interpret_mode() else tl.bfloat16
    launch(
        _sparse_mla_kernel, (T, triton.cdiv(H, block_h)), q, cache, indices, out, lse,
        H, topk, softmax_scale * LOG2E,
        stride(q, 0), stride(q, 1), stride(out, 0), stride(out, 1),
        BLOCK_H=block_h, BLOCK_N=block_n, DOT_DTYPE=dot_dtype, **meta,
    )  # fmt: skip
