"""What the data-parallel front and its engine cores send each other (docs/design.md §4.19):
a routed request (``CoreRequest``) one way, what a step added to a request (``CoreOutput``,
made by ``Deltas``) the other. In a module of their own: a core runs as ``__main__``, and a
message's class must pickle under its module's name."""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy.request import Request, RequestOutput, RequestStatus
from fastdeploy.sampling_params import SamplingParams


@dataclass(frozen=True)
class CoreRequest:
    """What the front sends of a request it made and checked: the core makes it again (its own
    grammar matcher) under the same id."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_time: float
    group: str | None
    prefill_after: str | None  # the id of an earlier sample of the same prompt on this core


@dataclass(frozen=True)
class CoreOutput:
    """What a step added to one request, for the front to apply to its copy (``apply``): the new
    tokens (and their top logprobs), the text from character ``text_from`` on (the text grows
    at its end, except at a stop string's cut: then all of it), the finish, and the prompt's
    logprobs once (with the request's first output: its prompt is computed by then). A step's
    message stays the size of its new tokens."""

    request_id: str
    token_ids: list[int]
    logprobs: list | None
    text_from: int
    text: str
    finished: bool
    finish_reason: str | None
    error: str | None
    num_cached_tokens: int
    first_scheduled_time: float | None
    prompt_logprobs: list | None = None
    prompt_ranks: list | None = None

    def apply(self, req: Request) -> None:
        req.output_token_ids.extend(self.token_ids)
        if self.logprobs is not None:
            req.output_logprobs.extend(self.logprobs)
        req.output_text = req.output_text[: self.text_from] + self.text
        req.num_cached_tokens, req.error = self.num_cached_tokens, self.error
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.first_scheduled_time
        if self.prompt_logprobs is not None:
            req.prompt_logprobs, req.prompt_ranks = self.prompt_logprobs, self.prompt_ranks
        if self.finished:
            req.finish_reason, req.status = self.finish_reason, RequestStatus.FINISHED


class Deltas:
    """The core's side of ``CoreOutput``: what it sent of each unfinished request."""

    def __init__(self) -> None:
        self.sent: dict[str, tuple[int, str, bool]] = {}  # tokens, text, prompt logprobs sent

    def of(self, out: RequestOutput, scheduled: float | None) -> CoreOutput:
        comp = out.outputs[0]
        n, text, prompt_sent = self.sent.get(out.request_id, (0, "", False))
        cut = 0 if not comp.text.startswith(text) else len(text)
        send_prompt = not prompt_sent and out.prompt_logprobs is not None  # complete by a request's first output
        if out.finished:
            self.sent.pop(out.request_id, None)
        else:
            self.sent[out.request_id] = (len(comp.token_ids), comp.text, prompt_sent or send_prompt)
        return CoreOutput(
            out.request_id,
            comp.token_ids[n:],
            comp.logprobs[n:] if comp.logprobs is not None else None,
            cut,
            comp.text[cut:],
            out.finished,
            comp.finish_reason,
            out.error,
            out.num_cached_tokens,
            scheduled,
            out.prompt_logprobs if send_prompt else None,
            out.prompt_ranks if send_prompt else None,
        )
