"""DeepSeek-V3.2's lightning indexer (DSA; docs/design.md §4.17): the scores that pick which cached
keys each query's sparse MLA attends, and the pick. ``index_logits`` scores every query of a step
against the positions of its request's block-table row: the Triton kernel
(``lightning_indexer_kernel.py``, prefill and decode rows in one launch) or the paddle reference
(``index_logits_ref``, one key gather a request).

For query t with indexer heads h (q [T, H, D], its rope already applied) and cached keys s
(k [S, D]):

    score[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])   for s < ends[t], else -inf

where w = weights_proj(x) * H^-0.5 * D^-0.5, times q's per-head scale when q is quantized. With
FP8, q and k are e4m3 per D-vector with power-of-two scales (``quantize_pow2_e4m3``); without,
the scales are 1 (the unquantized path Hugging Face's ``DeepseekV32Indexer`` computes). The pick
is the top ``min(topk, ends[t])`` keys by score, highest first, ties to the lower key id, then -1.

The indexer cache keeps each token's key once per DSA layer (``../shared/DESIGN.md`` §T), paged
like the layer's latent: with FP8 a block of ``bs`` tokens is one page of ``bs * (D + 4)`` bytes,
the ``bs`` keys' e4m3 codes (D bytes each) first, then their ``bs`` float32 scales (DeepGEMM's
paged layout when bs is 64); unquantized, a key is D values in the cache's dtype. The tensor is
[num_blocks, bs, 1, D + 4] uint8 or [num_blocks, bs, 1, D] (the KVSpec shape); only its bytes'
order within a block differs from the shape's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import paddle

from fastdeploy.model_executor.ops.triton_ops.launcher import interpret_mode
from fastdeploy.model_executor.ops.triton_ops.lightning_indexer_kernel import (
    launch_index_key_write,
    launch_index_logits,
    launch_index_topk,
)

SCALE_BYTES = 4  # one float32 scale a key in an FP8 page
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4  # DeepSeek's act_quant floors amax here, so an all-zero vector gets a finite scale


def quantize_pow2_e4m3(x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
    """x [..., D] float32 -> (e4m3 values as float32 [..., D], scale float32 [...]): per D-vector,
    scale = 2^ceil(log2(max(amax, 1e-4) / 448)), the values x / scale rounded to e4m3 (nearest,
    ties to even). A power of two divides exactly, so values * scale is the de-quantized x."""
    amax = x.abs().max(-1).clip(min=AMAX_FLOOR)
    scale = paddle.pow(paddle.full_like(amax, 2.0), paddle.ceil(paddle.log2(amax / E4M3_MAX)))
    q = (x / scale.unsqueeze(-1)).astype("float8_e4m3fn").astype("float32")
    return q, scale


def index_scores(
    q: paddle.Tensor,
    w: paddle.Tensor,
    k: paddle.Tensor,
    ends: paddle.Tensor,
    k_scale: paddle.Tensor | None = None,
) -> paddle.Tensor:
    """q [T, H, D], w [T, H], k [S, D] shared by the queries or [T, S, D] a query each (float32),
    ends int [T] (query t sees keys 0..ends[t]-1), k_scale [S] / [T, S] or None -> scores float32
    [T, S], -inf where a query does not see the key."""
    per_query = k.ndim == 3
    logits = paddle.nn.functional.relu(paddle.einsum("thd,tsd->ths" if per_query else "thd,sd->ths", q, k))
    scores = paddle.einsum("th,ths->ts", w, logits)
    if k_scale is not None:
        scores = scores * (k_scale if per_query else k_scale.unsqueeze(0))
    seen = paddle.arange(k.shape[-2], dtype="int64").unsqueeze(0) < ends.astype("int64").unsqueeze(1)
    return paddle.where(seen, scores, paddle.full_like(scores, float("-inf")))


def index_topk(scores: paddle.Tensor, ends: paddle.Tensor, topk: int) -> paddle.Tensor:
    """scores [T, S] as ``index_scores`` makes them (-inf past each row's end), ends int [T] ->
    int32 [T, topk]: each row's top min(topk, ends[t]) key ids by score (ties to the lower id), in
    ascending id order, then -1. Attention does not depend on the order; this one is what a
    select-then-compact kernel writes."""
    T, S = scores.shape
    kk = min(topk, S)
    # a stable descending sort keeps equal scores in id order
    order = paddle.argsort(scores, axis=1, descending=True, stable=True)[:, :kk]
    valid = paddle.arange(kk, dtype="int64").unsqueeze(0) < ends.astype("int64").clip(max=kk).unsqueeze(1)
    ids = paddle.sort(paddle.where(valid, order, paddle.full_like(order, S)), axis=1)
    ids = paddle.where(ids < S, ids, paddle.full_like(ids, -1)).astype("int32")
    if kk < topk:
        ids = paddle.concat([ids, paddle.full([T, topk - kk], -1, "int32")], axis=1)
    return ids


# ---------------------------------------------------------------- the indexer cache


def index_key_width(cache: paddle.Tensor) -> int:
    """D, the key width of an indexer cache [num_blocks, bs, 1, D + 4] (uint8) or [.., D]."""
    return cache.shape[-1] - SCALE_BYTES if cache.dtype == paddle.uint8 else cache.shape[-1]


def _page_bytes(slots: paddle.Tensor, block_size: int, d: int) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Byte offsets in a flat FP8 indexer cache of the keys at ``slots`` int64 [n]: their codes
    [n, D] and their scales [n, 4]."""
    page = (slots // block_size) * (block_size * (d + SCALE_BYTES))
    off = (slots % block_size).unsqueeze(1)
    codes = page.unsqueeze(1) + off * d + paddle.arange(d, dtype="int64")
    scales = page.unsqueeze(1) + block_size * d + off * SCALE_BYTES + paddle.arange(SCALE_BYTES, dtype="int64")
    return codes, scales


def write_index_keys_ref(k: paddle.Tensor, slots: paddle.Tensor, cache: paddle.Tensor) -> None:
    """Store keys k [T, D] (float32) at ``slots`` int32 [T] of the indexer cache, in place: e4m3
    codes and power-of-two scales (``quantize_pow2_e4m3``) in a uint8 cache, the values in a float
    one. Every row is written in device ops (a static shape, no host read: a captured step runs
    it): a slot < 0 writes the cache's last slot, the null block's, which no pool hands out."""
    n_slots = cache.shape[0] * cache.shape[1]
    slots = slots.astype("int64")
    slots = paddle.where(slots >= 0, slots, paddle.full_like(slots, n_slots - 1))
    if cache.dtype != paddle.uint8:
        cache.reshape([n_slots, cache.shape[-1]])[slots] = k.astype(cache.dtype)  # reshape is a view
        return
    values, scale = quantize_pow2_e4m3(k.astype("float32"))
    codes, scales = _page_bytes(slots, cache.shape[1], index_key_width(cache))
    flat = cache.reshape([-1])
    flat[codes.flatten()] = values.astype("float8_e4m3fn").view("uint8").flatten()  # exact: already e4m3
    flat[scales.flatten()] = scale.astype("float32").contiguous().view("uint8").flatten()


def write_index_keys_triton(k: paddle.Tensor, slots: paddle.Tensor, cache: paddle.Tensor) -> None:
    """The Triton kernel of ``write_index_keys_ref``: the same bytes (codes and scales, or values)."""
    fp8 = cache.dtype == paddle.uint8
    launch_index_key_write(
        k.astype("float32").contiguous(), slots.astype("int32").contiguous(), cache, cache.shape[1], fp8
    )


def read_index_keys_ref(cache: paddle.Tensor, slots: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """The keys at ``slots`` int64 [...] (each >= 0) -> (float32 [..., D], their float32 scales
    [...], None for an unquantized cache). FP8 keys come back as their e4m3 values: key = values *
    scale."""
    lead, flat_slots = list(slots.shape), slots.reshape([-1]).astype("int64")
    d = index_key_width(cache)
    if cache.dtype != paddle.uint8:
        keys = cache.reshape([-1, d])[flat_slots].astype("float32")
        return keys.reshape(lead + [d]), None
    codes, scales = _page_bytes(flat_slots, cache.shape[1], d)
    flat = cache.reshape([-1])
    values = flat[codes.flatten()].view("float8_e4m3fn").astype("float32").reshape(lead + [d])
    scale = flat[scales.flatten()].reshape([-1, SCALE_BYTES]).contiguous().view("float32").reshape(lead)
    return values, scale


# ---------------------------------------------------------------- a step's logits


class KeyRows(Protocol):
    """Some queries of a step and their keys (``step_plan.IndexRows``): ``tokens`` (t0, t1) or
    None (all), ``key_slots`` int64 [L] (positions 0..L-1 of one request) or [n, L] (a row each),
    ``ends`` int64 [n]."""

    tokens: tuple[int, int] | None
    key_slots: paddle.Tensor
    ends: paddle.Tensor


def index_logits_ref(
    q: paddle.Tensor, w: paddle.Tensor, cache: paddle.Tensor, rows: Sequence[KeyRows], width: int
) -> paddle.Tensor:
    """Paddle reference of ``index_logits_triton``: q [T, H, D], w [T, H] float32 (q's scale in w
    for an FP8 cache) -> float32 [T, width], logit of each query at each key position, -inf past
    its end; the keys read once for each entry of ``rows``."""
    out = []
    for r in rows:
        t = slice(None) if r.tokens is None else slice(*r.tokens)
        keys, k_scale = read_index_keys_ref(cache, r.key_slots)
        s = index_scores(q[t], w[t], keys, r.ends, k_scale)
        if s.shape[1] < width:
            s = paddle.concat([s, paddle.full([s.shape[0], width - s.shape[1]], float("-inf"), "float32")], 1)
        out.append(s)
    return out[0] if len(out) == 1 else paddle.concat(out)


def index_logits_triton(
    q: paddle.Tensor,
    w: paddle.Tensor,
    cache: paddle.Tensor,
    block_table: paddle.Tensor,
    krow: paddle.Tensor,
    ends: paddle.Tensor,
    width: int,
    block_n: int | None = None,
    sub_n: int | None = None,
    keys_m: bool | None = None,
) -> paddle.Tensor:
    """q [T, H, D], w [T, H] float32, the indexer cache, block_table int32 [B, max_blocks],
    krow int32 [T] (each query's table row), ends int [T] -> float32 [T, width]: query t against
    positions 0..width-1 of its row (width at most max_blocks x bs, each end at most width). With
    an FP8 cache q holds e4m3 values (``quantize_pow2_e4m3``): on the GPU they go to the dot as
    e4m3, exactly."""
    T = q.shape[0]
    out = paddle.empty([T, width], "float32")
    fp8 = cache.dtype == paddle.uint8
    dot_fp8 = fp8 and not interpret_mode()
    launch_index_logits(
        q.astype("float8_e4m3fn" if dot_fp8 else "float32").contiguous(),
        w.astype("float32").contiguous(),
        cache,
        block_table.astype("int32").contiguous(),
        krow.astype("int32").contiguous(),
        ends.astype("int64").contiguous(),
        out,
        cache.shape[1],
        fp8,
        block_n=block_n,
        dot_fp8=dot_fp8,
        sub_n=sub_n,
        keys_m=keys_m,
    )
    return out


def index_topk_triton(scores: paddle.Tensor, ends: paddle.Tensor, topk: int) -> paddle.Tensor:
    """The Triton kernel of ``index_topk``: the same ids (ties to the lower id), then -1."""
    out = paddle.empty([scores.shape[0], topk], "int32")
    launch_index_topk(scores.astype("float32").contiguous(), ends.astype("int64").contiguous(), out)
    return out
