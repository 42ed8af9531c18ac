"""DeepSeek-V3.2's lightning indexer (DSA; ``../shared/DESIGN.md`` §T): the scores that pick which
cached keys each query's sparse MLA attends, and the pick. Paddle references; the Triton kernels
(prefill logits, paged decode logits, per-row top-k) come beside them.

For query t with indexer heads h (q [T, H, D], its rope already applied) and cached keys s
(k [S, D]):

    score[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])   for s < ends[t], else -inf

where w = weights_proj(x) * H^-0.5 * D^-0.5, times q's per-head scale when q is quantized. With
FP8, q and k are e4m3 per D-vector with power-of-two scales (``quantize_pow2_e4m3``); without,
the scales are 1 (the unquantized path Hugging Face's ``DeepseekV32Indexer`` computes). The pick
is the top ``min(topk, ends[t])`` keys by score, highest first, ties to the lower key id, then -1.
"""

from __future__ import annotations

import paddle

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
    """q [T, H, D], w [T, H], k [S, D] (float32), ends int [T] (query t sees keys 0..ends[t]-1),
    k_scale [S] or None -> scores float32 [T, S], -inf where a query does not see the key."""
    logits = paddle.nn.functional.relu(paddle.einsum("thd,sd->ths", q, k))  # [T, H, S]
    scores = paddle.einsum("th,ths->ts", w, logits)
    if k_scale is not None:
        scores = scores * k_scale.unsqueeze(0)
    seen = paddle.arange(k.shape[0], dtype="int64").unsqueeze(0) < ends.astype("int64").unsqueeze(1)
    return paddle.where(seen, scores, paddle.full_like(scores, float("-inf")))


def index_topk(scores: paddle.Tensor, ends: paddle.Tensor, topk: int) -> paddle.Tensor:
    """scores [T, S] as ``index_scores`` makes them (-inf past each row's end), ends int [T] ->
    int32 [T, topk]: each row's top min(topk, ends[t]) key ids by score, highest first, ties to
    the lower id, then -1."""
    T, S = scores.shape
    kk = min(topk, S)
    # a stable descending sort keeps equal scores in id order
    order = paddle.argsort(scores, axis=1, descending=True, stable=True)[:, :kk]
    ids = order.astype("int32")
    valid = paddle.arange(kk, dtype="int64").unsqueeze(0) < ends.astype("int64").clip(max=kk).unsqueeze(1)
    ids = paddle.where(valid, ids, paddle.full_like(ids, -1))
    if kk < topk:
        ids = paddle.concat([ids, paddle.full([T, topk - kk], -1, "int32")], axis=1)
    return ids
