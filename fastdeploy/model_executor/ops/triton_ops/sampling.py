"""Device sampler op (docs/design.md §4.11): B rows of logits -> a token and its logprob a row,
with only [B]-sized results leaving the device.

Per row, in this order (the numpy ``layers/sampler.py`` is the reference): repetition, presence
and frequency penalties from the row's count tables (``counts[slot]`` output occurrences,
``seen[slot]`` prompt tokens; slot -1: none), logit bias (``bias_ids`` / ``bias_vals``, -inf bans a
token), temperature (below SAMPLING_EPS: greedy, the arg-max), min-p, top-k (ties at the k-th all
kept), top-p (the smallest prefix by mass reaching it, ties by token id), then a Gumbel-max draw
whose noise is a counter-based hash of (the row's 64-bit key, token id): the same key draws the
same token whatever the batch. The logprob is of the raw row (the model's distribution).

``sample_tokens`` runs the Triton kernels (``sampling_kernel.py``) or ``sample_tokens_ref``, the
same contract in paddle ops (sort-based), which serves on CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import paddle

from fastdeploy.model_executor.ops.triton_ops.sampling_kernel import (
    CUT_DEPTHS,
    F_FREQUENCY,
    F_MIN_P,
    F_PRESENCE,
    F_REPETITION,
    F_TEMPERATURE,
    F_TOP_P,
    FLT_MAX,
    I_SLOT,
    I_TOP_K,
    KMAX,
    SAMPLING_EPS,
    gumbel_noise,
    launch_sample,
    num_chunks,
    row_keys,
)

__all__ = ["KMAX", "Sampled", "row_keys", "sample_tokens", "sample_tokens_ref"]


class Sampled(NamedTuple):
    tokens: paddle.Tensor  # int32 [B]
    logprobs: paddle.Tensor  # float32 [B], of the raw row
    lse: paddle.Tensor  # float32 [B], log-sum-exp of the raw row
    bad: paddle.Tensor  # bool [B], the raw row has a NaN or an infinity


@functools.cache
def _cut_depths() -> paddle.Tensor:
    """CUT_DEPTHS on the device, uploaded once (not on every step)."""
    return paddle.to_tensor(np.asarray(CUT_DEPTHS, np.float32))


def sample_tokens(
    logits: paddle.Tensor,
    counts: paddle.Tensor,
    seen: paddle.Tensor,
    fparams: paddle.Tensor,
    iparams: paddle.Tensor,
    seeds: paddle.Tensor,
    bias_ids: paddle.Tensor,
    bias_vals: paddle.Tensor,
    *,
    triton: bool,
    kmax: int = KMAX,
    block: int = 2048,
) -> Sampled:
    """logits float32 / bfloat16 [B, V]; counts int32 and seen uint8 [S, V]; fparams float32
    [B, 8] and iparams int32 [B, 4] (column names in ``sampling_kernel.py``); seeds int32 [B, 2]
    (``row_keys``); bias_ids int32 / bias_vals float32 [B, NB >= 1] (id -1: unused; the first
    iparams[:, I_NUM_BIAS] of a row are used). ``kmax`` and ``block`` (tokens a kernel loop step)
    are the Triton kernels' tuning."""
    if not triton:
        return sample_tokens_ref(logits, counts, seen, fparams, iparams, seeds, bias_ids, bias_vals)
    B, V = logits.shape
    work = paddle.empty([B, V], "float32")
    stats = paddle.empty([B, 4], "float32")
    argmax = paddle.empty([B], "int32")
    scratch_y = paddle.empty([B, kmax], "float32")
    scratch_id = paddle.empty([B, kmax], "int32")
    tokens = paddle.empty([B], "int32")
    logprobs = paddle.empty([B], "float32")
    depths = _cut_depths()
    C = num_chunks(B, V, block)
    part = paddle.empty([B, C, 8], "float32")
    cuts = paddle.empty([B, C, 34], "float32")
    launch_sample(
        logits,
        work,
        counts,
        seen,
        fparams,
        iparams,
        seeds,
        bias_ids,
        bias_vals,
        depths,
        stats,
        argmax,
        scratch_y,
        scratch_id,
        tokens,
        logprobs,
        part,
        cuts,
        block=block,
    )
    return Sampled(tokens, logprobs, stats[:, 0], stats[:, 3] > 0)


