"""Offline API: ``LLM(model=...).generate(prompts, sampling_params)`` (vLLM's conventions)."""

from __future__ import annotations

import dataclasses

from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.dp_engine import create_engine
from fastdeploy.request import RequestOutput
from fastdeploy.sampling_params import SamplingParams


class LLM:
    """``LLM(model="tiny-mla-swa", block_size=..., max_num_seqs=..., ...)``: the engine's
    settings (EngineArgs fields) as keyword arguments."""

    def __init__(self, model: str = "tiny-mla-swa", **kwargs) -> None:
        self.engine = create_engine(EngineArgs(model=model, **kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | list[str | dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """A prompt is a string or ``{"prompt_token_ids": [...]}``; one output per prompt, in order,
        with ``params.n`` completions (index 0..n-1; sample k seeded seed + k)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        rows: list[list[str]] = []
        for p, sp in zip(prompts, params, strict=True):
            field = "prompt"
            if isinstance(p, dict):
                if "prompt_token_ids" not in p:
                    raise ValueError("a dict prompt needs 'prompt_token_ids'")
                p, field = p["prompt_token_ids"], "prompt_token_ids"
            samples = [self.engine.make_request(p, sp.sample(k), param=field) for k in range(sp.n)]
            for req in samples[1:]:
                if self.engine.config.cache_config.enable_prefix_caching and req.prompt_logprobs is None:
                    req.prefill_after = samples[0]  # one prefill of the prompt, its blocks shared
            for req in samples:
                self.engine.enqueue(req)
            rows.append([req.request_id for req in samples])
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [self._merged([done[i] for i in row]) for row in rows]

    @staticmethod
    def _merged(samples: list[RequestOutput]) -> RequestOutput:
        """One prompt's n sample outputs as one RequestOutput (vLLM's shape): the first sample's
        prompt fields, each sample's completion with its index."""
        first = samples[0]
        if len(samples) == 1:
            return first
        outputs = [dataclasses.replace(s.outputs[0], index=k) for k, s in enumerate(samples)]
        error = next((s.error for s in samples if s.error), None)
        return dataclasses.replace(first, outputs=outputs, error=error)
