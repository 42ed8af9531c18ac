"""Sparse MLA attention over the 656-byte FP8 cache (docs/design.md §4.5), as Triton kernels.
The same kernel reads full layers' bf16 cache ([..., 576]: 512 latent, then 64 rope) when
CACHE_BF16 is set, so full layers' absorbed attention runs on it with whole-context indices.

For token t and head h: softmax over the valid (>= 0) slots s of indices[t] of
(q[t, h] . k[s]) * softmax_scale, times the first 512 values of k[s], where k[s] is the
de-quantized 576-wide record (512 latent, 64 rope). lse is the natural-log sum of the exps; a
row with no valid slot gives out 0 and lse +inf.

One program: BLOCK_H heads of one token over one split of its index row, walked in tiles of
BLOCK_N slots with an online softmax (exp2 domain), each gathered tile de-quantized in
registers. Masked loads (other=0) never touch an invalid slot's bytes. With several splits
(split-KV, for batches too small to fill the GPU) each split writes a normalised float32 partial
and its lse (-inf when empty), and ``_combine_kernel`` merges them.

The 512 latent columns are handled one of two ways (SPLIT_LATENT):
- one [BLOCK_N, 512] block (codes viewed [N, 4, 128] so each 128-column scale tile multiplies its
  own columns): QK is two dots (latent K=512, rope K=64) and PV one (N=512). For 64-head tiles on
  Hopper each dot is one run of wgmma instructions with one wait (3 a tile, against 9 for chunks).
- four chunks of 128 (q0..q3, kv0..kv3, acc0..acc3), for mma.sync tiles (BLOCK_H < 64): their q
  operand lives in registers, and one 512-wide q operand would take 128 of them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops.launcher import interpret_mode, launch, stride

LOG2E = 1.4426950408889634
WGMMA_HEADS = 64  # a warpgroup MMA's rows: head tiles this tall run on wgmma, smaller ones on mma.sync


@triton.jit
def _load_q(q_row, h_ok, off: tl.constexpr, width: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """q columns off .. off+width-1 of BLOCK_H heads -> [BLOCK_H, width] DOT_DTYPE."""
    col = tl.arange(0, width)
    return tl.load(q_row + off + col[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE)


@triton.jit
def _load_latent(rec, ok, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """De-quantize the 512 latent values of BLOCK_N gathered records -> [BLOCK_N, 512]: codes
    viewed [N, 4, 128] times the record's 4 float32 scales (bytes 512..527), one per tile."""
    tile = tl.arange(0, 4)
    off = tile[:, None] * 128 + tl.arange(0, 128)[None, :]  # [4, 128] byte offsets
    codes = tl.load(rec[:, None, None] + off[None, :, :], mask=ok[:, None, None], other=0)
    scale = tl.load((rec + 512).to(tl.pointer_type(tl.float32))[:, None] + tile[None, :], mask=ok[:, None], other=0.0)
    kv = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
    return tl.reshape(kv.to(DOT_DTYPE), [BLOCK_N, 512])


@triton.jit
def _load_latent_chunk(rec, ok, c: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """De-quantize latent values 128*c .. 128*c+127 (scale tile c) of the records -> [N, 128]."""
    codes = tl.load(rec[:, None] + (c * 128 + tl.arange(0, 128))[None, :], mask=ok[:, None], other=0)
    scale = tl.load((rec + 512).to(tl.pointer_type(tl.float32)) + c, mask=ok, other=0.0)
    return (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]).to(DOT_DTYPE)


@triton.jit
def _load_slot_latent(rec, ok, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, CACHE_BF16: tl.constexpr):
    """The 512 latent values of BLOCK_N slots -> [BLOCK_N, 512] DOT_DTYPE (``rec`` points at
    each slot's first byte, or first bf16 value with CACHE_BF16)."""
    if CACHE_BF16:
        kv = tl.load(rec[:, None] + tl.arange(0, 512)[None, :], mask=ok[:, None], other=0.0)
        kv = kv.to(tl.float32).to(DOT_DTYPE)
    else:
        kv = _load_latent(rec, ok, BLOCK_N, DOT_DTYPE)
    return kv


@triton.jit
def _load_slot_chunk(rec, ok, c: tl.constexpr, DOT_DTYPE: tl.constexpr, CACHE_BF16: tl.constexpr):
    """Latent values 128*c .. 128*c+127 of the slots -> [N, 128] DOT_DTYPE."""
    if CACHE_BF16:
        kv = tl.load(rec[:, None] + (c * 128 + tl.arange(0, 128))[None, :], mask=ok[:, None], other=0.0)
        kv = kv.to(tl.float32).to(DOT_DTYPE)
    else:
        kv = _load_latent_chunk(rec, ok, c, DOT_DTYPE)
    return kv


