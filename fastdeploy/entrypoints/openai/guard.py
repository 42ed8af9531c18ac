"""A pure ASGI middleware in front of the app: the API key, the request-body limit and the
concurrency limit.

Pure ASGI (not Starlette's BaseHTTPMiddleware, which hides ``http.disconnect`` from handlers),
so a client that goes away is still seen by the request it left. /health and /metrics stay open;
/v1/*, /docs, /redoc and /openapi.json need the key when one is set. A body over ``max_bytes`` gets
413 at once when Content-Length says so, else as soon as that many bytes have arrived. A body that
is not UTF-8 (a byte order mark, or the NUL bytes of UTF-16 / UTF-32 in its first four bytes,
which json.loads would otherwise decode) gets a 400 naming ``body``. With ``limit_concurrency``
(uvicorn's name), a request beyond that many in flight gets a 503 at once (/health and /metrics
are not counted and always answered, so a supervisor never mistakes load for death).
"""

from __future__ import annotations

import json

from fastdeploy.entrypoints.openai.protocol import error_body

KEYED = ("/v1", "/docs", "/redoc", "/openapi.json")


class BodyTooLarge(BaseException):  # BaseException: FastAPI's body parser catches Exception
    pass


class BodyNotUtf8(BaseException):
    pass


BOMS = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")


def not_utf8(head: bytes) -> bool:
    """Whether a body's first bytes mark it as other than plain UTF-8."""
    return head.startswith(BOMS) or b"\x00" in head[:4]


OPEN = ("/health", "/metrics")


class Guard:
    def __init__(self, app, api_key: str | None, max_bytes: int, limit_concurrency: int | None = None) -> None:
        self.app, self.api_key, self.max_bytes = app, api_key, max_bytes
        self.limit, self.in_flight = limit_concurrency, 0

    async def _reply(self, send, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] in OPEN:
            return await self.app(scope, receive, send)
        if self.limit is not None and self.in_flight >= self.limit:
            msg = error_body(
                f"server busy: {self.limit} requests in flight (--limit-concurrency)", kind="service_unavailable"
            )
            return await self._reply(send, 503, msg)
        self.in_flight += 1
        try:
            await self._guarded(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _guarded(self, scope, receive, send) -> None:
        headers = dict(scope.get("headers") or [])
        if self.api_key and scope["path"].startswith(KEYED):
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                msg = error_body("invalid or missing API key", kind="authentication_error")
                return await self._reply(send, 401, msg)
        too_large = error_body(f"body: over the {self.max_bytes}-byte limit (--max-request-bytes)", "body")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reply(send, 413, too_large)
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                body = msg.get("body", b"")
                if seen == 0 and body and not_utf8(body):
                    raise BodyNotUtf8
                seen += len(body)
                if seen > self.max_bytes:
                    raise BodyTooLarge
            return msg

        async def tracked_send(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await self._reply(send, 413, too_large)
        except BodyNotUtf8:
            if not started:
                await self._reply(send, 400, error_body("body: must be UTF-8 JSON (no byte order mark)", "body"))
