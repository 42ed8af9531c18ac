"""An OpenAI server in front of a prefill instance and a decode instance (docs/design.md §4.20).

    python -m fastdeploy.entrypoints.disagg_proxy --prefill URL --decode URL [--port 8000] [--timeout 60]

For each /v1/completions or /v1/chat/completions body: the decode instance reserves each
sequence's blocks (``/v1/kv/reserve``: its prefix hits kept, SWA layers only the last window's),
the prefill instance computes the prompts and pushes exactly those blocks (the same body with
``max_tokens`` 1 and the targets in ``kv_transfer_params``), then the decode instance continues
from the first tokens (``/v1/kv/continue``) and its response, streamed or whole, is the client's.
A failure before the continue gives the reservation back (``/v1/kv/cancel``) and the client an
OpenAI-shaped error with the instance's status (502 when it could not be reached or timed out).
"""

from __future__ import annotations

import argparse
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from fastdeploy.entrypoints.openai.protocol import error_body

logger = logging.getLogger("fastdeploy")


def prefill_body(path: str, body: dict, targets: list) -> dict:
    """The client's body as the prefill instance gets it: the first token only, whole, with the
    KV targets; min_tokens kept where it matters to the first token (1 forbids an end token)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    out["max_tokens"] = 1
    if out.get("min_tokens"):
        out["min_tokens"] = 1
    out["kv_transfer_params"] = {"targets": targets}
    return out


def build_proxy(prefill: str, decode: str, timeout: float = 60.0) -> FastAPI:
    app = FastAPI(title="fastdeploy disaggregation proxy")
    client = httpx.AsyncClient(timeout=timeout)

    def failed(where: str, e: Exception | httpx.Response) -> JSONResponse:
        if isinstance(e, httpx.Response):
            try:
                return JSONResponse(e.json(), status_code=e.status_code)
            except ValueError:
                return JSONResponse(error_body(f"the {where} instance answered {e.status_code}"), e.status_code)
        return JSONResponse(
            error_body(f"the {where} instance is unreachable or timed out ({type(e).__name__})", kind="bad_gateway"),
            status_code=502,
        )

    async def generate(path: str, http: Request):
        try:
            body = await http.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return JSONResponse(error_body("body: a JSON object expected", "body"), status_code=400)
        try:
            r = await client.post(f"{decode}/v1/kv/reserve", json={"path": path, "body": body})
        except httpx.HTTPError as e:
            return failed("decode", e)
        if r.status_code != 200:
            return failed("decode", r)
        handle, targets = r.json()["handle"], r.json()["targets"]
        try:
            p = await client.post(
                f"{prefill}/v1/{'chat/completions' if path == 'chat' else 'completions'}",
                json=prefill_body(path, body, targets),
            )
            if p.status_code != 200:
                raise _Answered(p)
            firsts = p.json()["first_tokens"]
        except (httpx.HTTPError, _Answered) as e:
            try:
                await client.post(f"{decode}/v1/kv/cancel", json={"handle": handle})
            except httpx.HTTPError:
                logger.warning("could not cancel reservation %s (the decode instance frees it on its timeout)", handle)
            return failed("prefill", e.response if isinstance(e, _Answered) else e)
        req = client.build_request("POST", f"{decode}/v1/kv/continue", json={"handle": handle, "first_tokens": firsts})
        try:
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            return failed("decode", e)
        return StreamingResponse(
            resp.aiter_raw(),
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type"),
            background=BackgroundTask(resp.aclose),
        )

    @app.post("/v1/completions")
    async def completions(http: Request):
        return await generate("completions", http)

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        return await generate("chat", http)

    @app.get("/v1/models")
    async def models():
        try:
            r = await client.get(f"{decode}/v1/models")
        except httpx.HTTPError as e:
            return failed("decode", e)
        return JSONResponse(r.json(), status_code=r.status_code)

    @app.get("/health")
    async def health():
        for where, url in (("prefill", prefill), ("decode", decode)):
            try:
                ok = (await client.get(f"{url}/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                return JSONResponse(error_body(f"the {where} instance is not healthy", kind="service_unavailable"), 503)
        return JSONResponse({})

    return app


class _Answered(Exception):
    """An instance answered with an error status."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(
        prog="python -m fastdeploy.entrypoints.disagg_proxy", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--prefill", required=True, help="the prefill instance's URL (--kv-transfer-config kv_producer)")
    ap.add_argument("--decode", required=True, help="the decode instance's URL (--kv-transfer-config kv_consumer)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds each call to an instance may take")
    ns = ap.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_proxy(ns.prefill.rstrip("/"), ns.decode.rstrip("/"), ns.timeout)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")


if __name__ == "__main__":
    main()
