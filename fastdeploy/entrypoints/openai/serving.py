"""The generation endpoints: a body's engine requests (``request_mapping.py``) queued on the
engine, its outputs streamed as ``Delta``s to ``response.py`` (text held back while it may still
become a stop string), and every request of a body aborted when its client goes away."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from fastdeploy.engine.async_engine import AsyncLLMEngine, EngineDeadError, ServerDrainingError
from fastdeploy.engine.kv_handoff import KVTarget, PrefillResult
from fastdeploy.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    param_of,
)
from fastdeploy.entrypoints.openai.request_mapping import RequestMapper
from fastdeploy.entrypoints.openai.response import Delta, ResponseFormatter
from fastdeploy.model_executor.layers.sampler import SampleResult
from fastdeploy.request import Request as EngineRequest
from fastdeploy.request import RequestOutput

logger = logging.getLogger("fastdeploy")
DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


class OpenAIServer:
    """/v1/completions and /v1/chat/completions: a body's engine requests (``RequestMapper``)
    queued, their outputs streamed as deltas to ``response.py``, aborted when the client goes."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_name: str,
        max_seqs_per_request: int = 256,
        reasoning_parser: str | None = None,
    ) -> None:
        self.engine = engine
        self.mapping = RequestMapper(engine, served_model_name, max_seqs_per_request, reasoning_parser)
        self.reasoning_parser = reasoning_parser
        self.name = served_model_name
        self.metrics = engine.metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.created = int(time.time())
        self.reserved: dict[str, tuple] = {}  # a decode instance's: handle -> (path, body, sequences, when)
        self.kv_timeout = engine.engine.config.kv_transfer_config.kv_timeout
        self.vocab_size = engine.engine.config.model_config.vocab_size

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
        reqs = await run_in_threadpool(self.mapping.prepare_completion, body, rid)
        if body.kv_transfer_params is not None:
            return await self.prefill_for_remote(reqs, body)
        queued = self._submit(reqs)
        return await self.respond(http, queued, body, self._formatter(rid, queued, body, False, body.logprobs or 0))

    async def chat(self, http: Request, body: ChatCompletionRequest):
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        reqs = await run_in_threadpool(self.mapping.prepare_chat, body, rid)
        if body.kv_transfer_params is not None:
            return await self.prefill_for_remote(reqs, body)
        queued = self._submit(reqs)
        return await self.respond(http, queued, body, self._formatter(rid, queued, body, True, body.top_logprobs or 0))

    # ------------------------------------------------------------ prefill / decode disaggregation

    async def prefill_for_remote(self, reqs: list[list[EngineRequest]], body):
        """A prefill instance (docs/design.md §4.20): each sequence's prompt computed, its first
        token drawn, and its prompt's KV pushed to the decode instance's target before its blocks
        are freed; returns each first token (id, logprob, top logprobs) for the decode's
        /v1/kv/continue."""
        flat = [r for row in reqs for r in row]
        targets = body.kv_transfer_params.get("targets")
        if not isinstance(targets, list) or len(targets) != len(flat):
            raise APIError(400, f"kv_transfer_params.targets: {len(flat)} KV targets expected", "kv_transfer_params")
        for r, t in zip(flat, targets, strict=True):
            try:
                r.kv_target = KVTarget.from_json(t) if isinstance(t, dict) else KVTarget.from_json({})
            except ValueError as e:
                raise APIError(400, str(e), "kv_transfer_params") from None
            if r.sampling_params.max_tokens != 1:
                raise APIError(400, "max_tokens: a remote prefill draws the first token only (1)", "max_tokens")
        queued = self._submit([flat])
        firsts = []
        for r, q in queued:
            outs = [o async for o in self.engine.stream(r.request_id, q)]
            out = outs[-1] if outs else None
            if out is None or out.error is not None:
                why = out.error if out is not None else "no output"
                raise APIError(500, f"the remote prefill failed: {why}", None, "internal_server_error")
            c = out.outputs[0]
            top = c.logprobs[0] if c.logprobs else None
            tok = c.token_ids[0]
            first = SampleResult(tok, top.get(tok, 0.0) if top else 0.0, top)
            handed = PrefillResult(
                first, out.num_cached_tokens, out.draft_token_ids, out.prompt_logprobs, out.prompt_ranks
            )
            firsts.append(handed.to_json())
        return JSONResponse({"first_tokens": firsts})

    async def kv_reserve(self, raw: dict) -> JSONResponse:
        """A decode instance: the body a client sent (``path`` completions or chat) made into its
        sequences, each one's blocks reserved (a KV target each; the prefill instance fills them),
        kept under a handle for ``kv_continue``."""
        path, body = raw.get("path"), raw.get("body")
        if path not in ("completions", "chat") or not isinstance(body, dict):
            raise APIError(400, "kv reserve: {'path': 'completions' | 'chat', 'body': {...}} expected", "path")
        model = CompletionRequest if path == "completions" else ChatCompletionRequest
        try:
            parsed = model.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(x) for x in err["loc"])
            raise APIError(400, f"{field}: {err['msg']}", field) from None
        rid = f"{'cmpl' if path == 'completions' else 'chatcmpl'}-{uuid.uuid4().hex}"
        prepare = self.mapping.prepare_completion if path == "completions" else self.mapping.prepare_chat
        flat = [r for row in await run_in_threadpool(prepare, parsed, rid) for r in row]
        targets = []
        try:
            for r in flat:
                targets.append(await run_in_threadpool(self.engine.call, lambda e, r=r: e.reserve(r)))
        except (EngineDeadError, ServerDrainingError) as e:
            self._cancel(flat)
            raise APIError(503, str(e), None, "service_unavailable") from None
        except ValueError as e:
            self._cancel(flat)
            raise APIError(503 if "no KV blocks free" in str(e) else 400, str(e), "kv_transfer_params") from None
        now = time.monotonic()
        for h in [h for h, e in self.reserved.items() if now - e[3] > self.kv_timeout]:  # freed by the engine
            del self.reserved[h]
        self.reserved[rid] = (path, parsed, flat, now)
        return JSONResponse({"handle": rid, "targets": [t.to_json() for t in targets]})

    async def kv_continue(self, http: Request, raw: dict):
        """A decode instance: the reserved sequences of ``handle`` take their first tokens and run
        on; the response is the one the client's body asks for (streamed or whole)."""
        entry = self.reserved.pop(str(raw.get("handle")), None)
        if entry is None:
            raise APIError(404, "handle: no reservation of that handle (expired or continued)", "handle")
        path, body, flat, since = entry
        if time.monotonic() - since > self.kv_timeout:
            self._cancel(flat)
            raise APIError(408, f"handle: the reservation expired (kv_timeout {self.kv_timeout:g} s)", "handle")
        firsts = raw.get("first_tokens")
        if not isinstance(firsts, list) or len(firsts) != len(flat):
            self._cancel(flat)
            raise APIError(400, f"first_tokens: {len(flat)} expected", "first_tokens")
        try:
            each = zip(firsts, flat, strict=True)
            handed = [PrefillResult.from_json(f, self.vocab_size, len(r.prompt_token_ids)) for f, r in each]
            for r, h in zip(flat, handed, strict=True):
                if r.sampling_params.prompt_logprobs is not None and h.prompt_logprobs is None:
                    raise ValueError("the prompt's logprobs are asked for and missing")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            self._cancel(flat)
            raise APIError(400, f"first_tokens: malformed ({e})", "first_tokens") from None
        try:
            queued = [(r, self.engine.add_committed(r, h)) for r, h in zip(flat, handed, strict=True)]
        except EngineDeadError as e:
            raise APIError(503, str(e), None, "service_unavailable") from None
        chat = path == "chat"
        top_n = (body.top_logprobs if chat else body.logprobs) or 0
        rid = flat[0].request_id.rsplit("-", 2)[0]  # the handle: the API call's id
        return await self.respond(http, queued, body, self._formatter(rid, queued, body, chat, top_n))

    async def kv_cancel(self, raw: dict) -> JSONResponse:
        """A decode instance: give a reservation's blocks back (its prefill failed)."""
        entry = self.reserved.pop(str(raw.get("handle")), None)
        if entry is not None:
            self._cancel(entry[2])
        return JSONResponse({"cancelled": entry is not None})

    def _cancel(self, reqs: list[EngineRequest]) -> None:
        for r in reqs:
            self.engine.abort(r.request_id)
