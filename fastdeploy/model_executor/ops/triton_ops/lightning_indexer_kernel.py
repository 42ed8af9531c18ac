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
    SUB_N: tl.constexpr,
    FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    KEYS_M: tl.constexpr,
):
    """One query row t, positions [pid1 * BLOCK_N, + BLOCK_N) in sub-tiles of SUB_N: q and w are
    loaded once a program, each sub-tile's keys once."""
    t = tl.program_id(0).to(tl.int64)
    base = tl.program_id(1) * BLOCK_N
    end = tl.load(ends_ptr + t)
    if base >= end:  # the whole tile lies past the query's end
        for sub in tl.static_range(0, BLOCK_N, SUB_N):
            j = base + sub + tl.arange(0, SUB_N)
            tl.store(out_ptr + t * stride_out + j, tl.full([SUB_N], float("-inf"), tl.float32), mask=j < L)
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    # e4m3 q on Hopper goes to the dot as it is (DOT_DTYPE e4m3); the interpreter widens to float32
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * D + d[None, :], mask=(h < H)[:, None], other=0.0)
    q = q.to(DOT_DTYPE)
    w = tl.load(w_ptr + t * stride_wt + h, mask=h < H, other=0.0).to(tl.float32)
    row = tl.load(krow_ptr + t).to(tl.int64)
    live = tl.minimum(BLOCK_N, end - base)  # positions of the tile before the end (> 0 here)
    for sub in range(0, live, SUB_N):  # no branch inside: the key loads can be pipelined
        j = base + sub + tl.arange(0, SUB_N)
        ok = j < end
        blk = tl.load(table_ptr + row * stride_table + j // BS, mask=ok, other=0).to(tl.int64)
        blk = tl.maximum(blk, 0)
        off = j % BS
        if FP8:
            page = cache_ptr + blk * (BS * (D + 4))  # uint8: the block's codes, then its scales
            codes = tl.load(page[:, None] + off[:, None] * D + d[None, :], mask=ok[:, None], other=0)
            k = codes.to(tl.float8e4nv, bitcast=True)
            scale = tl.load((page + BS * D + off * 4).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
        else:
            k = tl.load(cache_ptr + (blk * BS + off)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            scale = tl.full([SUB_N], 1.0, tl.float32)
        if KEYS_M:  # keys as the dot's rows: the sum over heads stays within a warp
            s = tl.dot(k.to(DOT_DTYPE), tl.trans(q))  # [SUB_N, BLOCK_H]
            logit = tl.sum(tl.maximum(s, 0.0) * w[None, :], 1) * scale
        else:
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)))  # [BLOCK_H, SUB_N]
            logit = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0) * scale
        logit = tl.where(ok, logit, float("-inf"))
        tl.store(out_ptr + t * stride_out + j, logit, mask=j < L)
    for sub in range(tl.cdiv(live, SUB_N) * SUB_N, BLOCK_N, SUB_N):  # sub-tiles wholly past the end
        j = base + sub + tl.arange(0, SUB_N)
        tl.store(out_ptr + t * stride_out + j, tl.full([SUB_N], float("-inf"), tl.float32), mask=j < L)


def logits_tiling(T: int, L: int) -> tuple[int, int, int, bool]:
    """(block_n, sub_n, num_warps, keys_m) for T query rows over L positions: keys as the dot's
    rows always (the head sum stays within a warp: 1.4-1.8x over heads as rows); one 64-position
    tile a program while the programs are few, 512 positions in sub-tiles (q loaded once) from
    8192 programs on. From the H100 sweep of bench_dsa_indexer.py (benchmarks/README.md)."""
    if T * triton.cdiv(L, 64) >= 8192:
        return 512, 64, 4, True
    return 64, 64, 4, True


def launch_index_logits(
    q,
    w,
    cache,
    block_table,
    krow,
    ends,
    out,
    block_size: int,
    fp8: bool,
    block_n: int | None = None,
    dot_fp8: bool = False,
    sub_n: int | None = None,
    num_warps: int | None = None,
    keys_m: bool | None = None,
) -> None:
    """Framework-neutral launch. q [T, H, D] (float32, or e4m3 with ``dot_fp8``), w float32 [T, H],
    cache uint8 [blocks, bs, 1, D + 4] (``fp8``) or float [blocks, bs, 1, D], block_table int32
    [B, max_blocks], krow int32 [T] (the table row of each query), ends int [T] (each at most L),
    out float32 [T, L]. A program scores ``block_n`` positions, ``sub_n`` at a time; ``keys_m``
    puts the keys on the dot's rows. Unset tiling comes from ``logits_tiling``."""
    T, H, D = int(q.shape[0]), int(q.shape[1]), int(q.shape[2])
    L = int(out.shape[1])
    if T == 0 or L == 0:
        return
    tiling = logits_tiling(T, L)
    block_n = block_n or tiling[0]
    sub_n, num_warps = sub_n or tiling[1], num_warps or tiling[2]
    keys_m = tiling[3] if keys_m is None else keys_m
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
        SUB_N=min(sub_n, block_n),
        FP8=fp8,
        DOT_DTYPE=tl.float8e4nv if dot_fp8 else tl.float32,
        KEYS_M=keys_m,
        num_warps=num_warps,
    )


