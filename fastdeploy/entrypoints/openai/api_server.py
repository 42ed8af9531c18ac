"""OpenAI-compatible HTTP server.

    python -m fastdeploy.entrypoints.openai.api_server --model DIR|tiny-mla-swa [--port 8000] ...

/v1/completions and /v1/chat/completions (streamed as server-sent events ending in
``data: [DONE]``; ``n`` samples and batched prompts as choices), /v1/models, /health, /metrics
(Prometheus). The engine steps in its own thread; validation and tokenization run off the event
loop; a client that disconnects, streaming or not, has its requests aborted and blocks freed.
A request the engine fails gets its error and the engine keeps serving; if the engine thread
dies, /health says 503, every request gets a 503, and the process exits non-zero
(--exit-on-engine-error). SIGTERM / SIGINT drain in-flight requests for --shutdown-timeout
seconds, abort the rest with an error, and exit 0; a second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdeploy.distributed.parallel import LAUNCH_ENV
from fastdeploy.engine.args import EngineArgs, add_dataclass_args, setting
from fastdeploy.engine.async_engine import AsyncLLMEngine, EngineDeadError, ServerDrainingError
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.metrics import EngineMetrics
from fastdeploy.entrypoints.openai.guard import Guard
from fastdeploy.entrypoints.openai.protocol import MAX_STOP, ChatCompletionRequest, CompletionRequest, error_body
from fastdeploy.request import Request as EngineRequest
from fastdeploy.request import RequestOutput
from fastdeploy.sampling_params import SamplingParams
from fastdeploy.worker.tp_worker import run_worker

logger = logging.getLogger("fastdeploy")

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _param_of(msg: str) -> str | None:
    head = msg.split(" ", 1)[0].rstrip(":")
    return head if head.replace("_", "").isalnum() else None


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finish_reason: str | None
    out: RequestOutput


class OpenAIServer:
    def __init__(self, engine: AsyncLLMEngine, served_model_name: str) -> None:
        self.engine = engine
        self.name = served_model_name
        self.metrics = EngineMetrics(engine.engine)
        engine.engine.step_listeners.append(self.metrics.on_token)
        engine.engine.finish_listeners.append(self.metrics.on_finish)
        self.tokenizer = engine.engine.tokenizer
        self.vocab_size = engine.engine.config.model_config.vocab_size
        self.max_model_len = engine.engine.config.scheduler_config.max_model_len
        self.prefix_caching = engine.engine.config.cache_config.enable_prefix_caching
        self.created = int(time.time())

    # ------------------------------------------------------------ requests -> engine (off the event loop)

    def _check_common(self, body) -> None:
        if body.model is not None and body.model != self.name:
            raise APIError(404, f"The model `{body.model}` does not exist.", "model", "NotFoundError")
        for f in ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls"):
            if getattr(body, f) is not None:
                raise APIError(400, f"{f}: tool and function calling are not supported by this server", f)
        if body.response_format is not None and body.response_format.type != "text":
            raise APIError(
                400,
                f"response_format: type {body.response_format.type!r} is not supported (only 'text'; no JSON mode)",
                "response_format",
            )
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stops)}", "stop")
        bad = [t for t in body.stop_token_ids or [] if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(
                400, f"stop_token_ids: {bad[0]} is not a token id in 0..{self.vocab_size - 1}", "stop_token_ids"
            )
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options: only allowed with stream=true", "stream_options")
        bad_text = _bad_unicode(body.model_dump())
        if bad_text:
            raise APIError(400, f"{bad_text}: invalid Unicode (a lone surrogate cannot be encoded)", bad_text)

    def _logit_bias(self, body) -> dict[int, float]:
        out = {}
        for k, v in (body.logit_bias or {}).items():
            if not (k.isdigit() and int(k) < self.vocab_size):
                raise APIError(
                    400, f"logit_bias: key {k!r} is not a token id in 0..{self.vocab_size - 1}", "logit_bias"
                )
            if not -100 <= v <= 100:
                raise APIError(400, f"logit_bias: bias {v} for token {k} is outside [-100, 100]", "logit_bias")
            out[int(k)] = v
        return out

    def _params(self, body, max_tokens: int | None, logprobs: int | None, n_prompt: int, k: int) -> SamplingParams:
        """The k-th of body.n samples: seeds seed + k, so the n samples differ and reproduce."""
        room = self.max_model_len - n_prompt
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            msg = (
                f"max_tokens: this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {n_prompt} and max_tokens asks for {max_tokens} more"
            )
            raise APIError(400, msg, "max_tokens")
        seed = None if body.seed is None else (body.seed + k) % 2**64
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=seed,
                logprobs=logprobs,
                stop_token_ids=body.stop_token_ids or [],
                stop=body.stop or [],
                ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=self._logit_bias(body),
                min_tokens=body.min_tokens,
            )
        except ValueError as e:
            raise APIError(400, str(e), _param_of(str(e))) from None

    def _tokens(self, prompt: str | list[int], param: str, special: bool = True) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=special)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"{param}: {bad[0]} is not a token id in 0..{self.vocab_size - 1}", param)
        if not ids:
            raise APIError(400, f"{param}: must not be empty", param)
        if len(ids) >= self.max_model_len:
            raise APIError(
                400,
                f"{param}: {len(ids)} tokens, but this model's maximum context length is "
                f"{self.max_model_len} (prompt plus at least one generated token)",
                param,
            )
        return ids

    def _requests(self, rid: str, prompts: list[list[int]], body, max_tokens, logprobs) -> list[list[EngineRequest]]:
        """body.n requests per prompt, validated and made (nothing queued yet)."""
        out = []
        for i, ids in enumerate(prompts):
            row = []
            for k in range(body.n):
                params = self._params(body, max_tokens, logprobs, len(ids), k)
                try:
                    req = self.engine.engine.make_request(ids, params, f"{rid}-{i}-{k}")
                except ValueError as e:
                    raise APIError(400, str(e), _param_of(str(e))) from None
                if row and self.prefix_caching:  # share the prompt's blocks through the prefix cache
                    req.prefill_after = row[0]
                row.append(req)
            out.append(row)
        return out

    def _prepare_completion(self, body: CompletionRequest, rid: str) -> list[list[EngineRequest]]:
        self._check_common(body)
        if body.echo:
            raise APIError(400, "echo: not supported by this server", "echo")
        p = body.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            prompts = [p]
        else:
            prompts = list(p)  # a batch: strings or token-id lists
        if not prompts:
            raise APIError(400, "prompt: must not be empty", "prompt")
        ids = [self._tokens(x, "prompt" if len(prompts) == 1 else f"prompt.{i}") for i, x in enumerate(prompts)]
        return self._requests(rid, ids, body, body.max_tokens, body.logprobs)

    def _prepare_chat(self, body: ChatCompletionRequest, rid: str) -> list[list[EngineRequest]]:
        self._check_common(body)
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content or ""
            if isinstance(content, list):
                parts = []
                for p in content:
                    if p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise APIError(
                            400, f"messages.{i}.content: only text parts are supported", f"messages.{i}.content"
                        )
                    parts.append(p["text"])
                content = "".join(parts)
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        try:
            text = self.tokenizer.apply_chat_template(messages, body.add_generation_prompt)
        except ValueError as e:
            raise APIError(400, f"messages: {e}", "messages") from None
        ids = self._tokens(text, "messages", special=False)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        top_n = body.top_logprobs or 0
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return self._requests(rid, [ids], body, max_tokens, top_n if body.logprobs else None)

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

    async def _deltas(self, req: EngineRequest, q: asyncio.Queue) -> AsyncIterator[Delta]:
        """Text and token increments; holds back text that may still turn into a stop string."""
        hold = max((len(s) for s in req.sampling_params.stop), default=1) - 1
        sent_text, sent_tok = 0, 0
        try:
            async for out in self.engine.stream(req.request_id, q):
                if out.error is not None:
                    raise APIError(500, f"the engine failed this request: {out.error}", None, "internal_server_error")
                c = out.outputs[0]
                end = len(c.text) if out.finished else max(sent_text, len(c.text) - hold)
                lp = c.logprobs[sent_tok:] if c.logprobs is not None else []
                reason = c.finish_reason if out.finished else None
                yield Delta(c.text[sent_text:end], c.token_ids[sent_tok:], lp, reason, out)
                sent_text, sent_tok = end, len(c.token_ids)
        except (EngineDeadError, ServerDrainingError) as e:
            raise APIError(503, str(e), None, "service_unavailable") from None
        except ValueError as e:  # the engine refused the request (e.g. its id is in use)
            raise APIError(400, str(e), _param_of(str(e))) from None

    # ------------------------------------------------------------ formatting

    def _token_str(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def _completion_logprobs(self, d: Delta, offset: int) -> dict:
        toks = [self._token_str(t) for t in d.token_ids]
        offsets, o = [], offset
        for s in toks:
            offsets.append(o)
            o += len(s)
        return {
            "tokens": toks,
            "token_logprobs": [lp[t] for t, lp in zip(d.token_ids, d.logprobs, strict=True)],
            "top_logprobs": [{self._token_str(k): v for k, v in lp.items()} for lp in d.logprobs],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, d: Delta, top_n: int) -> dict:
        def entry(t, v):
            s = self._token_str(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        content = []
        for t, lp in zip(d.token_ids, d.logprobs, strict=True):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in top]})
        return {"content": content}

    @staticmethod
    def _usage(finals: list[list[RequestOutput]]) -> dict:
        """Each prompt counted once however many samples it has; every sample's tokens."""
        p = sum(len(row[0].prompt_token_ids) for row in finals)
        c = sum(len(o.outputs[0].token_ids) for row in finals for o in row)
        cached = sum(max(o.num_cached_tokens for o in row) for row in finals)
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def respond(self, http: Request, rid: str, queued, body, chat: bool, top_n: int):
        obj = "chat.completion" if chat else "text_completion"
        base = {"id": rid, "created": int(time.time()), "model": self.name}
        logprobs = queued[0][0].sampling_params.logprobs is not None
        n = body.n
        n_prompts = len(queued) // n

        def choice(index: int, d: Delta, stream: bool, text_offset: int = 0, first: bool = True) -> dict:
            ch: dict = {"index": index, "finish_reason": d.finish_reason}
            if chat:
                msg = {"content": d.text}
                if first:
                    msg["role"] = "assistant"
                ch["delta" if stream else "message"] = msg
                ch["logprobs"] = self._chat_logprobs(d, top_n) if logprobs else None
            else:
                ch["text"] = d.text
                ch["logprobs"] = self._completion_logprobs(d, text_offset) if logprobs else None
            return ch

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            merged: asyncio.Queue = asyncio.Queue()

            async def pump(index: int, req: EngineRequest, q: asyncio.Queue) -> None:
                try:
                    async for d in self._deltas(req, q):
                        await merged.put((index, d))
                except BaseException as e:  # noqa: BLE001 - handed to the SSE writer
                    await merged.put((index, e))
                await merged.put((index, None))

            async def sse():
                tasks = [asyncio.ensure_future(pump(i, r, q)) for i, (r, q) in enumerate(queued)]
                offsets, first, finals, live = (
                    [0] * len(queued),
                    [True] * len(queued),
                    [None] * len(queued),
                    len(queued),
                )
                try:
                    while live:
                        index, d = await merged.get()
                        if d is None:
                            live -= 1
                            continue
                        if isinstance(d, BaseException):
                            err = d if isinstance(d, APIError) else APIError(500, str(d), None, "internal_server_error")
                            yield f"data: {json.dumps(error_body(err.message, err.param, err.kind))}\n\n"
                            break
                        if d.text or d.finish_reason or (d.token_ids and logprobs):
                            chunk = {
                                **base,
                                "object": obj + ".chunk",
                                "choices": [choice(index, d, True, offsets[index], first[index])],
                            }
                            yield f"data: {json.dumps(chunk)}\n\n"
                            first[index] = False
                        offsets[index] += len(d.text)
                        finals[index] = d.out
                    else:
                        if include_usage:
                            rows = [finals[i * n : (i + 1) * n] for i in range(n_prompts)]
                            usage = {**base, "object": obj + ".chunk", "choices": [], "usage": self._usage(rows)}
                            yield f"data: {json.dumps(usage)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    for t in tasks:
                        t.cancel()

            return StreamingResponse(sse(), media_type="text/event-stream")

        async def collect(req: EngineRequest, q: asyncio.Queue) -> Delta:
            full = None
            async for d in self._deltas(req, q):
                if full is None:
                    full = d
                else:
                    full = Delta(
                        full.text + d.text,
                        full.token_ids + d.token_ids,
                        full.logprobs + d.logprobs,
                        d.finish_reason,
                        d.out,
                    )
            return full

        gathered = asyncio.ensure_future(asyncio.gather(*(collect(r, q) for r, q in queued)))
        while not gathered.done():  # a client that goes away aborts its requests within a poll
            await asyncio.wait({gathered}, timeout=DISCONNECT_POLL_S)
            if not gathered.done() and await http.is_disconnected():
                gathered.cancel()
                for r, _ in queued:
                    self.engine.abort(r.request_id)
                return JSONResponse(error_body("client disconnected"), status_code=499)
        try:
            fulls = gathered.result()
        except BaseException:
            for r, _ in queued:  # one sample failed: the others are aborted too
                self.engine.abort(r.request_id)
            raise
        rows = [[d.out for d in fulls[i * n : (i + 1) * n]] for i in range(n_prompts)]
        choices = [choice(i, d, False) for i, d in enumerate(fulls)]
        return JSONResponse({**base, "object": obj, "choices": choices, "usage": self._usage(rows)})

    # ------------------------------------------------------------ endpoints

    async def completions(self, http: Request, body: CompletionRequest):
        rid = f"cmpl-{uuid.uuid4().hex}"
        reqs = await run_in_threadpool(self._prepare_completion, body, rid)
        return await self.respond(http, rid, self._submit(reqs), body, chat=False, top_n=body.logprobs or 0)

    async def chat(self, http: Request, body: ChatCompletionRequest):
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        reqs = await run_in_threadpool(self._prepare_chat, body, rid)
        return await self.respond(http, rid, self._submit(reqs), body, chat=True, top_n=body.top_logprobs or 0)


