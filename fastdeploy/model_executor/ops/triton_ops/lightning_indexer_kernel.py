"""Triton kernels of DeepSeek-V3.2's lightning indexer (contracts in ``lightning_indexer.py``):
the index-key write into the paged cache, the index logits over it and the per-row top-k;
paddle-free.

One program scores one query row against BLOCK_N consecutive key positions of its request's
block-table row (prefill rows and decode rows alike: a query sees positions 0..end-1 of its own
row):

    logit[t, j] = k_scale[j] * sum_h w[t, h] * relu(q[t, h] . k[j])   for j < end[t], else -inf

The keys' e4m3 codes come out of the block's page (bs x D codes, then bs float32 scales) and are
exact in the dot's dtype (float32 in the interpreter, e4m3 on Hopper, where q is e4m3 too); an
unquantized cache has the key values at slot * D and no scales.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops.launcher import launch, stride
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache_kernel import _e4m3_byte, _pow2_ceil


@triton.jit
def _index_key_write_kernel(
    k_ptr,
    slot_ptr,
    cache_ptr,
    T,
    n_slots,
    stride_k,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FP8: tl.constexpr,
):
    """BLOCK_T keys a program. FP8: scale = 2^ceil(log2(max(amax, 1e-4) / 448)) (DeepSeek's
    act_quant with power-of-two scales), codes e4m3(k / scale) (nearest, ties to even) into the
    block's page, the scale after the page's codes; else the values as the cache's dtype. A slot
    < 0 writes the last slot (the null block's)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < T
    slot = tl.load(slot_ptr + t, mask=ok, other=0).to(tl.int64)
    slot = tl.where(slot >= 0, slot, n_slots - 1)
    d = tl.arange(0, D)
    x = tl.load(k_ptr + t[:, None].to(tl.int64) * stride_k + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    if FP8:
        scale = _pow2_ceil(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4) / 448.0)
        q = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
        page = cache_ptr + (slot // BS) * (BS * (D + 4))
        off = slot % BS
        tl.store(page[:, None] + off[:, None] * D + d[None, :], _e4m3_byte(q), mask=ok[:, None])
        tl.store((page + BS * D + off * 4).to(tl.pointer_type(tl.float32)), scale, mask=ok)
    else:
        dst = cache_ptr + slot[:, None] * D + d[None, :]
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=ok[:, None])


def launch_index_key_write(k, slots, cache, block_size: int, fp8: bool, block_t: int = 8) -> None:
    """k float [T, D], slots int32 [T], cache uint8 [blocks, bs, 1, D + 4] (``fp8``) or float
    [blocks, bs, 1, D]."""
    T, D = int(k.shape[0]), int(k.shape[1])
    if T == 0:
        return
    n_slots = int(cache.shape[0]) * int(cache.shape[1])
    grid = (triton.cdiv(T, block_t),)
    launch(_index_key_write_kernel, grid, k, slots, cache, T, n_slots, stride(k, 0), D=D, BS=block_size,
           BLOCK_T=block_t, FP8=fp8)  # fmt: skip


@triton.jit
def _index_logits_kernel(
    q_ptr,
    w_ptr,
    cache_ptr,
    table_ptr,
    krow_ptr,
    ends_ptr,
    out_ptr,
    stride_qt,
    stride_wt,
    stride_table,
    stride_out,
    H,
    L,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    end = tl.load(ends_ptr + t)
    ok = j < end
    out = out_ptr + t * stride_out + j
    if tl.program_id(1) * BLOCK_N >= end:  # the whole tile lies past the query's end
        tl.store(out, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=j < L)
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * D + d[None, :], mask=(h < H)[:, None], other=0.0)
    w = tl.load(w_ptr + t * stride_wt + h, mask=h < H, other=0.0).to(tl.float32)
    row = tl.load(krow_ptr + t).to(tl.int64)
    blk = tl.load(table_ptr + row * stride_table + j // BS, mask=ok, other=0).to(tl.int64)
    blk = tl.maximum(blk, 0)
    off = j % BS
    if FP8:
        page = cache_ptr + blk * (BS * (D + 4))  # uint8: the block's codes, then its scales
        codes = tl.load(page[:, None] + off[:, None] * D + d[None, :], mask=ok[:, None], other=0)
        k = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale = tl.load((page + BS * D + off * 4).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
    else:
        k = tl.load(cache_ptr + (blk * BS + off)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        k = k.to(tl.float32)
        scale = tl.full([BLOCK_N], 1.0, tl.float32)
    s = tl.dot(q.to(tl.float32).to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)))  # [BLOCK_H, BLOCK_N]
    logit = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0) * scale
    tl.store(out, tl.where(ok, logit, float("-inf")), mask=j < L)


def launch_index_logits(
    q, w, cache, block_table, krow, ends, out, block_size: int, fp8: bool, block_n: int = 64, dot_fp8: bool = False
) -> None:
    """Framework-neutral launch. q [T, H, D] (float32, or e4m3 with ``dot_fp8``), w float32 [T, H],
    cache uint8 [blocks, bs, 1, D + 4] (``fp8``) or float [blocks, bs, 1, D], block_table int32
    [B, max_blocks], krow int32 [T] (the table row of each query), ends int [T] (each at most L), out float32 [T, L]."""
    T, H, D = int(q.shape[0]), int(q.shape[1]), int(q.shape[2])
    L = int(out.shape[1])
    if T == 0 or L == 0:
        return
    grid = (T, triton.cdiv(L, block_n))
    launch(
        _index_logits_kernel,
        grid,
        q,
        w,
        cache,
        block_table,
        krow,
        ends,
        out,
        stride(q, 0),
        stride(w, 0),
        stride(block_table, 0),
        stride(out, 0),
        H,
        L,
        D=D,
        BS=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(H)),
        BLOCK_N=block_n,
        FP8=fp8,
        DOT_DTYPE=tl.float8e4nv if dot_fp8 else tl.float32,
    )


