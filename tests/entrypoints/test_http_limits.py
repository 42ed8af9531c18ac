"""Connection-level limits (issue 25 item 8): request headers that trickle in are cut off after
--header-timeout, --limit-concurrency answers the request past the limit with an OpenAI-shaped
503 while /health stays 200, and a client that disconnects from a non-streaming request is
logged once at INFO, with no ERROR traceback."""

import logging
import socket
import threading
import time

import httpx
import pytest
from live_server import LiveServer, wait_idle

from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.engine.engine import LLMEngine

ENGINE = dict(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=200, max_model_len=256)
HEADER_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server():
    eng = AsyncLLMEngine(LLMEngine(EngineArgs(**ENGINE)))
    s = LiveServer(eng, header_timeout=HEADER_TIMEOUT, limit_concurrency=2)
    yield s
    s.close()


def closed_after(sock: socket.socket, trickle: bytes | None, limit: float) -> float | None:
    """Seconds until the server closes ``sock`` while we send ``trickle`` a byte every 0.1 s
    (None: nothing), or None if it is still open after ``limit``."""
    t0 = time.monotonic()
    sock.settimeout(0.1)
    i = 0
    while time.monotonic() - t0 < limit:
        if trickle and i < len(trickle):
            try:
                sock.sendall(trickle[i : i + 1])
            except OSError:
                return time.monotonic() - t0
            i += 1
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            pass
        except OSError:
            return time.monotonic() - t0
    return None


def test_trickled_and_silent_headers_are_cut_off(server):
    host, port = server.base.removeprefix("http://").split(":")
    slow = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 200
    for trickle in (slow, None):  # a byte every 0.1 s; a connection that sends nothing
        with socket.create_connection((host, int(port))) as sock:
            t = closed_after(sock, trickle, 4 * HEADER_TIMEOUT)
        assert t is not None and HEADER_TIMEOUT * 0.8 <= t <= HEADER_TIMEOUT + 1.0, t
    # a kept-alive connection idle longer than the header timeout (uvicorn's keep-alive is 5 s)
    # and a request whose headers come at once are not affected
    with httpx.Client(base_url=server.base, timeout=30) as c:
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        time.sleep(HEADER_TIMEOUT * 1.5)
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_limit_concurrency_answers_503_and_keeps_health(server):
    started = threading.Barrier(3)
    results = []

    def stream():
        body = {"prompt": "hi", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as r:
            started.wait()
            lines = [x for x in r.iter_lines() if x]
        results.append((r.status_code, lines[-1]))

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()  # both streams are open: 2 requests in flight
    busy = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
    assert busy.status_code == 503
    err = busy.json()["error"]
    assert err["type"] == "service_unavailable" and "--limit-concurrency" in err["message"]
    assert httpx.get(server.base + "/health").status_code == 200
    assert httpx.get(server.base + "/metrics").status_code == 200
    for t in threads:
        t.join(60)
    assert results == [(200, "data: [DONE]")] * 2
    assert httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    wait_idle(server.base)


def test_a_non_streaming_disconnect_is_logged_once_without_error(server, caplog):
    host, port = server.base.removeprefix("http://").split(":")
    body = b'{"prompt": "hi", "max_tokens": 200, "ignore_eos": true}'
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    with caplog.at_level(logging.INFO, logger="fastdeploy"):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head.encode() + body)
            time.sleep(0.5)  # generating
        wait_idle(server.base)
        time.sleep(0.3)
        import gc

        gc.collect()  # an unretrieved future's ERROR is logged when it is collected
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("client disconnected" in m for m in msgs) == 1, msgs
    assert sum(m.startswith("aborted request") for m in msgs) == 1, msgs
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], msgs
