"""Prompt logprobs (vLLM's ``prompt_logprobs``): which rows of a step give them, their raw
log-softmax from the model's hidden states, and where they go in each request."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle

from fastdeploy.request import Request

PROMPT_LOGPROB_ROWS = 256  # prompt-logprob rows whose float32 [rows, vocab] logits exist at once

PromptLogprobs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class PromptLogprobRows:
    """A step's token ``rows`` whose logits give a prompt token's logprob, that token
    (``targets``), and the most top alternatives any request asks for (``k``)."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    k: int = 0


def prompt_logprob_span(req: Request, n: int, start: int | None = None) -> range:
    """The positions p of the request's n tokens from ``start`` (default: its next) whose logits
    give a prompt token's logprob (that of token p + 1): every position of the chunk before the
    prompt's last."""
    start = req.num_computed_tokens if start is None else start
    return range(start, min(start + n, req.num_prompt_tokens - 1))


def prompt_logprob_rows(scheduled: list[tuple[Request, int]]) -> PromptLogprobRows:
    """The step's rows, in scheduled order, of every request that asks for prompt logprobs."""
    rows, targets, k, row = [], [], 0, 0
    for req, n in scheduled:
        if req.prompt_logprobs is not None:
            span = prompt_logprob_span(req, n)
            rows += [row + p - req.num_computed_tokens for p in span]
            targets += [req.prompt_token_ids[p + 1] for p in span]
            k = max(k, req.sampling_params.prompt_logprobs)
        row += n
    return PromptLogprobRows(rows, targets, k)


def compute_prompt_logprobs(
    compute_logits, hidden: paddle.Tensor, want: PromptLogprobRows, is_driver: bool
) -> PromptLogprobs | None:
    """Raw (unprocessed) log-softmax of the logits at hidden[rows] (``compute_logits(hidden,
    rows)``), read at the targets: their logprobs float32 [R], their ranks int64 [R] (1 + tokens
    with a larger logit), and the k most likely tokens' ids int64 [R, k] and logprobs float32
    [R, k]. Logits of PROMPT_LOGPROB_ROWS rows at a time (a whole prompt's would be [P, vocab]).
    Other ranks run only the LM head, whose vocabulary gather needs them, and return None."""
    parts, rows, k = [], want.rows, want.k
    for s in range(0, len(rows), PROMPT_LOGPROB_ROWS):
        logits = compute_logits(hidden, paddle.to_tensor(rows[s : s + PROMPT_LOGPROB_ROWS]))
        if not is_driver:
            continue
        lse = paddle.logsumexp(logits, axis=1, keepdim=True)
        tgt = paddle.to_tensor(want.targets[s : s + PROMPT_LOGPROB_ROWS], dtype="int64").unsqueeze(1)
        at = paddle.take_along_axis(logits, tgt, axis=1)
        rank = (logits > at).astype("int64").sum(1) + 1
        if k:
            top, ids = paddle.topk(logits, k, axis=1)
            top, ids = (top - lse).numpy(), ids.numpy()
        else:
            top, ids = np.zeros((len(at), 0), np.float32), np.zeros((len(at), 0), np.int64)
        parts.append(((at - lse).squeeze(1).numpy(), rank.numpy(), ids, top))
    return tuple(np.concatenate(x) for x in zip(*parts, strict=True)) if parts else None


def record_prompt_logprobs(scheduled: list[tuple[Request, int]], starts: list[int], prompt: PromptLogprobs) -> None:
    """Write the step's prompt logprobs into their requests by position, in the order
    ``prompt_logprob_rows`` listed them (``starts``: each request's first position in the step);
    by position, so a step retried or recomputed after preemption writes the same entries again."""
    lp, rank, ids, top = prompt
    r = 0
    for (req, n), start in zip(scheduled, starts, strict=True):
        if req.prompt_logprobs is None:
            continue
        k = req.sampling_params.prompt_logprobs
        for p in prompt_logprob_span(req, n, start):  # the entry of prompt token p + 1
            entry = {int(t): float(v) for t, v in zip(ids[r, :k], top[r, :k], strict=True)}
            entry[req.prompt_token_ids[p + 1]] = float(lp[r])
            req.prompt_logprobs[p + 1], req.prompt_ranks[p + 1] = entry, int(rank[r])
            r += 1
