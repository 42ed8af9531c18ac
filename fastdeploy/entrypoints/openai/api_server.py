"""OpenAI-compatible HTTP server.

    python -m fastdeploy.entrypoints.openai.api_server --model DIR|tiny-mla-swa [--port 8000] ...

/v1/completions and /v1/chat/completions (streamed as server-sent events ending in
``data: [DONE]``), /v1/models, /health, /metrics (Prometheus text). The engine steps in its own
thread; a client that disconnects has its request aborted and its KV blocks freed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from fastdeploy.engine.args import EngineArgs, add_dataclass_args, setting
from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.metrics import EngineMetrics
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, error_body
from fastdeploy.request import RequestOutput
from fastdeploy.sampling_params import SamplingParams

logger = logging.getLogger("fastdeploy")


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
    def __init__(self, engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None) -> None:
        self.engine = engine
        self.name = served_model_name
        self.api_key = api_key
        self.metrics = EngineMetrics()
        engine.engine.step_listeners.append(self.metrics.on_token)
        engine.engine.abort_listeners.append(self.metrics.on_abort)
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.config.scheduler_config.max_model_len
        self.created = int(time.time())

    # ------------------------------------------------------------ requests -> engine

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")

    def _params(self, body, max_tokens: int | None, logprobs: int | None, n_prompt: int) -> SamplingParams:
        if body.n != 1:
            raise APIError(400, f"n: only n=1 is supported, got {body.n}", "n")
        for f in ("presence_penalty", "frequency_penalty"):
            if getattr(body, f):
                raise APIError(400, f"{f}: not supported by this server; leave it at 0", f)
        room = self.max_model_len - n_prompt
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room and max_tokens >= 1:
            msg = (
                f"max_tokens: this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {n_prompt} and max_tokens asks for {max_tokens} more"
            )
            raise APIError(400, msg, "max_tokens")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                logprobs=logprobs,
                stop_token_ids=body.stop_token_ids or [],
                stop=body.stop or [],
                ignore_eos=body.ignore_eos,
            )
        except ValueError as e:
            raise APIError(400, str(e), _param_of(str(e))) from None

    def _tokens(self, prompt, param: str, special: bool = True) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"{param}: batched prompts are not supported; send one prompt per request", param)
            prompt = prompt[0]
        ids = self.tokenizer.encode(prompt, add_special_tokens=special) if isinstance(prompt, str) else list(prompt)
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

    def _start(self, ids: list[int], params: SamplingParams, rid: str, param: str):
        try:
            return self.engine.add(ids, params, rid)
        except ValueError as e:
            raise APIError(400, str(e), param) from None

    async def _deltas(self, rid: str, q, params: SamplingParams) -> AsyncIterator[Delta]:
        """Text and token increments; holds back text that may still turn into a stop string."""
        hold = max((len(s) for s in params.stop), default=1) - 1
        sent_text, sent_tok = 0, 0
        async for out in self.engine.stream(rid, q):
            c = out.outputs[0]
            end = len(c.text) if out.finished else max(sent_text, len(c.text) - hold)
            lp = c.logprobs[sent_tok:] if c.logprobs is not None else []
            yield Delta(
                c.text[sent_text:end], c.token_ids[sent_tok:], lp, c.finish_reason if out.finished else None, out
            )
            sent_text, sent_tok = end, len(c.token_ids)

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
    def _usage(out: RequestOutput) -> dict:
        p, c = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
        }

    async def respond(self, http: Request, rid: str, q, params: SamplingParams, body, chat: bool, top_n: int):
        obj = "chat.completion" if chat else "text_completion"
        base = {"id": rid, "created": int(time.time()), "model": self.name}

        def choice(d: Delta, stream: bool, text_offset: int = 0, first: bool = True) -> dict:
            ch: dict = {"index": 0, "finish_reason": d.finish_reason}
            if chat:
                msg = {"content": d.text}
                if first:
                    msg["role"] = "assistant"
                ch["delta" if stream else "message"] = msg
                ch["logprobs"] = self._chat_logprobs(d, top_n) if params.logprobs is not None else None
            else:
                ch["text"] = d.text
                ch["logprobs"] = self._completion_logprobs(d, text_offset) if params.logprobs is not None else None
            return ch

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def sse():
                offset, last, first = 0, None, True
                async for d in self._deltas(rid, q, params):
                    if d.text or d.finish_reason or (d.token_ids and params.logprobs is not None):
                        chunk = {**base, "object": obj + ".chunk", "choices": [choice(d, True, offset, first)]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                        first = False
                    offset += len(d.text)
                    last = d.out
                if include_usage and last is not None:
                    usage = {**base, "object": obj + ".chunk", "choices": [], "usage": self._usage(last)}
                    yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

        full = None
        async for d in self._deltas(rid, q, params):
            if full is None:
                full = d
            else:
                full = Delta(
                    full.text + d.text, full.token_ids + d.token_ids, full.logprobs + d.logprobs, d.finish_reason, d.out
                )
            if await http.is_disconnected():
                self.engine.abort(rid)
                return JSONResponse(error_body("client disconnected"), status_code=499)
        return JSONResponse({**base, "object": obj, "choices": [choice(full, False)], "usage": self._usage(full.out)})

    # ------------------------------------------------------------ endpoints

    async def completions(self, http: Request, body: CompletionRequest):
        self._check_model(body.model)
        if body.echo:
            raise APIError(400, "echo: not supported by this server", "echo")
        ids = self._tokens(body.prompt, "prompt")
        params = self._params(body, body.max_tokens, body.logprobs, len(ids))
        rid = f"cmpl-{uuid.uuid4().hex}"
        q = self._start(ids, params, rid, "prompt")
        return await self.respond(http, rid, q, params, body, chat=False, top_n=body.logprobs or 0)

    async def chat(self, http: Request, body: ChatCompletionRequest):
        self._check_model(body.model)
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content or ""
            if isinstance(content, list):
                parts = []
                for p in content:
                    if p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
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
        params = self._params(body, max_tokens, top_n if body.logprobs else None, len(ids))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        q = self._start(ids, params, rid, "messages")
        return await self.respond(http, rid, q, params, body, chat=True, top_n=top_n)


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    srv = OpenAIServer(engine, served_model_name, api_key)
    app = FastAPI(title="fastdeploy-swa")
    app.state.server = srv

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(error_body(e.message, e.param, e.kind), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError):
        err = e.errors()[0]
        if err.get("type") == "json_invalid":
            return JSONResponse(error_body(f"invalid JSON body: {err.get('msg')}"), status_code=400)
        loc = [str(x) for x in err.get("loc", []) if x != "body"]
        field = ".".join(loc) or "body"
        kind = err.get("type", "")
        msg = "missing required field" if kind == "missing" else err.get("msg", "invalid value")
        if kind == "extra_forbidden":
            msg = "unknown field (not supported by this server)"
        return JSONResponse(error_body(f"{field}: {msg}", loc[0] if loc else None), status_code=400)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if srv.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {srv.api_key}":
                return JSONResponse(
                    error_body("invalid or missing API key", kind="authentication_error"), status_code=401
                )
        return await call_next(request)

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
        return JSONResponse({}, status_code=200 if engine.healthy else 503)

    @app.get("/metrics")
    async def metrics():
        text = srv.metrics.render(engine.engine)  # plain reads of counters; a step may be mid-way
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


@dataclass
class ServerArgs:
    """The HTTP server's own settings; the engine's are EngineArgs."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    served_model_name: str | None = setting(None, "model name in the API; None: the --model value")
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY'; None: FD_API_KEY if set, else open")
    log_level: str = setting("info", "logging level", ("debug", "info", "warning", "error", "critical"))


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


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = make_parser()
    ns = ap.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = LLMEngine(EngineArgs.from_cli_args(ns))
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    name = ns.served_model_name or ns.model
    app = build_app(AsyncLLMEngine(engine), name, ns.api_key or os.environ.get("FD_API_KEY"))
    logger.info("serving %s on http://%s:%d", name, ns.host, ns.port)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower())


if __name__ == "__main__":
    main()
