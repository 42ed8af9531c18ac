"""A live server on a free loopback port, in a thread of the test process, and its /metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import uvicorn

from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.entrypoints.openai import api_server
from fastdeploy.entrypoints.openai.http_protocol import header_timeout_protocol


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """``build_app(engine, **kw)`` served by uvicorn until ``close``; ``base`` is its URL."""

    def __init__(self, engine: AsyncLLMEngine, header_timeout: float = 10.0, **kw) -> None:
        self.engine = engine
        port = free_port()
        self.app = app = api_server.build_app(engine, "tiny-mla-swa", **kw)
        http = header_timeout_protocol(header_timeout)
        self.srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=http))
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
    """The sample of ``fastdeploy:NAME`` whose labels NAME gives, or without labels in NAME the
    sum of the family's samples (a labelled family has no unlabeled sum)."""
    found = []
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(f"fastdeploy:{name} ") or ("{" not in name and line.startswith(f"fastdeploy:{name}{{")):
            found.append(float(line.rsplit(" ", 1)[1]))
    if not found:
        raise KeyError(name)
    return sum(found)


def wait_idle(base: str, timeout: float = 30) -> None:
    """Until no request runs and no KV block is held."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metric(base, "num_requests_running") == 0 and metric(base, "kv_cache_blocks_used") == 0:
            return
        time.sleep(0.05)
    raise AssertionError("requests still hold KV blocks")


class ServerProcess:
    """``python -m fastdeploy.entrypoints.openai.api_server ARGS`` (or ``python -c CODE ARGS``)
    in a process group of its own, so ``close`` reaches the workers it starts too."""

    def __init__(self, *args: str, code: str | None = None) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        head = ["-c", code] if code else ["-m", "fastdeploy.entrypoints.openai.api_server"]
        self.log = tempfile.TemporaryFile("w+")
        cmd = [sys.executable, *head, "--port", str(port), *args]
        self.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True, start_new_session=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(self.base + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
            assert self.p.poll() is None, self.stderr()
        raise AssertionError("server did not start")

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def group_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-g", str(self.p.pid)], capture_output=True, text=True).stdout.split()
        return [int(x) for x in out]

    def stream_in_background(self, n: int, max_tokens: int) -> list[dict]:
        """n streaming completions in threads (``self.threads``); each records its events, whether
        ``data: [DONE]`` came, or the transport error. Returns once every stream has an event."""
        results = [{"events": [], "done": False} for _ in range(n)]

        def run(res):
            body = {"prompt": "go", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", self.base + "/v1/completions", json=body, timeout=120) as r:
                    res["status"] = r.status_code
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            res["done"] = True
                        elif line.startswith("data: "):
                            res["events"].append(json.loads(line[6:]))
            except httpx.HTTPError as e:
                res["transport_error"] = repr(e)

        self.threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in results]
        for t in self.threads:
            t.start()
        deadline = time.time() + 30
        while sum(len(r["events"]) > 0 for r in results) < n and time.time() < deadline:
            time.sleep(0.05)
        return results

    def close(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait(timeout=30)
        self.log.close()
