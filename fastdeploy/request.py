"""A request's state through the engine, and what it returns."""

from __future__ import annotations

import enum
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastdeploy.sampling_params import SamplingBatch, SamplingParams, SamplingState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine failed this request (finish_reason "error")
    # with SamplingParams.prompt_logprobs: per prompt token (None for the first), its raw logprob
    # and the top alternatives' {token: logprob}, and its rank in the vocabulary (1 = most likely)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    # a prefill instance's, with MTP: the drafts after the first token, for the decode instance
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(eq=False)  # a request is itself: lists of them compare by identity
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    output_text: str = ""
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_tables: dict[str, list[int]] = field(default_factory=dict)  # per KV cache group; -1 released
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    swa_released_upto: int = 0  # SWA table entries before this one are all -1
    finish_reason: str | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    error: str | None = None
    prefill_after: Request | None = None  # an earlier sample of the same prompt (prefix sharing)
    group: str | None = None  # the API call it belongs to (fair admission); None: itself
    matcher: Any = None  # the structured-output matcher (llguidance), advanced with each output token
    grammar_after: int | None = None  # the matcher waits until this token is generated (e.g. </think>)
    kv_target: Any = None  # a prefill instance's: where its prompt's KV goes when it finishes (engine/kv_handoff.py)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled by position as the prompt is computed
    prompt_ranks: list[int | None] | None = None
    draft_token_ids: list[int] = field(default_factory=list)  # the draft model's guesses of the next tokens
    # the overlapped loop (docs/design.md §4.18): tokens sampled by launched steps the host has not
    # taken yet (the scheduler counts them, step inputs hold placeholders for them), and tokens
    # counted as computed whose steps have not been taken yet (a failed step is retried from them)
    pending_tokens: int = 0
    inflight_tokens: int = 0

    def __post_init__(self) -> None:
        sp = self.sampling_params
        rng = np.random.default_rng(sp.seed) if sp.seed is not None else None
        banned = tuple(sp.stop_token_ids) + (() if sp.ignore_eos else tuple(self.eos_token_ids))
        self.sampling_state = SamplingState(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            seed=sp.seed if sp.seed is not None else secrets.randbits(64),
            logprobs=sp.logprobs,
            rng=rng,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty,
            logit_bias=sp.logit_bias,
            min_tokens=sp.min_tokens,
            min_tokens_stop_ids=banned,
        )
        if sp.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
            self.prompt_ranks = [None] * len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens known or pending whose KV is not computed (or launched) yet."""
        return self.num_tokens + self.pending_tokens - self.num_computed_tokens

    def draft_room(self, max_model_len: int, new_tokens: int = 0) -> int:
        """Drafts the next step could verify once ``new_tokens`` more are appended: a step
        verifying m drafts adds up to m + 1 tokens, within max_tokens and max_model_len."""
        left = min(self.sampling_params.max_tokens - len(self.output_token_ids), max_model_len - self.num_tokens)
        return max(0, left - new_tokens - 1)

    def num_drafts(self, n: int) -> int:
        """Drafts among the n tokens a step computes for this request: those past its own tokens."""
        return max(0, min(n - (self.num_tokens - self.num_computed_tokens), len(self.draft_token_ids)))

    @property
    def group_key(self) -> str:
        return self.group if self.group is not None else self.request_id

    @property
    def constrained(self) -> bool:
        """Whether the structured-output matcher masks this request's next token."""
        return self.matcher is not None and self.grammar_after is None

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def to_output(self) -> RequestOutput:
        lp = list(self.output_logprobs) if self.sampling_params.logprobs is not None else None  # a snapshot
        out = CompletionOutput(0, self.output_text, list(self.output_token_ids), lp, self.finish_reason)
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [out],
            self.is_finished,
            self.num_cached_tokens,
            self.error,
            self.prompt_logprobs,  # not copied: complete once the prompt is computed, then unchanged
            self.prompt_ranks,
            list(self.draft_token_ids) if self.kv_target is not None else [],
        )


def sampling_batch(
    reqs: Sequence[Request], pending: Sequence[list[int]] | None = None, outputs: Sequence[list[int]] | None = None
) -> SamplingBatch:
    """The sampler's view of ``reqs``; ``pending[b]``: tokens of request b accepted in this step
    before the row it samples (speculative verification), counted as its output; ``outputs[b]``:
    its output ids as the step sees them (default ``output_token_ids``; the overlapped loop passes
    a snapshot taken at launch plus the tokens the step before sampled). A request with nothing
    pending lends its list (no copy a row a step)."""
    outs = outputs if outputs is not None else [r.output_token_ids for r in reqs]
    return SamplingBatch(
        [r.request_id for r in reqs],
        [r.sampling_state for r in reqs],
        [r.prompt_token_ids for r in reqs],
        [outs[b] + pending[b] if pending and pending[b] else outs[b] for b in range(len(reqs))],
    )
