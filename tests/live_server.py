"""A live server on a free loopback port, in a thread of the test process, and its /metrics."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.entrypoints.openai import api_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """``build_app(engine, **kw)`` served by uvicorn until ``close``; ``base`` is its URL."""

    def __init__(self, engine: AsyncLLMEngine, **kw) -> None:
        self.engine = engine
        port = free_port()
        self.app = app = api_server.build_app(engine, "tiny-mla-swa", **kw)
        self.srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.srv.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.srv.started and time.time() < deadline:
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.srv.should_exit = True
        self.thread.join(timeout=10)
        self.engine.shutdown()


def metric(base: str, name: str) -> float:
    """The first sample of ``fastdeploy:NAME`` (the unlabeled one where there are labels), or
    the one whose labels are given in NAME."""
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(f"fastdeploy:{name} ") or line.startswith(f"fastdeploy:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_idle(base: str, timeout: float = 30) -> None:
    """Until no request runs and no KV block is held."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metric(base, "num_requests_running") == 0 and metric(base, "kv_cache_blocks_used") == 0:
            return
        time.sleep(0.05)
    raise AssertionError("requests still hold KV blocks")
