"""OpenAI-compatible HTTP server: the app and the command line.

    python -m fastdeploy.entrypoints.openai.api_server --model DIR|tiny-mla-swa [--port 8000] ...

/v1/completions and /v1/chat/completions (streamed as server-sent events ending in ``data:
[DONE]``; ``n`` samples and batched prompts as choices), /v1/models, /health, /metrics
(Prometheus), and vLLM's /tokenize, /detokenize and /tokenizer_info. A body's engine requests
are made in ``request_mapping.py``, the generation endpoints are ``serving.py``, the tokenizer
ones ``serving_tokenization.py``, response formatting ``response.py``, schemas ``protocol.py``. The engine steps in
its own thread; validation and tokenization run off the event loop; a client that disconnects,
streaming or not, has its requests aborted and blocks freed. A request the engine fails gets its
error and the engine keeps serving; if the engine thread dies, /health says 503, every request
gets a 503, and the process exits non-zero (--exit-on-engine-error). SIGTERM / SIGINT drain
in-flight requests for --shutdown-timeout seconds, abort the rest with an error, and exit 0; a
second signal ends open streams with an error event and exits 128 + the signal.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdeploy.distributed.parallel import LAUNCH_ENV
from fastdeploy.engine.args import EngineArgs, add_dataclass_args, setting
from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.engine.dp_core import run_launched_core
from fastdeploy.engine.dp_engine import create_engine
from fastdeploy.engine.engine import EXIT_GRACE_S
from fastdeploy.entrypoints.openai.guard import Guard
from fastdeploy.entrypoints.openai.http_protocol import header_timeout_protocol
from fastdeploy.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from fastdeploy.entrypoints.openai.reasoning import PARSERS
from fastdeploy.entrypoints.openai.serving import OpenAIServer
from fastdeploy.entrypoints.openai.serving_tokenization import TokenizationServer
from fastdeploy.worker.tp_worker import run_worker

logger = logging.getLogger("fastdeploy")
FLUSH_S = 0.5  # after a second signal: time for the event loop to send the open streams their error
FATAL_ANSWER_S = EXIT_GRACE_S  # after the engine dies: how long the listener stays up answering 503


def build_app(
    engine: AsyncLLMEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_request_bytes: int = 16 * 2**20,
    max_seqs_per_request: int = 256,
    reasoning_parser: str | None = None,
    limit_concurrency: int | None = None,
):
    """The FastAPI app behind the Guard (API key, body limit); returns the ASGI app with
    ``.fastapi`` and ``.server`` attributes."""
    srv = OpenAIServer(engine, served_model_name, max_seqs_per_request, reasoning_parser)
    tok = TokenizationServer(srv.mapping)
    app = FastAPI(title="fastdeploy-swa")

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(error_body(e.message, e.param, e.kind, e.code), status_code=e.status)

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

    @app.post("/v1/kv/reserve")  # prefill / decode disaggregation, a decode instance (docs/design.md §4.20)
    async def kv_reserve(http: Request):
        return await srv.kv_reserve(await _json_object(http))

    @app.post("/v1/kv/continue")
    async def kv_continue(http: Request):
        return await srv.kv_continue(http, await _json_object(http))

    @app.post("/v1/kv/cancel")
    async def kv_cancel(http: Request):
        return await srv.kv_cancel(await _json_object(http))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await run_in_threadpool(tok.tokenize, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await run_in_threadpool(tok.detokenize, body)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tok.tokenizer_info()

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

    guarded = Guard(app, api_key, max_request_bytes, limit_concurrency)
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
    max_seqs_per_request: int = setting(256, "most sequences one request may start (prompts x n); more gets 400")
    limit_concurrency: int | None = setting(None, "most requests in flight (health, metrics excepted); more get 503")
    header_timeout: float = setting(10.0, "seconds a request's headers may take to arrive; then the connection closes")
    shutdown_timeout: float = setting(30.0, "seconds in-flight requests may finish after SIGTERM / SIGINT")
    exit_on_engine_error: bool = setting(True, "exit non-zero when the engine thread dies, for a supervisor")
    reasoning_parser: str | None = setting(
        None, "split <think> ... </think> into the chat message's reasoning_content", PARSERS
    )


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
    uvicorn stops; a second signal ends every open request with an error (streams get an error
    event and ``[DONE]``), gives the event loop ``FLUSH_S`` to write them, and exits with 128 +
    the signal's number (130 for SIGINT, 143 for SIGTERM), as shells report a killed process."""

    def __init__(self, config, engine: AsyncLLMEngine, timeout: float) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            def handle_exit(inner, sig, frame) -> None:  # noqa: N805 - uvicorn's signature
                self.on_signal(sig)

        self.server = _Server(config)
        self.engine, self.timeout = engine, timeout
        self.signals = 0
        self.exit_code = 0  # 128 + the signal after a second one

    def on_signal(self, sig) -> None:
        self.signals += 1
        if self.signals > 1:
            logger.warning("second signal %s: ending open requests and exiting", sig)
            threading.Thread(target=self._exit_now, args=(int(sig),), name="fastdeploy-exit", daemon=True).start()
            return
        logger.info("signal %s: draining for up to %g s", sig, self.timeout)
        threading.Thread(target=self._drain, name="fastdeploy-drain", daemon=True).start()

    def _exit_now(self, signum: int) -> None:
        self.exit_code = 128 + signum  # also if the first drain returns and uvicorn stops first
        self.engine.drain(0.0)
        time.sleep(FLUSH_S)
        logging.shutdown()
        os._exit(128 + signum)

    def _drain(self) -> None:
        aborted = self.engine.drain(self.timeout)
        logger.info("drained; %d requests aborted", aborted)
        self.server.should_exit = True

    def run(self) -> None:
        self.server.run()


