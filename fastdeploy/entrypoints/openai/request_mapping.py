"""OpenAI request bodies -> engine requests (off the event loop).

Pydantic (``protocol.py``) checks types and OpenAI's ranges; this module checks what only the
API has (the model name, unsupported features, chat message parts, tools, the output
constraint) and turns each prompt into ``n`` engine requests, whose values the engine validates
once (``make_request``: token ids in the vocabulary, the context length; ``SamplingParams``:
sampling ranges), each error an APIError naming its field.
"""

from __future__ import annotations

import json
from dataclasses import replace

from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.entrypoints.openai.protocol import (
    MAX_STOP,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    param_of,
)
from fastdeploy.entrypoints.openai.tools import check_history_call, check_tool_choice, check_tools
from fastdeploy.input.tokenizer import THINK_END
from fastdeploy.request import Request as EngineRequest
from fastdeploy.sampling_params import SamplingParams, StructuredOutput


def bad_unicode(value, path: str = "") -> str | None:
    """The dotted path of the first string in ``value`` that UTF-8 cannot encode, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for k, v in value.items():
            bad = bad_unicode(v, f"{path}.{k}" if path else str(k))
            if bad:
                return bad
    elif isinstance(value, list):
        for i, v in enumerate(value):
            bad = bad_unicode(v, f"{path}.{i}")
            if bad:
                return bad
    return None


class RequestMapper:
    """Checks a body and makes its engine requests (``prepare_completion`` / ``prepare_chat``:
    one row of ``n`` requests per prompt); any thread may call it."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_name: str,
        max_seqs_per_request: int = 256,
        reasoning_parser: str | None = None,
    ) -> None:
        self.engine = engine
        self.name = served_model_name
        self.max_seqs = max_seqs_per_request
        self.reasoning_parser = reasoning_parser
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.prefix_caching = engine.enable_prefix_caching

    def check_body(self, body) -> None:
        """What every body is checked for first: Unicode that UTF-8 can encode, then the model."""
        bad_text = bad_unicode(body.model_dump())
        if bad_text:
            raise APIError(400, f"{bad_text}: invalid Unicode (a lone surrogate cannot be encoded)", bad_text)
        if body.model is not None and body.model != self.name:
            raise APIError(404, f"The model `{body.model}` does not exist.", "model", code="model_not_found")

    def _check_common(self, body) -> None:
        self.check_body(body)
        for f in ("functions", "function_call"):
            if getattr(body, f) is not None:
                raise APIError(400, f"{f}: deprecated by OpenAI; use tools and tool_choice", f)
        if not isinstance(body, ChatCompletionRequest):
            for f in ("tools", "tool_choice", "parallel_tool_calls"):
                if getattr(body, f) is not None:
                    raise APIError(400, f"{f}: tool calling is a chat feature (/v1/chat/completions)", f)
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(400, "prompt_logprobs: not available with stream=true", "prompt_logprobs")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stops)}", "stop")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options: only allowed with stream=true", "stream_options")

    @staticmethod
    def _structured(body) -> StructuredOutput | None:
        """The request's one output constraint, from response_format, structured_outputs or
        guided_* (vLLM's); a 400 naming the fields when more than one is given."""
        found: list[StructuredOutput] = []
        rf = body.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutput("json_object", "", "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise APIError(400, "response_format.json_schema: required for type json_schema", "response_format")
            found.append(StructuredOutput("json", json.dumps(rf.json_schema.schema_), "response_format.json_schema"))
        so = body.structured_outputs
        pairs = [
            ("guided_json", body.guided_json, "json"),
            ("guided_regex", body.guided_regex, "regex"),
            ("guided_choice", body.guided_choice, "choice"),
            ("guided_grammar", body.guided_grammar, "lark"),
        ]
        if so is not None:
            pairs += [
                ("structured_outputs.json", so.json_, "json"),
                ("structured_outputs.regex", so.regex, "regex"),
                ("structured_outputs.choice", so.choice, "choice"),
                ("structured_outputs.grammar", so.grammar, "lark"),
                ("structured_outputs.json_object", so.json_object or None, "json_object"),
            ]
        for param, value, kind in pairs:
            if value is None:
                continue
            if kind == "json_object":
                spec = ""
            elif kind == "choice" or (kind == "json" and not isinstance(value, str)):
                spec = json.dumps(value)
            else:
                spec = value
            found.append(StructuredOutput(kind, spec, param))
        if len(found) > 1:
            names = " and ".join(f.param for f in found)
            raise APIError(
                400, f"{found[1].param}: only one output constraint a request ({names} given)", found[1].param
            )
        if found and body.min_tokens:
            raise APIError(400, "min_tokens: cannot be combined with a structured output", "min_tokens")
        return found[0] if found else None

    @staticmethod
    def _logit_bias(body) -> dict[int, float]:
        """OpenAI's string keys as token ids (the engine checks ids and biases)."""
        out = {}
        for k, v in (body.logit_bias or {}).items():
            if not (k.isascii() and k.isdigit()):  # "١" and "²" are digits to str.isdigit
                raise APIError(400, f"logit_bias: key {k!r} is not a token id", "logit_bias")
            out[int(k)] = v
        return out

    def _params(
        self,
        body,
        max_tokens: int | None,
        logprobs: int | None,
        n_prompt: int,
        k: int,
        structured: StructuredOutput | None,
    ) -> SamplingParams:
        """The k-th of body.n samples: seeds seed + k, so the n samples differ and reproduce."""
        room = self.max_model_len - n_prompt
        field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
        if max_tokens is None:
            max_tokens = max(room, 1)  # a prompt with no room left is the engine's error to name
        elif max_tokens > room >= 1:
            msg = (
                f"{field}: this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {n_prompt} and {field} asks for {max_tokens} more"
            )
            raise APIError(400, msg, field)
        seed = None if body.seed is None else body.seed % 2**64
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is None and getattr(body, "echo", False) and logprobs is not None:
            prompt_logprobs = logprobs  # the echoed prompt carries logprobs like the generated tokens
        try:
            return SamplingParams(
                max_tokens=max(max_tokens, 1),  # 0 (echo only): one token is generated and dropped
                prompt_logprobs=prompt_logprobs,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                min_p=body.min_p,
                seed=seed,
                logprobs=logprobs,
                stop_token_ids=body.stop_token_ids or [],
                stop=[body.stop] if isinstance(body.stop, str) else body.stop or [],  # "" is a 400, as [""]
                ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=self._logit_bias(body),
                min_tokens=body.min_tokens,
                structured=structured,
            ).sample(k)
        except ValueError as e:
            raise APIError(400, str(e), param_of(str(e))) from None

    def _requests(
        self,
        rid: str,
        prompts: list[tuple[str | list[int], str]],
        body,
        max_tokens,
        logprobs,
        structured: StructuredOutput | None,
    ) -> list[list[EngineRequest]]:
        """body.n requests per (prompt text or token ids, its field name), made and validated by
        the engine (nothing queued yet); every sample gets the request's one output constraint."""
        if len(prompts) * body.n > self.max_seqs:
            raise APIError(
                400,
                f"n: {len(prompts)} prompts x n={body.n} would start {len(prompts) * body.n} sequences; at most "
                f"{self.max_seqs} a request (--max-seqs-per-request)",
                "n",
            )
        out = []
        for i, (prompt, param) in enumerate(prompts):
            if isinstance(prompt, str):  # a chat template spells its own special tokens
                ids = self.tokenizer.encode(prompt, add_special_tokens=param != "messages")
            else:
                ids = prompt
            row = []
            for k in range(body.n):
                try:
                    params = self._params(body, max_tokens, logprobs, len(ids), k, structured)
                    req = self.engine.make_request(list(ids), params, f"{rid}-{i}-{k}", param=param)
                except ValueError as e:
                    raise APIError(400, str(e), param_of(str(e))) from None
                if isinstance(prompt, str) and param != "messages":
                    req.prompt = prompt  # echo returns it as given
                req.group = rid  # fair admission between API calls
                if row and self.prefix_caching and req.prompt_logprobs is None:
                    req.prefill_after = row[0]  # share the prompt's blocks through the prefix cache
                row.append(req)
            out.append(row)
        return out

    def prepare_completion(self, body: CompletionRequest, rid: str) -> list[list[EngineRequest]]:
        self._check_common(body)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens: 0 needs echo=true (it returns the prompt alone)", "max_tokens")
        p = body.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            prompts = [p]
        else:
            prompts = list(p)  # a batch: strings or token-id lists
        if not prompts:
            raise APIError(400, "prompt: must not be empty", "prompt")
        named = [(x, "prompt" if len(prompts) == 1 else f"prompt.{i}") for i, x in enumerate(prompts)]
        return self._requests(rid, named, body, body.max_tokens, body.logprobs, self._structured(body))

    @staticmethod
    def messages(chat: list) -> list[dict]:
        """OpenAI chat messages as the chat template takes them (text parts joined, tool calls
        checked); a 400 naming the message and field for what is not supported."""
        messages = []
        for i, m in enumerate(chat):
            content = m.content or ""
            if isinstance(content, list):
                parts = []
                for j, p in enumerate(content):
                    if p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise APIError(
                            400, f"messages.{i}.content: only text parts are supported", f"messages.{i}.content"
                        )
                    extra = sorted(set(p) - {"type", "text"})
                    if extra:  # unknown keys are a 400 here as everywhere else
                        where = f"messages.{i}.content.{j}"
                        raise APIError(400, f"{where}: unknown field {extra[0]!r}", where)
                    parts.append(p["text"])
                content = "".join(parts)
            msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
            if m.tool_calls is not None:
                if m.role != "assistant":
                    raise APIError(
                        400,
                        f"messages.{i}.tool_calls: only assistant messages carry tool calls",
                        f"messages.{i}.tool_calls",
                    )
                msg["tool_calls"] = [
                    check_history_call(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(m.tool_calls)
                ]
                msg["content"] = m.content if m.content else None
            if m.role == "tool":
                if m.tool_call_id is None:
                    raise APIError(
                        400, f"messages.{i}.tool_call_id: required for a tool message", f"messages.{i}.tool_call_id"
                    )
                msg["tool_call_id"] = m.tool_call_id
            messages.append(msg)
        return messages

    def prepare_chat(self, body: ChatCompletionRequest, rid: str) -> list[list[EngineRequest]]:
        self._check_common(body)
        so = self._structured(body)
        messages = self.messages(body.messages)
        tools = check_tools(body.tools)
        grammar = check_tool_choice(body.tool_choice, tools, body.parallel_tool_calls)
        forced = None
        if grammar is not None:
            if so is not None:
                raise APIError(400, f"{so.param}: cannot be combined with tool_choice {body.tool_choice!r}", so.param)
            forced = StructuredOutput("lark", grammar, "tool_choice")
        try:
            text = self.tokenizer.apply_chat_template(messages, body.add_generation_prompt, tools or None)
        except ValueError as e:
            raise APIError(400, f"messages: {e}", "messages") from None
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        top_n = body.top_logprobs or 0
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = top_n if body.logprobs else None
        so = forced or so
        if so is not None and self.reasoning_parser is not None:  # the reasoning stays free
            so = replace(so, after=THINK_END)
        return self._requests(rid, [(text, "messages")], body, max_tokens, logprobs, so)
