"""Decode latency while long prompts arrive: one server against a prefill and a decode instance
behind the proxy (docs/design.md §4.20). A bounded load test on 127.0.0.1.

    python benchmarks/bench_disagg_itl.py [--json OUT] [--prompt 8000] [--prompts 3] [--decode-tokens 150]

Each server process is pinned to its own core (``taskset``; this machine has 2): the single
server to core 1; the decode instance to core 1, the prefill instance to core 0; the proxy, a
thin HTTP relay on the stream's path, shares the decode instance's core. A streaming decode of
``--decode-tokens`` tokens runs while ``--prompts`` prompts of ``--prompt`` tokens arrive one after
another (max_tokens 1); the inter-token gaps of the stream (SSE arrival times) give p50 / p99 /
max, against the same stream with no long prompts. The control (``disagg_prefill_alone``): the
same prompts sent straight to the prefill instance, so its core computes them while nothing
reaches the decode side. The tiny SWA checkpoint, with max_position_embeddings raised to fit the
prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], core: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = subprocess.Popen(
        ["taskset", "-c", str(core), sys.executable, *cmd, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return p, base
        except httpx.HTTPError:
            pass
        assert p.poll() is None, cmd
        time.sleep(0.3)
    raise RuntimeError(f"{cmd} did not start")


def gaps(base: str, prompt: list[int], n: int, during=None) -> list[float]:
    """Inter-token gaps (s) of one streamed completion; ``during`` runs in a thread once the
    first token has arrived."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    times, started = [], None
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if during is not None and started is None:
                    started = threading.Thread(target=during, daemon=True)
                    started.start()
    if started is not None:
        started.join()
    return list(np.diff(times))


def summary(g: list[float]) -> dict:
    a = np.array(g) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "max_ms": float(a.max())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--prompt", type=int, default=8000)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=150)
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_kv_transfer import tiny_4k_model

    tmp = tempfile.mkdtemp()
    procs = []
    try:
        model = tiny_4k_model(os.path.join(tmp, "m"))
        common = ["-m", "fastdeploy.entrypoints.openai.api_server", "--model", model, "--block-size", "16"]
        common += ["--max-model-len", str(a.prompt + 64), "--num-gpu-blocks-override", str(a.prompt // 16 + 64)]
        common += ["--max-num-batched-tokens", "2048", "--log-level", "warning"]
        kv = '{"kv_connector": "MooncakeConnector", "kv_role": "%s", "kv_timeout": 600}'
        rng = np.random.default_rng(0)
        short = [int(x) for x in rng.integers(2, 500, 20)]
        longs = [[int(x) for x in rng.integers(2, 500, a.prompt)] for _ in range(a.prompts)]
        res = {}

        def load(base: str):
            def run():
                for p in longs:
                    httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 1}, timeout=600)

            return run

        p, single = start(common, 1)
        procs.append(p)
        res["single_idle"] = summary(gaps(single, short, a.decode_tokens))
        res["single_loaded"] = summary(gaps(single, short, a.decode_tokens, load(single)))
        os.killpg(p.pid, 9)
        p, pre = start([*common, "--kv-transfer-config", kv % "kv_producer"], 0)
        procs.append(p)
        p, dec = start([*common, "--kv-transfer-config", kv % "kv_consumer"], 1)
        procs.append(p)
        p, proxy = start(["-m", "fastdeploy.entrypoints.disagg_proxy", "--prefill", pre, "--decode", dec], 1)
        procs.append(p)
        res["disagg_idle"] = summary(gaps(proxy, short, a.decode_tokens))
        res["disagg_loaded"] = summary(gaps(proxy, short, a.decode_tokens, load(proxy)))
        # the control: the same prompts straight to the prefill instance (no KV, no relay to the
        # decode side): what the prefill's compute on the other core alone does to the stream
        res["disagg_prefill_alone"] = summary(gaps(proxy, short, a.decode_tokens, load(pre)))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"decode inter-token gaps, {a.prompts} prompts of {a.prompt} tokens arriving (ms):")
    for k, r in res.items():
        print(f"  {k:20s} p50 {r['p50_ms']:7.1f}  p99 {r['p99_ms']:7.1f}  max {r['max_ms']:7.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "args": vars(a), **res}, f, indent=1)


if __name__ == "__main__":
    main()
