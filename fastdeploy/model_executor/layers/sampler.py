"""Sampling: greedy, temperature, top-k, top-p, per-request seed, and top-N logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingState:
    """What the sampler needs of one request; ``rng`` is per request so a seed reproduces."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    logprobs: int | None = None
    rng: np.random.Generator | None = None


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def sample(logits: np.ndarray, states: list[SamplingState]) -> list[SampleResult]:
    """logits float32 [B, vocab] (one row per request) -> a token per row.

    Logprobs are of the model's distribution (before temperature / top-k / top-p), as vLLM
    reports them; the chosen token is always among ``top_logprobs``."""
    out = []
    for row, st in zip(logits.astype(np.float64), states, strict=True):
        logp = _log_softmax(row)
        if st.temperature == 0.0:
            tok = int(np.argmax(row))
        else:
            z = row / st.temperature
            if 0 < st.top_k < z.size:
                kth = np.partition(z, -st.top_k)[-st.top_k]
                z = np.where(z >= kth, z, -np.inf)
            p = np.exp(_log_softmax(z))
            if st.top_p < 1.0:
                order = np.argsort(-p, kind="stable")
                csum = np.cumsum(p[order])
                keep = order[: int(np.searchsorted(csum, st.top_p) + 1)]
                mask = np.zeros_like(p, dtype=bool)
                mask[keep] = True
                p = np.where(mask, p, 0.0)
                p /= p.sum()
            rng = st.rng if st.rng is not None else np.random.default_rng()
            tok = int(rng.choice(p.size, p=p))
        top = None
        if st.logprobs is not None:
            n = min(st.logprobs, logp.size)
            ids = np.argsort(-logp, kind="stable")[:n].tolist() if n > 0 else []
            top = {int(i): float(logp[i]) for i in ids}
            top[tok] = float(logp[tok])
        out.append(SampleResult(tok, float(logp[tok]), top))
    return out
