"""SamplingParams (vLLM's names and defaults; a bad value is a ValueError whose message starts
with the field's name), SamplingState, what the sampler keeps of them per request, and
SamplingBatch, what the sampler reads of a step's sampled rows."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "lark")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text (docs/design.md §4.12): ``kind`` one of
    STRUCTURED_KINDS, ``spec`` its text (a JSON Schema, a regex, a JSON list of choices, a Lark
    grammar; "" for json_object), ``param`` the request field it came from (named in errors).
    ``after``: the constraint starts after this text is generated (one token of the vocabulary,
    e.g. "</think>"); before it the output is free."""

    kind: str
    spec: str = ""
    param: str = "structured_outputs"
    after: str | None = None


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob and this many alternatives
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    structured: StructuredOutput | None = None
    n: int = 1  # samples of the prompt (LLM.generate runs each as its own request, see sample)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop = list(self.stop or [])
        self.logit_bias = dict(self.logit_bias or {})
        checks = [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "must be an integer >= 1"),
            ("n", _is_int(self.n) and self.n >= 1, "must be an integer >= 1"),
            ("temperature", _is_num(self.temperature) and self.temperature >= 0, "must be a finite number >= 0"),
            ("top_p", _is_num(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "must be -1 or >= 1"),
            ("min_p", _is_num(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("seed", self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**64), "must be in 0..2^64-1"),
            (
                "logprobs",
                self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
                "must be an integer in 0..20",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
                "must be an integer in 0..20",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "must be token ids"),
            (
                "presence_penalty",
                _is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                "must be in [-2, 2]",
            ),
            (
                "frequency_penalty",
                _is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                "must be in [-2, 2]",
            ),
            ("repetition_penalty", _is_num(self.repetition_penalty) and self.repetition_penalty > 0, "must be > 0"),
            (
                "logit_bias",
                all(_is_int(t) and t >= 0 and _is_num(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()),
                "must map token ids to biases in [-100, 100]",
            ),
            (
                "min_tokens",
                _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
                "must be an integer in 0..max_tokens",
            ),
        ]
        if self.structured is not None and self.structured.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured: kind must be one of {STRUCTURED_KINDS}, got {self.structured.kind!r}")
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

    def sample(self, k: int) -> SamplingParams:
        """The k-th of n samples as one request's params: n = 1 and seed + k (mod 2^64), so the
        samples differ and each reproduces; without a seed each sample draws its own."""
        seed = None if self.seed is None else (self.seed + k) % 2**64
        return dataclasses.replace(self, n=1, seed=seed)


@dataclass
class SamplingState:
    """What the sampler needs of one request. ``seed`` (64-bit, drawn at random when the request
    gives none) keys the device sampler's draws with the request's step; ``rng`` is the numpy
    reference's generator. ``min_tokens_stop_ids``: tokens banned while fewer than ``min_tokens``
    are generated (EOS, stop_token_ids)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int = 0
    logprobs: int | None = None
    rng: np.random.Generator | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()

    @property
    def penalized(self) -> bool:
        """Whether sampling reads the request's token counts."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class SamplingBatch:
    """The rows one sampler call draws, one per request: ``keys`` the requests' ids (a penalty
    count slot belongs to one), ``states`` their SamplingState (one object a request: the device
    sampler knows a slot's owner by it), ``prompt_ids`` their prompts and ``output_ids`` their
    output so far, with the tokens accepted earlier in this step (speculative verification)."""

    keys: list[str]
    states: list[SamplingState]
    prompt_ids: list[Sequence[int]]
    output_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.keys)