@triton.jit
def _sparse_mla_kernel(
    q_ptr,
    cache_ptr,
    idx_ptr,
    out_ptr,
    lse_ptr,
    H,
    topk,
    tiles_per_split,
    qk_scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_os,
    stride_oh,
    stride_lt,
    stride_ls,
    EMPTY_LSE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SPLIT_LATENT: tl.constexpr,
    CACHE_BF16: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = h < H
    q_row = q_ptr + t.to(tl.int64) * stride_qt + h[:, None] * stride_qh
    q_pe = _load_q(q_row, h_ok, 512, 64, DOT_DTYPE)
    if SPLIT_LATENT:
        q0 = _load_q(q_row, h_ok, 0, 128, DOT_DTYPE)
        q1 = _load_q(q_row, h_ok, 128, 128, DOT_DTYPE)
        q2 = _load_q(q_row, h_ok, 256, 128, DOT_DTYPE)
        q3 = _load_q(q_row, h_ok, 384, 128, DOT_DTYPE)
        acc0 = tl.zeros([BLOCK_H, 128], tl.float32)
        acc1 = tl.zeros([BLOCK_H, 128], tl.float32)
        acc2 = tl.zeros([BLOCK_H, 128], tl.float32)
        acc3 = tl.zeros([BLOCK_H, 128], tl.float32)
    else:
        q_lat = _load_q(q_row, h_ok, 0, 512, DOT_DTYPE)
        acc = tl.zeros([BLOCK_H, 512], tl.float32)
    r = tl.arange(0, 64)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    idx_row = idx_ptr + t.to(tl.int64) * topk
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, topk)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_row + j, mask=j < hi, other=-1)
        ok = slot >= 0
        if CACHE_BF16:
            rec = cache_ptr + slot.to(tl.int64) * 576
            pe_ptr = rec + 512
        else:
            rec = cache_ptr + slot.to(tl.int64) * 656
            pe_ptr = (rec + 528).to(tl.pointer_type(tl.bfloat16))
        pe = tl.load(pe_ptr[:, None] + r[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q_pe, tl.trans(pe.to(tl.float32).to(DOT_DTYPE)))  # [BLOCK_H, BLOCK_N] fp32
        if SPLIT_LATENT:
            kv0 = _load_slot_chunk(rec, ok, 0, DOT_DTYPE, CACHE_BF16)
            s = tl.dot(q0, tl.trans(kv0), s)
            kv1 = _load_slot_chunk(rec, ok, 1, DOT_DTYPE, CACHE_BF16)
            s = tl.dot(q1, tl.trans(kv1), s)
            kv2 = _load_slot_chunk(rec, ok, 2, DOT_DTYPE, CACHE_BF16)
            s = tl.dot(q2, tl.trans(kv2), s)
            kv3 = _load_slot_chunk(rec, ok, 3, DOT_DTYPE, CACHE_BF16)
            s = tl.dot(q3, tl.trans(kv3), s)
        else:
            kv = _load_slot_latent(rec, ok, BLOCK_N, DOT_DTYPE, CACHE_BF16)  # [BLOCK_N, 512]
            s = tl.dot(q_lat, tl.trans(kv), s)
        s = tl.where(ok[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet: keep exps at 0
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(DOT_DTYPE)
        if SPLIT_LATENT:
            acc0 = tl.dot(p, kv0, acc0 * alpha[:, None])
            acc1 = tl.dot(p, kv1, acc1 * alpha[:, None])
            acc2 = tl.dot(p, kv2, acc2 * alpha[:, None])
            acc3 = tl.dot(p, kv3, acc3 * alpha[:, None])
        else:
            acc = tl.dot(p, kv, acc * alpha[:, None])
        m_i = m_new

    has = l_i > 0
    inv = 1.0 / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, EMPTY_LSE)
    o_row = out_ptr + t.to(tl.int64) * stride_ot + split * stride_os + h[:, None] * stride_oh
    o_ty = out_ptr.dtype.element_ty
    if SPLIT_LATENT:
        col = tl.arange(0, 128)[None, :]
        tl.store(o_row + col, (acc0 * inv).to(o_ty), mask=h_ok[:, None])
        tl.store(o_row + 128 + col, (acc1 * inv).to(o_ty), mask=h_ok[:, None])
        tl.store(o_row + 256 + col, (acc2 * inv).to(o_ty), mask=h_ok[:, None])
        tl.store(o_row + 384 + col, (acc3 * inv).to(o_ty), mask=h_ok[:, None])
    else:
        tl.store(o_row + tl.arange(0, 512)[None, :], (acc * inv).to(o_ty), mask=h_ok[:, None])
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + split * stride_ls + h, lse, mask=h_ok)


@triton.jit
def _combine_kernel(
    part_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    H,
    num_splits,
    S_POW2: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge split partials of one (token, head): weights exp(lse_s - max lse), normalised.
    partials float32 [T, S, H, 512], lse [T, S, H] (-inf = empty) -> out [T, H, 512], lse [T, H]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, S_POW2)
    ls = tl.load(part_lse_ptr + (t * num_splits + s) * H + h, mask=s < num_splits, other=float("-inf"))
    m = tl.max(ls, axis=0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(ls - m_ref)  # 0 for empty splits
    total = tl.sum(w, axis=0)
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    d = tl.arange(0, BLOCK_D)
    for d0 in range(0, 512, BLOCK_D):
        part = tl.load(
            part_ptr + ((t * num_splits + s[:, None]) * H + h) * 512 + d0 + d[None, :],
            mask=(s < num_splits)[:, None],
            other=0.0,
        )
        o = tl.sum(part * (w * inv)[:, None], axis=0)
        tl.store(out_ptr + (t * H + h) * 512 + d0 + d, o.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + t * H + h, tl.where(total > 0, m_ref + tl.log(total), float("inf")))


# Tuned on an H200 (benchmarks/bench_swa_kernels.py --variants, 2026-12-02, triton 3.6;
# results/h200_2026-12-02_sweep*.json): 64-head tiles of 64 slots with 2 stages (the pipeliner
# then prefetches the next tile's records into shared memory: 0.909 -> 0.758 ms at 128 requests x
# 128 heads x W 4096; 0.721 with the one-block latent). Below 64 heads the 64-head tile still wins
# decodes (16 heads, 128 requests, W 4096: 0.359 vs 0.400 ms): its gathers are pipelined, the
# mma.sync tiles' are not. 16-head tiles of 32 slots win once there are enough programs without
# splitting (prefill, 16 heads, 4096 tokens, W 4096: 9.3 ms vs 10.4).
TUNED_WIDE = {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2}
TUNED_NARROW = {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 2}


def tuned_config(T: int, H: int, num_sms: int = 132) -> dict:
    """Tile shape and launch options for T tokens of H heads (the recorded tuning, not a search)."""
    if H >= WGMMA_HEADS or T * triton.cdiv(H, TUNED_NARROW["block_h"]) < 2 * num_sms:
        return TUNED_WIDE
    return TUNED_NARROW


def default_num_splits(T: int, H: int, topk: int, block_h: int, block_n: int, num_sms: int = 132) -> int:
    """Split the index row when T x head-blocks programs would leave SMs idle; keep >= 2 tiles
    a split so each split amortises its q load and partial write. Both tile kinds aim for at
    most two programs an SM, rounding down so the last wave is full: a wide program fills an SM
    alone (two waves), two narrow ones share an SM (one wave). On the H200, more splits lost
    (16 heads, 128 requests, W 4096: 2 splits 0.405 ms, 4 0.430, 9 0.461) and so did a part
    wave (3 splits: 384 programs on 264 slots, 0.555 ms)."""
    programs = T * triton.cdiv(H, block_h)
    if programs >= (num_sms if block_h >= WGMMA_HEADS else 2 * num_sms):
        return 1
    return max(1, min(2 * num_sms // programs, triton.cdiv(topk, 2 * block_n), 32))


def launch_sparse_mla(
    q,
    cache,
    indices,
    out,
    lse,
    softmax_scale: float,
    *,
    block_h: int | None = None,
    block_n: int | None = None,
    num_splits: int = 1,
    partial=None,
    partial_lse=None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Framework-neutral launch: q bf16 [T, H, 576] (last dim contiguous), cache uint8
    [..., 656] (FP8 records) or bf16 [..., 576] (full layers), indices int32 [T, topk] contiguous,
    out bf16 [T, H, 512], lse float32 [T, H].
    ``num_splits`` > 1 needs ``partial`` float32 [T, S, H, 512] and ``partial_lse`` [T, S, H]."""
    T, H = int(q.shape[0]), int(q.shape[1])
    topk = int(indices.shape[1])
    if T == 0:
        return
    tuned = tuned_config(T, H)
    block_h, block_n = block_h or tuned["block_h"], block_n or tuned["block_n"]
    meta = {"num_warps": num_warps or tuned["num_warps"], "num_stages": num_stages or tuned["num_stages"]}
    # The interpreter computes bf16 wrongly; on GPU, bf16 tensor-core dots (fp32 accumulate).
    dot_dtype = tl.float32 if interpret_mode() else tl.bfloat16
    n_tiles = triton.cdiv(topk, block_n)
    num_splits = max(1, min(num_splits, n_tiles))
    tiles_per_split = triton.cdiv(n_tiles, num_splits)
    num_splits = triton.cdiv(n_tiles, tiles_per_split)
    if num_splits == 1:
        dst, dst_lse, strides, empty = out, lse, (stride(out, 0), 0, stride(out, 1), H, 0), float("inf")
    else:
        dst, dst_lse, empty = partial, partial_lse, float("-inf")
        strides = (num_splits * H * 512, H * 512, 512, num_splits * H, H)
    launch(
        _sparse_mla_kernel,
        (T, triton.cdiv(H, block_h), num_splits),
        q,
        cache,
        indices,
        dst,
        dst_lse,
        H,
        topk,
        tiles_per_split,
        softmax_scale * LOG2E,
        stride(q, 0),
        stride(q, 1),
        *strides,
        EMPTY_LSE=empty,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype,
        SPLIT_LATENT=block_h < WGMMA_HEADS,
        CACHE_BF16=int(cache.shape[-1]) == 576,
        **meta,
    )
    if num_splits > 1:
        launch(
            _combine_kernel,
            (T, H),
            partial,
            partial_lse,
            out,
            lse,
            H,
            num_splits,
            S_POW2=triton.next_power_of_2(num_splits),
            BLOCK_D=128,
        )
