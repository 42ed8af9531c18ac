"""The numpy sampler, the reference of the device sampler (``ops/triton_ops/sampling.py``):
penalties, logit bias, min_tokens, greedy / temperature / min-p / top-k / top-p, per-request seed,
and top-N logprobs.

Robust for every accepted parameter value: temperatures below SAMPLING_EPS act as greedy (as in
vLLM); top-k and top-p always keep at least the arg-max; a row whose logits are not finite is an
error for that request alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy.sampling_params import SamplingState

SAMPLING_EPS = 1e-5
DBL_MAX = np.finfo(np.float64).max


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def top_p_mask(p: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest set of most likely tokens whose probability mass reaches top_p (ties broken
    by token id); always at least the arg-max."""
    order = np.argsort(-p, kind="stable")
    keep = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1
    mask = np.zeros(p.shape, bool)
    mask[order[:keep]] = True
    return mask


def adjusted_logits(row: np.ndarray, st: SamplingState, prompt: list[int], output: list[int]) -> np.ndarray:
    """float64 logits after repetition / presence / frequency penalties, logit bias and min_tokens.
    Repetition (vLLM / HF): a seen token's logit is divided by it when positive, multiplied when
    not. Presence and frequency (OpenAI): minus presence once and frequency per occurrence in the
    output."""
    z = row.copy()
    with np.errstate(over="ignore"):
        z = _penalized(z, st, prompt, output)
    return np.minimum(z, DBL_MAX)  # a tiny repetition_penalty overflows: those tokens tie at the top


def _penalized(z: np.ndarray, st: SamplingState, prompt: list[int], output: list[int]) -> np.ndarray:
    if st.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(prompt + output, np.int64))
        z[seen] = np.where(z[seen] > 0, z[seen] / st.repetition_penalty, z[seen] * st.repetition_penalty)
    if output and (st.presence_penalty or st.frequency_penalty):
        ids, counts = np.unique(np.asarray(output, np.int64), return_counts=True)
        z[ids] -= st.presence_penalty + st.frequency_penalty * counts
    for t, bias in st.logit_bias.items():
        z[t] += bias
    if len(output) < st.min_tokens and st.min_tokens_stop_ids:
        z[list(st.min_tokens_stop_ids)] = -np.inf
    return z


def kept_mask(z: np.ndarray, st: SamplingState) -> tuple[np.ndarray, np.ndarray]:
    """Adjusted logits z float64 [vocab] of a sampled row -> (z / temperature, the tokens a draw
    may pick): min-p (p >= min_p * max p), then top-k (ties at the k-th all kept), then top-p of
    what remains. Always keeps the arg-max."""
    with np.errstate(over="ignore"):
        y = np.minimum(z / st.temperature, DBL_MAX)
    keep = np.ones(y.shape, bool)
    if st.min_p > 0:
        p = np.exp(_log_softmax(y))
        keep &= p >= st.min_p * p.max()
    if 0 < st.top_k < y.size:
        yk = np.where(keep, y, -np.inf)
        keep &= yk >= np.partition(yk, -st.top_k)[-st.top_k]
    if st.top_p < 1.0:
        p = np.exp(_log_softmax(np.where(keep, y, -np.inf)))
        keep &= top_p_mask(p, st.top_p)
    return y, keep


def sample_one(row: np.ndarray, st: SamplingState, prompt: list[int], output: list[int]) -> SampleResult:
    """row float64 [vocab] -> a token. Logprobs are of the model's distribution (before penalties,
    temperature, top-k and top-p), as vLLM reports them; the chosen token is always among them."""
    if not np.isfinite(row).all():
        raise ValueError("the model's logits for this request are not finite")
    logp = _log_softmax(row)
    z = adjusted_logits(row, st, prompt, output)
    if st.temperature < SAMPLING_EPS:
        tok = int(np.argmax(z))
    else:
        y, keep = kept_mask(z, st)
        p = np.exp(_log_softmax(np.where(keep, y, -np.inf)))
        rng = st.rng if st.rng is not None else np.random.default_rng()
        tok = int(rng.choice(p.size, p=p))
    top = None
    if st.logprobs is not None:
        n = min(st.logprobs, logp.size)
        ids = np.argsort(-logp, kind="stable")[:n].tolist() if n > 0 else []
        top = {int(i): float(logp[i]) for i in ids}
        top[tok] = float(logp[tok])
    return SampleResult(tok, float(logp[tok]), top)


def sample(
    logits: np.ndarray,
    states: list[SamplingState],
    histories: list[tuple[list[int], list[int]]] | None = None,
) -> list[SampleResult | Exception]:
    """logits float32 [B, vocab] (one row per request), each request's (prompt, output) token ids
    -> a token per row, or the exception that sampling that row raised (it fails that request only)."""
    histories = histories or [([], [])] * len(states)
    out: list[SampleResult | Exception] = []
    for row, st, (prompt, output) in zip(logits.astype(np.float64), states, histories, strict=True):
        try:
            out.append(sample_one(row, st, prompt, output))
        except Exception as e:  # noqa: BLE001 - handed to the engine, which fails this request
            out.append(e)
    return out