def _bad_unicode(value, path: str = "") -> str | None:
    """The dotted path of the first string in ``value`` that UTF-8 cannot encode, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for k, v in value.items():
            bad = _bad_unicode(v, f"{path}.{k}" if path else str(k))
            if bad:
                return bad
    elif isinstance(value, list):
        for i, v in enumerate(value):
            bad = _bad_unicode(v, f"{path}.{i}")
            if bad:
                return bad
    return None


def build_app(
    engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None, max_request_bytes: int = 16 * 2**20
):
    """The FastAPI app behind the Guard (API key, body limit); returns the ASGI app with
    ``.fastapi`` and ``.server`` attributes."""
    srv = OpenAIServer(engine, served_model_name)
    app = FastAPI(title="fastdeploy-swa")

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(error_body(e.message, e.param, e.kind), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError):
        err = e.errors()[0]
        kind = err.get("type", "")
        if kind == "json_invalid":
            pos = err.get("loc", ["body", "?"])[-1]
            why = (err.get("ctx") or {}).get("error", "")
            return JSONResponse(error_body(f"body: invalid JSON at character {pos}: {why}", "body"), status_code=400)
        loc = [str(x) for x in err.get("loc", []) if x != "body"]
        # a union's branch names (str, list[int] ...) are not fields
        loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool")]
        field = ".".join(loc) or "body"
        msg = "missing required field" if kind == "missing" else err.get("msg", "invalid value")
        if kind == "extra_forbidden":
            msg = "unknown field (not supported by this server)"
        return JSONResponse(error_body(f"{field}: {msg}", field), status_code=400)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception):  # a bug of ours: still an OpenAI-shaped body
        logger.exception("unhandled error in a request")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", kind="internal_server_error"), 500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        if e.status_code == 400:  # FastAPI could not decode the body (e.g. not UTF-8)
            return JSONResponse(error_body(f"body: {e.detail} (JSON in UTF-8 expected)", "body"), status_code=400)
        return JSONResponse(error_body(str(e.detail)), status_code=e.status_code)

    @app.post("/v1/completions")
    async def completions(http: Request, body: CompletionRequest):
        return await srv.completions(http, body)

    @app.post("/v1/chat/completions")
    async def chat(http: Request, body: ChatCompletionRequest):
        return await srv.chat(http, body)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": srv.name,
            "object": "model",
            "created": srv.created,
            "owned_by": "fastdeploy",
            "max_model_len": srv.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        ok = engine.healthy and not engine.draining
        return JSONResponse(
            {} if ok else error_body("engine unavailable", kind="service_unavailable"), status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics():
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    guarded = Guard(app, api_key, max_request_bytes)
    guarded.fastapi, guarded.server = app, srv
    return guarded


@dataclass
class ServerArgs:
    """The HTTP server's own settings; the engine's are EngineArgs."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    served_model_name: str | None = setting(None, "model name in the API; None: the --model value")
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY'; None: FD_API_KEY if set, else open")
    log_level: str = setting("info", "logging level", ("debug", "info", "warning", "error", "critical"))
    max_request_bytes: int = setting(16 * 2**20, "largest request body accepted; larger gets 413")
    shutdown_timeout: float = setting(30.0, "seconds in-flight requests may finish after SIGTERM / SIGINT")
    exit_on_engine_error: bool = setting(True, "exit non-zero when the engine thread dies, for a supervisor")


