"""The server as a process: bounded shutdown on SIGTERM, a second signal, and a non-zero exit when
the engine thread dies. Every process is killed at the end, whatever happens."""

import signal
import time

import httpx
import pytest
from live_server import ServerProcess

FLAGS = ["--block-size", "16", "--max-model-len", "512", "--num-gpu-blocks-override", "64", "--log-level", "warning"]
# a scheduler that breaks on its 5th call: outside the per-request isolation, so the engine thread dies
DYING = (
    "import sys\n"
    "from fastdeploy.scheduler.scheduler import Scheduler\n"
    "inner, calls = Scheduler.schedule, []\n"
    "def schedule(self):\n"
    "    calls.append(1)\n"
    "    if len(calls) > 4:\n"
    "        raise RuntimeError('scheduler bug')\n"
    "    return inner(self)\n"
    "Scheduler.schedule = schedule\n"
    "from fastdeploy.entrypoints.openai.api_server import main\n"
    "main(sys.argv[1:])\n"
)


@pytest.fixture
def servers():
    made = []
    yield lambda *a, **k: made.append(ServerProcess(*FLAGS, *a, **k)) or made[-1]
    for s in made:
        s.close()


def test_sigterm_drains_then_aborts_with_an_error_and_exits_zero(servers):
    s = servers("--shutdown-timeout", "2")
    short = s.stream_in_background(1, max_tokens=20)
    long = s.stream_in_background(2, max_tokens=450)
    t0 = time.time()
    s.p.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = httpx.post(s.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(s.base + "/health").status_code == 503
    assert s.p.wait(timeout=30) == 0
    took = time.time() - t0
    assert took < 2 + 10, took  # the drain limit, then a quick exit
    for t in s.threads:
        t.join(timeout=10)
    assert short[0]["done"] and short[0]["events"][-1]["choices"][0]["finish_reason"] == "length"
    for r in long:  # cut at the limit with a clean error event, then [DONE]
        assert r["done"] and "error" in r["events"][-1], r
        assert "shut down" in r["events"][-1]["error"]["message"]


def test_second_signal_ends_the_streams_and_exits_as_a_shell_reports_it(servers):
    """A second signal: every open stream gets an error event then [DONE], and the process exits
    with 128 + the signal (130 for SIGINT) within seconds (issue 25, item 6)."""
    s = servers("--shutdown-timeout", "60")
    long = s.stream_in_background(2, max_tokens=450)
    time.sleep(0.5)
    s.p.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert s.p.poll() is None  # draining: up to 60 s
    t0 = time.time()
    s.p.send_signal(signal.SIGINT)
    assert s.p.wait(timeout=10) == 128 + signal.SIGINT and time.time() - t0 < 10
    assert "Traceback" not in s.stderr()
    for t in s.threads:
        t.join(timeout=10)
    for r in long:
        assert r["done"] and "error" in r["events"][-1], r


def test_dead_engine_exits_non_zero(servers):
    """The engine thread dies: the request gets a 503, the listener stays up answering 503 for a
    few seconds (clients are told, not refused; issue 25, item 2), then the process exits 1."""
    s = servers(code=DYING)
    r = httpx.post(s.base + "/v1/completions", json={"prompt": "go", "max_tokens": 50, "ignore_eos": True}, timeout=30)
    assert r.status_code == 503
    time.sleep(1.0)
    assert httpx.get(s.base + "/health", timeout=5).status_code == 503
    late = httpx.post(s.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
    assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
    assert s.p.wait(timeout=30) == 1