@triton.jit
def _sort_key(score, j):
    """(score float32, position j) -> int64 keys whose descending order is score descending, then
    position ascending: the float's bits made monotone as a signed int (negative floats have
    their magnitude bits flipped) in the high word, 2^31 - 1 - j in the low word."""
    bits = score.to(tl.int32, bitcast=True)
    mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) + (0x7FFFFFFF - j).to(tl.int64)


@triton.jit
def _topk_kernel(logits_ptr, ends_ptr, out_ptr, stride_l, stride_o, K_OUT, K: tl.constexpr):
    """One program a row: a running top K (K a power of two >= k) over tiles of K positions, each
    tile merged by one sort of the 2K keys of the champions and the tile; then the k best
    positions in order, -1 past min(k, end)."""
    t = tl.program_id(0).to(tl.int64)
    end = tl.load(ends_ptr + t)
    best = tl.full([K], -(2**63), tl.int64)
    r = tl.arange(0, K)
    for start in range(0, end, K):
        j = start + r
        s = tl.load(logits_ptr + t * stride_l + j, mask=j < end, other=float("-inf"))
        both = tl.sort(tl.reshape(tl.join(best, _sort_key(s, j)), [2 * K]), descending=True)
        best = tl.sum(tl.where(tl.arange(0, 2)[:, None] == 0, tl.reshape(both, [2, K]), 0), 0)
    pos = (0x7FFFFFFF - (best & 0xFFFFFFFF)).to(tl.int32)
    pos = tl.where(r < tl.minimum(end, K_OUT), pos, -1)
    tl.store(out_ptr + t * stride_o + r, pos, mask=r < K_OUT)


def launch_index_topk(logits, ends, out) -> None:
    """logits float32 [T, L] (-inf past each row's end), ends int [T], out int32 [T, k]."""
    T, k = int(out.shape[0]), int(out.shape[1])
    if T == 0:
        return
    K = max(16, triton.next_power_of_2(k))
    launch(_topk_kernel, (T,), logits, ends, out, stride(logits, 0), stride(out, 0), k, K=K)
