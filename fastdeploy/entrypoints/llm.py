"""Offline API: ``LLM(model=...).generate(prompts, sampling_params)`` (vLLM's conventions)."""

from __future__ import annotations

from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.request import RequestOutput
from fastdeploy.sampling_params import SamplingParams


class LLM:
    """``LLM(model="tiny-mla-swa", block_size=..., max_num_seqs=..., ...)``: the engine's
    settings (EngineArgs fields) as keyword arguments."""

    def __init__(self, model: str = "tiny-mla-swa", **kwargs) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | list[str | dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """A prompt is a string or ``{"prompt_token_ids": [...]}``; one output per prompt, in order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        ids = []
        for p, sp in zip(prompts, params, strict=True):
            field = "prompt"
            if isinstance(p, dict):
                if "prompt_token_ids" not in p:
                    raise ValueError("a dict prompt needs 'prompt_token_ids'")
                p, field = p["prompt_token_ids"], "prompt_token_ids"
            ids.append(self.engine.add_request(p, sp, param=field).request_id)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]