def make_parser() -> argparse.ArgumentParser:
    """Flags generated from ServerArgs and EngineArgs, each shown with its default in --help."""
    ap = argparse.ArgumentParser(
        prog="python -m fastdeploy.entrypoints.openai.api_server",
        description="OpenAI-compatible server for DeepSeek-V3 MLA / SWA checkpoints",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_dataclass_args(ap.add_argument_group("server"), ServerArgs)
    add_dataclass_args(ap.add_argument_group("engine"), EngineArgs)
    return ap


class DrainingServer:
    """uvicorn's server with our signal handling: the first SIGTERM / SIGINT drains the engine
    (new requests 503, in-flight ones finish for ``timeout`` s, the rest get an error), then
    uvicorn stops; a second signal exits at once with status 0."""

    def __init__(self, config, engine: AsyncLLMEngine, timeout: float) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            def handle_exit(inner, sig, frame) -> None:  # noqa: N805 - uvicorn's signature
                self.on_signal(sig)

        self.server = _Server(config)
        self.engine, self.timeout = engine, timeout
        self.signals = 0

    def on_signal(self, sig) -> None:
        self.signals += 1
        if self.signals > 1:
            logger.warning("second signal %s: exiting now", sig)
            logging.shutdown()
            os._exit(0)
        logger.info("signal %s: draining for up to %g s", sig, self.timeout)
        threading.Thread(target=self._drain, name="fastdeploy-drain", daemon=True).start()

    def _drain(self) -> None:
        aborted = self.engine.drain(self.timeout)
        logger.info("drained; %d requests aborted", aborted)
        self.server.should_exit = True

    def run(self) -> None:
        self.server.run()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = make_parser()
    ns = ap.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.environ.get(LAUNCH_ENV) and int(os.environ.get("PADDLE_TRAINER_ID", "0")) != 0:
        return run_worker(EngineArgs.from_cli_args(ns))  # a rank under paddle.distributed.launch: no HTTP
    try:
        engine = LLMEngine(EngineArgs.from_cli_args(ns))
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    name = ns.served_model_name or ns.model
    holder: dict = {}

    def on_fatal() -> None:
        if ns.exit_on_engine_error and "server" in holder:
            holder["server"].server.should_exit = True

    async_engine = AsyncLLMEngine(engine, on_fatal=on_fatal)
    app = build_app(async_engine, name, ns.api_key or os.environ.get("FD_API_KEY"), ns.max_request_bytes)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower())
    server = holder["server"] = DrainingServer(config, async_engine, ns.shutdown_timeout)
    logger.info("serving %s on http://%s:%d", name, ns.host, ns.port)
    server.run()
    async_engine.shutdown()
    if async_engine.error is not None and ns.exit_on_engine_error:
        logger.error("exiting: the engine thread died (%r)", async_engine.error)
        sys.exit(1)


if __name__ == "__main__":
    main()