async def _json_object(http: Request) -> dict:
    """The body as a JSON object (an APIError 400 otherwise)."""
    try:
        raw = await http.json()
    except ValueError:
        raw = None
    if not isinstance(raw, dict):
        raise APIError(400, "body: a JSON object expected", "body")
    return raw


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = make_parser()
    ns = ap.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0")) if os.environ.get(LAUNCH_ENV) else 0
    if rank:  # a rank under paddle.distributed.launch: no HTTP; a data-parallel core's driver, or a model shard
        fd = EngineArgs.from_cli_args(ns).create_config()
        pc = fd.parallel_config
        if pc.data_parallel_size > 1 and rank % pc.tensor_parallel_size == 0:
            return run_launched_core(fd)
        return run_worker(fd)
    try:
        engine = create_engine(EngineArgs.from_cli_args(ns))
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    name = ns.served_model_name or ns.model
    holder: dict = {}

    def on_fatal() -> None:
        """The engine is gone: keep listening (every request a 503, /health 503) for
        FATAL_ANSWER_S, then stop, so clients are told rather than refused."""

        def stop() -> None:
            holder["server"].server.should_exit = True

        if ns.exit_on_engine_error and "server" in holder:
            threading.Timer(FATAL_ANSWER_S, stop).start()

    async_engine = AsyncLLMEngine(engine, on_fatal=on_fatal)
    key = ns.api_key or os.environ.get("FD_API_KEY")
    limits = (ns.max_request_bytes, ns.max_seqs_per_request, ns.reasoning_parser, ns.limit_concurrency)
    app = build_app(async_engine, name, key, *limits)
    http = header_timeout_protocol(ns.header_timeout)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower(), http=http)
    server = holder["server"] = DrainingServer(config, async_engine, ns.shutdown_timeout)
    logger.info("serving %s on http://%s:%d", name, ns.host, ns.port)
    server.run()
    if server.exit_code:  # a second signal: the streams have their error event; exit as killed
        time.sleep(FLUSH_S)
        logging.shutdown()
        os._exit(server.exit_code)
    async_engine.shutdown()
    if async_engine.error is not None and ns.exit_on_engine_error:
        logger.error("exiting: the engine thread died (%r)", async_engine.error)
        sys.exit(1)


if __name__ == "__main__":
    main()
