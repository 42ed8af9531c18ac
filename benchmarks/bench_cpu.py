"""CPU numbers, for the record: the paddle references of the SWA ops, the tiny model's prefill and
decode tokens/s through LLM, and the OpenAI server's throughput and time to first token at 1 and
16 concurrent streaming clients.

    python benchmarks/bench_cpu.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import paddle

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache import write_mla_fp8_cache_ref  # noqa: E402
from fastdeploy.model_executor.ops.triton_ops.sparse_mla import sparse_mla_reference  # noqa: E402
from fastdeploy.model_executor.ops.triton_ops.swa_indexer import swa_indexer_ref  # noqa: E402


def timeit(fn, n=5) -> float:
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def ops() -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    T, W, bs = 1024, 128, 64
    pos = paddle.to_tensor(rng.integers(0, 4096, T).astype(np.int32))
    bid = paddle.zeros([T], "int32")
    bt = paddle.to_tensor(rng.permutation(80).astype(np.int32)[None])
    out.append(
        {"op": "swa_indexer_ref", "case": f"T={T} W={W}", "ms": timeit(lambda: swa_indexer_ref(pos, bid, bt, bs, W, W))}
    )
    kv = paddle.to_tensor(rng.standard_normal((T, 512)), "float32")
    pe = paddle.to_tensor(rng.standard_normal((T, 64)), "float32")
    cache = paddle.zeros([32, bs, 1, 656], "uint8")
    slots = paddle.to_tensor(np.arange(T, dtype=np.int32))
    out.append(
        {
            "op": "write_mla_fp8_cache_ref",
            "case": f"T={T}",
            "ms": timeit(lambda: write_mla_fp8_cache_ref(kv, pe, slots, cache)),
        }
    )
    for H, Tq in ((16, 64), (128, 16)):
        q = paddle.to_tensor(rng.standard_normal((Tq, H, 576)), "float32")
        idx = paddle.to_tensor(rng.integers(0, T, (Tq, W)).astype(np.int32))
        out.append(
            {
                "op": "sparse_mla_reference",
                "case": f"T={Tq} H={H} W={W}",
                "ms": timeit(lambda q=q, idx=idx: sparse_mla_reference(q, cache, idx, 0.135)),
            }
        )
    return out


def model() -> dict:
    llm = LLM(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=400, max_model_len=2048)
    rng = np.random.default_rng(1)
    prompt = {"prompt_token_ids": [int(x) for x in rng.integers(4, 500, 512)]}
    one = SamplingParams(max_tokens=1, temperature=0)
    t = time.perf_counter()
    llm.generate([prompt], one)
    prefill_s = time.perf_counter() - t
    sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], sp)
    decode_s = time.perf_counter() - t
    batch = [{"prompt_token_ids": [int(x) for x in rng.integers(4, 500, 32)]} for _ in range(16)]
    t = time.perf_counter()
    llm.generate(batch, sp)
    batch_s = time.perf_counter() - t
    return {
        "prefill_tokens_per_s": 512 / prefill_s,
        "decode_tokens_per_s_1_seq": 128 / decode_s,
        "decode_tokens_per_s_16_seqs": 16 * 128 / batch_s,
    }


def server() -> dict:
    """The server in its own process (as users run it), clients in this one."""
    import subprocess

    import httpx
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "fastdeploy.entrypoints.openai.api_server",
        "--port",
        str(port),
        "--block-size",
        "16",
        "--num-gpu-blocks-override",
        "400",
        "--max-model-len",
        "2048",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)

    def one(i):
        t0 = time.perf_counter()
        ttft, n = None, 0
        for c in client.completions.create(
            model="tiny-mla-swa",
            prompt=f"Request {i}: " + "hello world " * 40,
            max_tokens=64,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            if c.choices and c.choices[0].text and ttft is None:
                ttft = time.perf_counter() - t0
            n += 1
        return ttft, time.perf_counter() - t0

    res = {}
    for conc in (1, 32):
        t = time.perf_counter()
        with ThreadPoolExecutor(conc) as ex:
            runs = list(ex.map(one, range(conc)))
        wall = time.perf_counter() - t
        res[f"clients_{conc}"] = {
            "output_tokens_per_s": conc * 64 / wall,
            "ttft_median_s": statistics.median(r[0] for r in runs),
        }
    # SIGTERM with 32 streams in flight: the time until the process has exited
    with ThreadPoolExecutor(32) as ex:
        futures = [ex.submit(one, i) for i in range(32)]
        time.sleep(1.0)
        t = time.perf_counter()
        proc.terminate()
        proc.wait()
        res["sigterm_to_exit_s_with_32_in_flight"] = time.perf_counter() - t
        for f in futures:
            f.exception()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench_cpu.json")
    ap.add_argument("--server-only", action="store_true", help="only the server at 1 and 32 clients")
    args = ap.parse_args()
    if args.server_only:
        res = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "server": server()}
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print_server(res["server"])
        return
    res = {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "ops": ops(),
        "model": model(),
        "server": server(),
    }
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    for o in res["ops"]:
        print(f"{o['op']:26} {o['case']:18} {o['ms']:9.2f} ms")
    for k, v in res["model"].items():
        print(f"{k:30} {v:9.1f}")
    print_server(res["server"])


def print_server(res: dict) -> None:
    for k, v in res.items():
        if isinstance(v, dict):
            print(
                f"server {k:10} {v['output_tokens_per_s']:8.1f} tok/s   TTFT median {v['ttft_median_s'] * 1e3:7.1f} ms"
            )
        else:
            print(f"server {k} {v:.2f}")


if __name__ == "__main__":
    main()
