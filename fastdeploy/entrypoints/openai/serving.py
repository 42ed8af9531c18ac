"""OpenAI request handling: a validated request body -> engine requests -> the response.

Pydantic (``protocol.py``) checks types and OpenAI's ranges; this module checks what only the
API has (the model name, unsupported features, chat message parts) and turns each prompt into
``n`` engine requests, whose values the engine validates once (``LLMEngine.make_request``:
token ids in the vocabulary, the context length; ``SamplingParams``: sampling ranges), each error
naming its field. It then streams the engine's outputs as ``Delta``s to ``response.py``, and
aborts a request whose client went away.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from fastdeploy.engine.async_engine import AsyncLLMEngine, EngineDeadError, ServerDrainingError
from fastdeploy.entrypoints.openai.protocol import (
    MAX_STOP,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    param_of,
)
from fastdeploy.entrypoints.openai.response import Delta, ResponseFormatter
from fastdeploy.entrypoints.openai.tools import check_history_call, check_tool_choice, check_tools
from fastdeploy.input.tokenizer import THINK_END
from fastdeploy.request import Request as EngineRequest
from fastdeploy.request import RequestOutput
from fastdeploy.sampling_params import SamplingParams, StructuredOutput

logger = logging.getLogger("fastdeploy")
DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


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


class OpenAIServer:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_name: str,
        max_seqs_per_request: int = 256,
        reasoning_parser: str | None = None,
    ) -> None:
        self.engine = engine
        self.reasoning_parser = reasoning_parser
        self.name = served_model_name
        self.max_seqs = max_seqs_per_request
        self.metrics = engine.metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.prefix_caching = engine.enable_prefix_caching
        self.created = int(time.time())

    # ------------------------------------------------------------ requests -> engine (off the event loop)

    def _check_body(self, body) -> None:
        """What every body is checked for first: Unicode that UTF-8 can encode, then the model."""
        bad_text = bad_unicode(body.model_dump())
        if bad_text:
            raise APIError(400, f"{bad_text}: invalid Unicode (a lone surrogate cannot be encoded)", bad_text)
        if body.model is not None and body.model != self.name:
            raise APIError(404, f"The model `{body.model}` does not exist.", "model", code="model_not_found")

    def _check_common(self, body) -> None:
        self._check_body(body)
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

    def _prepare_completion(self, body: CompletionRequest, rid: str) -> list[list[EngineRequest]]:
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
    def _messages(chat: list) -> list[dict]:
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

    def _prepare_chat(self, body: ChatCompletionRequest, rid: str) -> list[list[EngineRequest]]:
        self._check_common(body)
        so = self._structured(body)
        messages = self._messages(body.messages)
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

    def _submit(self, reqs: list[list[EngineRequest]]) -> list[tuple[EngineRequest, asyncio.Queue]]:
        flat, queued = [r for row in reqs for r in row], []
        try:
            for r in flat:
                queued.append((r, self.engine.add(r)))
        except (EngineDeadError, ServerDrainingError) as e:
            for r, _ in queued:
                self.engine.abort(r.request_id)
            raise APIError(503, str(e), None, "service_unavailable") from None
        return queued

    def _echo(self, out: RequestOutput, logprobs: bool) -> Delta:
        """The prompt as a completion's first delta: its text (as given, or its ids decoded), its
        ids, and with logprobs its prompt logprobs (None for the first token)."""
        text = out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids, False)
        lps = list(out.prompt_logprobs) if logprobs else []
        return Delta(text, list(out.prompt_token_ids), lps, None, out)

    async def _deltas(self, req: EngineRequest, q: asyncio.Queue, echo: str | None = None) -> AsyncIterator[Delta]:
        """Text and token increments; holds back text that may still turn into a stop string.
        ``echo`` "prompt": the first delta starts with the prompt; "only" (max_tokens 0): the
        prompt alone, finish_reason "length", the generated token dropped from text and usage."""
        hold = max((len(s) for s in req.sampling_params.stop), default=1) - 1
        logprobs = req.sampling_params.logprobs is not None
        sent_text, sent_tok = 0, 0
        try:
            async for out in self.engine.stream(req.request_id, q):
                if out.error is not None:
                    raise APIError(500, f"the engine failed this request: {out.error}", None, "internal_server_error")
                c = out.outputs[0]
                if echo == "only":
                    if out.finished:
                        kept = replace(c, text="", token_ids=[], logprobs=[] if logprobs else None)
                        d = self._echo(replace(out, outputs=[kept]), logprobs)
                        yield replace(d, finish_reason="length")
                    continue
                end = len(c.text) if out.finished else max(sent_text, len(c.text) - hold)
                lp = c.logprobs[sent_tok:] if c.logprobs is not None else []
                reason = c.finish_reason if out.finished else None
                d = Delta(c.text[sent_text:end], c.token_ids[sent_tok:], lp, reason, out)
                yield self._echo(out, logprobs) + d if echo and sent_tok == 0 else d
                sent_text, sent_tok = end, len(c.token_ids)
        except (EngineDeadError, ServerDrainingError) as e:
            raise APIError(503, str(e), None, "service_unavailable") from None
        except ValueError as e:  # the engine refused the request (e.g. its id is in use)
            raise APIError(400, str(e), param_of(str(e))) from None

    # ------------------------------------------------------------ engine -> response

    async def respond(self, http: Request, queued, body, fmt: ResponseFormatter):
        echo = ("only" if body.max_tokens == 0 else "prompt") if getattr(body, "echo", False) else None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            merged: asyncio.Queue = asyncio.Queue()

            async def pump(index: int, req: EngineRequest, q: asyncio.Queue) -> None:
                try:
                    async for d in self._deltas(req, q, echo):
                        await merged.put((index, d))
                except BaseException as e:  # noqa: BLE001 - handed to the SSE writer
                    await merged.put((index, e))
                await merged.put((index, None))

            async def events():
                while True:
                    yield await merged.get()

            async def sse():
                tasks = [asyncio.ensure_future(pump(i, r, q)) for i, (r, q) in enumerate(queued)]
                try:
                    async for line in fmt.sse(events(), len(queued), include_usage):
                        yield line
                finally:
                    for t in tasks:
                        t.cancel()

            return StreamingResponse(sse(), media_type="text/event-stream")

        async def collect(req: EngineRequest, q: asyncio.Queue) -> Delta:
            full = None
            async for d in self._deltas(req, q, echo):
                full = d if full is None else full + d
            return full

        gathered = asyncio.ensure_future(asyncio.gather(*(collect(r, q) for r, q in queued)))
        while not gathered.done():  # a client that goes away aborts its requests within a poll
            await asyncio.wait({gathered}, timeout=DISCONNECT_POLL_S)
            if not gathered.done() and await http.is_disconnected():
                gathered.cancel()
                gathered.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no ERROR log
                logger.info("client disconnected: aborting %d sequence(s) of %s", len(queued), fmt.base["id"])
                for r, _ in queued:
                    self.engine.abort(r.request_id)
                return JSONResponse(error_body("client disconnected"), status_code=499)
        try:
            fulls = gathered.result()
        except BaseException:
            for r, _ in queued:  # one sample failed: the others are aborted too
                self.engine.abort(r.request_id)
            raise
        return JSONResponse(fmt.body(fulls))

    # ------------------------------------------------------------ tokenizer (vLLM's endpoints)

    def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""
        self._check_body(body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(self._messages(body.messages), body.add_generation_prompt)
            except ValueError as e:
                raise APIError(400, f"messages: {e}", "messages") from None
            special = bool(body.add_special_tokens)  # the template spells its own by default
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        ids = self.tokenizer.encode(text, add_special_tokens=special)
        strs = [self.tokenizer.decode([t], False) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: token ids to text (special tokens kept)."""
        self._check_body(body)
        vocab = self.tokenizer.vocab_size
        for i, t in enumerate(body.tokens):
            if not 0 <= t < vocab:
                raise APIError(400, f"tokens.{i}: {t} is not a token id in 0..{vocab - 1}", f"tokens.{i}")
        return {"prompt": self.tokenizer.decode(body.tokens, False)}

    def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: what a client needs to tokenize as the server does
        (lm-evaluation-harness's remote tokenizer reads it)."""
        tok = self.tokenizer
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": tok.pad_token,
            "add_bos_token": tok.add_bos,
            "chat_template": tok.config.get("chat_template"),
            "model_max_length": self.max_model_len,
            "vocab_size": tok.vocab_size,
        }

    # ------------------------------------------------------------ endpoints

    def _formatter(self, rid: str, queued, body, chat: bool, top_n: int) -> ResponseFormatter:
        logprobs = queued[0][0].sampling_params.logprobs is not None
        reasoning = self.reasoning_parser is not None
        tools = chat and bool(body.tools) and body.tool_choice != "none"  # parse calls from the text
        return ResponseFormatter(
            self.tokenizer, rid, self.name, chat, logprobs, top_n, body.n, reasoning, tools, body.prompt_logprobs
        )

    async def completions(self, http: Request, body: CompletionRequest):
        rid = f"cmpl-{uuid.uuid4().hex}"
        queued = self._submit(await run_in_threadpool(self._prepare_completion, body, rid))
        return await self.respond(http, queued, body, self._formatter(rid, queued, body, False, body.logprobs or 0))

    async def chat(self, http: Request, body: ChatCompletionRequest):
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        queued = self._submit(await run_in_threadpool(self._prepare_chat, body, rid))
        return await self.respond(http, queued, body, self._formatter(rid, queued, body, True, body.top_logprobs or 0))