def sample_tokens_ref(
    logits: paddle.Tensor,
    counts: paddle.Tensor,
    seen: paddle.Tensor,
    fparams: paddle.Tensor,
    iparams: paddle.Tensor,
    seeds: paddle.Tensor,
    bias_ids: paddle.Tensor,
    bias_vals: paddle.Tensor,
) -> Sampled:
    """``sample_tokens`` in paddle ops: sorts each row instead of selecting by radix."""
    B, V = logits.shape
    x = logits.astype("float32")
    bad = ~paddle.isfinite(x).all(axis=1)
    lse = paddle.logsumexp(x, axis=1)
    f = fparams
    slot = iparams[:, I_SLOT].astype("int64")
    has = (slot >= 0).unsqueeze(1)
    rows = slot.clip(min=0)
    cnt = paddle.where(has, counts[rows].astype("float32"), paddle.zeros([B, V], "float32"))
    seen_any = has & ((seen[rows] != 0) | (cnt > 0))
    rep = f[:, F_REPETITION : F_REPETITION + 1]
    z = paddle.where(seen_any, paddle.where(x > 0, x / rep, x * rep), x)
    z = z - paddle.where(cnt > 0, f[:, F_PRESENCE : F_PRESENCE + 1] + f[:, F_FREQUENCY : F_FREQUENCY + 1] * cnt, 0.0)
    vocab = paddle.arange(V, dtype="int32").unsqueeze(0)
    for j in range(bias_ids.shape[1]):
        z = paddle.where(vocab == bias_ids[:, j : j + 1], z + bias_vals[:, j : j + 1], z)
    temp = f[:, F_TEMPERATURE : F_TEMPERATURE + 1]
    greedy = temp < SAMPLING_EPS
    y = (z / paddle.where(greedy, paddle.ones_like(temp), temp)).clip(max=FLT_MAX)  # overflow: the arg-max
    m = y.max(axis=1, keepdim=True)
    min_p = f[:, F_MIN_P : F_MIN_P + 1]
    cm = paddle.where(min_p > 0, m + paddle.log(min_p.clip(min=1e-30)), paddle.full_like(m, -np.inf))
    y_m = paddle.where(y >= cm, y, paddle.full_like(y, -np.inf))
    order = paddle.argsort(y_m, axis=1, descending=True, stable=True)
    ys = paddle.take_along_axis(y_m, order, axis=1)
    k = iparams[:, I_TOP_K : I_TOP_K + 1].astype("int64")
    k_on = (k > 0) & (k < V)
    kth = paddle.take_along_axis(ys, (k - 1).clip(min=0, max=V - 1), axis=1)
    t1 = paddle.where(k_on, paddle.maximum(kth, cm), cm)
    p = paddle.where(ys >= t1, paddle.exp(ys - m), paddle.zeros_like(ys))
    cum = paddle.cumsum(p / p.sum(axis=1, keepdim=True), axis=1)
    top_p = f[:, F_TOP_P : F_TOP_P + 1]
    last = (cum < top_p).astype("int64").sum(axis=1, keepdim=True)  # the prefix reaching top_p ends here
    rank = paddle.arange(V, dtype="int64").unsqueeze(0)
    keep_sorted = (ys >= t1) & ((top_p >= 1.0) | (rank <= last))
    keep = paddle.put_along_axis(paddle.zeros([B, V], "int32"), order, keep_sorted.astype("int32"), axis=1) > 0
    noise = paddle.to_tensor(gumbel_noise(np.arange(V), seeds.numpy()))
    score = paddle.where(keep, y + noise, paddle.full_like(y, -np.inf))
    tokens = paddle.where(greedy.squeeze(1), z.argmax(axis=1), score.argmax(axis=1)).astype("int32")
    logprobs = paddle.take_along_axis(x, tokens.astype("int64").unsqueeze(1), axis=1).squeeze(1) - lse
    return Sampled(tokens, logprobs, lse, bad)