@triton.jit
def _order_key(score):
    """float32 -> uint32 in the same order: positive floats get the sign bit set, negative ones
    have every bit flipped (so -inf is 0x007FFFFF, above the masked positions' 0)."""
    bits = score.to(tl.uint32, bitcast=True)
    flip = tl.where((bits >> 31) == 1, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
    return bits ^ flip


@triton.jit
def _tile_keys(logits_ptr, t, stride_l, j, end):
    """Order keys of positions j (< end, else 0) of row t."""
    s = tl.load(logits_ptr + t * stride_l + j, mask=j < end, other=float("-inf"))
    return tl.where(j < end, _order_key(s), 0)


@triton.jit
def _topk_kernel(logits_ptr, ends_ptr, out_ptr, stride_l, stride_o, K_OUT, TILE: tl.constexpr):
    """One program a row: the k best positions, in ascending position order, then -1.

    A row ending within k keeps positions 0..end-1. Otherwise a radix select finds the k-th
    largest order key, 8 bits a pass from the top: each pass counts, among the keys whose higher
    bits equal the prefix found so far, each value of the next byte (a 512-bin histogram whose
    upper half takes the keys that do not match), and keeps the byte where the count of keys
    above reaches the k still wanted. Then one pass writes every position above that key and the
    first ``rem`` positions equal to it (ties to the lower position), in order, by running
    counts."""
    t = tl.program_id(0).to(tl.int64)
    end = tl.load(ends_ptr + t)
    r = tl.arange(0, TILE)
    if end <= K_OUT:
        for first in range(0, K_OUT, TILE):
            i = first + r
            tl.store(out_ptr + t * stride_o + i, tl.where(i < end, i, -1).to(tl.int32), mask=i < K_OUT)
    else:
        b = tl.arange(0, 512)
        prefix = tl.zeros([], tl.uint32)
        rem = K_OUT
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.zeros([512], tl.int32)
            for start in range(0, end, TILE):
                j = start + r
                key = _tile_keys(logits_ptr, t, stride_l, j, end)
                digit = ((key >> shift) & 0xFF).to(tl.int32)
                if p == 0:
                    match = j < end
                else:
                    match = (j < end) & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
                hist += tl.histogram(tl.where(match, digit, digit + 256), 512)
            count = tl.where(b < 256, hist, 0)
            at_or_above = tl.sum(count, 0) - tl.cumsum(count, 0) + count
            d = tl.sum((at_or_above >= rem).to(tl.int32), 0) - 1
            rem -= tl.sum(tl.where(b == d, at_or_above - count, 0), 0)
            prefix = prefix | (d.to(tl.uint32) << shift)
        taken = tl.zeros([], tl.int32)
        ties = tl.zeros([], tl.int32)
        for start in range(0, end, TILE):
            j = start + r
            key = _tile_keys(logits_ptr, t, stride_l, j, end)
            eq = (key == prefix).to(tl.int32)
            take = ((key > prefix) | ((eq == 1) & (ties + tl.cumsum(eq, 0) - eq < rem))).to(tl.int32)
            tl.store(out_ptr + t * stride_o + taken + tl.cumsum(take, 0) - take, j.to(tl.int32), mask=take == 1)
            taken += tl.sum(take, 0)
            ties += tl.sum(eq, 0)


def launch_index_topk(logits, ends, out, tile: int = 4096, num_warps: int = 8) -> None:
    """logits float32 [T, L] (-inf past each row's end), ends int [T], out int32 [T, k]. 4096
    positions a tile on 8 warps: the fastest of 2048 x 4, 4096 x 8 and 8192 x 16 at 4K and 32K
    contexts (H100), 4.3x-6.3x the sort-merge form it replaced."""
    T = int(out.shape[0])
    if T == 0:
        return
    launch(_topk_kernel, (T,), logits, ends, out, stride(logits, 0), stride(out, 0), int(out.shape[1]), TILE=tile,
           num_warps=num_warps)  # fmt: skip
