"""Prefill/decode disaggregation's KV transfer (docs/design.md §4.20).

    python benchmarks/bench_kv_transfer.py [--json OUT] [--prompt 4000] [--connector MooncakeConnector]

1. The tiny SWA checkpoint (max_position_embeddings raised so a 4K prompt fits; W = 32, block 16):
   a decode engine reserves a prompt's blocks, a prefill engine computes the prompt and pushes
   them (one batch, every layer) through the transfer engine over TCP on 127.0.0.1; the bytes by
   KV cache group, and the push's time against the transfer engine's own time for one contiguous
   write of as many bytes between the same two endpoints (the target: within 2x).
2. DeepSeek-V3 with half its layers SWA (the planner's arithmetic: 61 layers, 30 SWA with the
   656-byte FP8 record, 31 full with the bf16 latent of 1152 bytes, blocks of 64): the bytes a 4K
   prompt sends, with every SWA layer's blocks against only the window's, at W 4096 and W 512.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np


def tiny_4k_model(out: str) -> str:
    from fastdeploy.tools.make_tiny_model import make_tiny_model

    d = make_tiny_model(out)
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 8192
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return d


def measure_tiny(n: int, connector: str) -> dict:
    from fastdeploy import LLM, SamplingParams
    from fastdeploy.model_executor.layers.sampler import SampleResult

    tmp = tempfile.mkdtemp()
    try:
        model = tiny_4k_model(os.path.join(tmp, "m"))
        kw = dict(model=model, block_size=16, num_gpu_blocks_override=n // 16 + 8, max_model_len=n + 64)
        kw["max_num_batched_tokens"] = 1024
        cfg = '{"kv_connector": "%s", "kv_role": "%s", "kv_timeout": 60}'
        pre = LLM(**kw, kv_transfer_config=cfg % (connector, "kv_producer")).engine
        dec = LLM(**kw, kv_transfer_config=cfg % (connector, "kv_consumer")).engine
        ids = [int(x) for x in np.random.default_rng(0).integers(2, 500, n)]
        sp = SamplingParams(max_tokens=1, temperature=0)
        dreq = dec.make_request(ids, sp, "d")
        target = dec.reserve(dreq)
        timed = {}
        push = pre.kv.push

        def timed_push(tables, t):
            t0 = time.perf_counter()
            sent = push(tables, t)
            timed["push_s"] = time.perf_counter() - t0
            return sent

        pre.kv.push = timed_push
        preq = pre.make_request(ids, sp, "p")
        preq.kv_target = target
        pre.enqueue(preq)
        while pre.has_unfinished_requests():
            pre.step()
        assert preq.error is None, preq.error
        dec.commit("d", SampleResult(preq.output_token_ids[0], 0.0, None))
        per_block = {}
        for g, _, b, _ in pre.kv.regions:
            per_block[g] = per_block.get(g, 0) + b
        sent = {g: len(p) * per_block[g] for g, p in target.fill.items()}
        every = {g: -(-n // 16) * per_block[g] for g in per_block}  # what sending every block would be
        total = sum(sent.values())
        # the transfer engine alone: one contiguous write of as many bytes, same two endpoints
        src, dst = np.ones(total, np.uint8), np.zeros(total, np.uint8)
        pre.kv.transport.register(src.ctypes.data, total)
        dec.kv.transport.register(dst.ctypes.data, total)
        pre.kv.transport.write_all(dec.kv.transport.session, [src.ctypes.data], [dst.ctypes.data], [total], 60)
        t0 = time.perf_counter()
        pre.kv.transport.write_all(dec.kv.transport.session, [src.ctypes.data], [dst.ctypes.data], [total], 60)
        raw = time.perf_counter() - t0
        assert int(dst[::4096].sum()) == len(dst[::4096])
        return {
            "prompt_tokens": n,
            "bytes_sent": sent,
            "bytes_if_every_block": every,
            "push_ms": 1e3 * timed["push_s"],
            "raw_write_ms": 1e3 * raw,
            "push_GBps": total / timed["push_s"] / 1e9,
            "raw_GBps": total / raw / 1e9,
            "ratio": timed["push_s"] / raw,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def deepseek_v3(n: int = 4096, block: int = 64) -> dict:
    """Bytes a prompt of n tokens sends for DeepSeek-V3 with 30 of its 61 layers SWA."""
    swa_layers, full_layers, record, latent = 30, 31, 656, 576 * 2
    full = full_layers * -(-n // block) * block * latent
    out = {}
    for w in (4096, 512):
        blocks = -(-n // block) - max(0, n - w + 1) // block  # the window the first generated position sees
        out[f"W{w}"] = {
            "full_layers": full,
            "swa_every_block": swa_layers * -(-n // block) * block * record,
            "swa_window_only": swa_layers * blocks * block * record,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--prompt", type=int, default=4000)
    ap.add_argument("--connector", default="MooncakeConnector")
    a = ap.parse_args()
    tiny = measure_tiny(a.prompt, a.connector)
    v3 = deepseek_v3()
    mb = lambda x: f"{x / 1e6:.2f} MB"  # noqa: E731
    print(f"tiny SWA checkpoint, {tiny['prompt_tokens']}-token prompt, {a.connector} over TCP:")
    for g, b in tiny["bytes_sent"].items():
        print(f"  {g}: sent {mb(b)} (every block would be {mb(tiny['bytes_if_every_block'][g])})")
    print(
        f"  push {tiny['push_ms']:.1f} ms ({tiny['push_GBps']:.2f} GB/s); the transfer engine's own write of as many "
        f"bytes {tiny['raw_write_ms']:.1f} ms ({tiny['raw_GBps']:.2f} GB/s); ratio {tiny['ratio']:.2f} (target <= 2)"
    )
    print("DeepSeek-V3, 30 of 61 layers SWA, a 4096-token prompt:")
    for w, r in v3.items():
        print(
            f"  {w}: full layers {mb(r['full_layers'])}, SWA layers {mb(r['swa_window_only'])} "
            f"(every block: {mb(r['swa_every_block'])}); total {mb(r['full_layers'] + r['swa_window_only'])}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "connector": a.connector, "tiny": tiny, "deepseek_v3": v3}, f, indent=1)


if __name__ == "__main__":
    main()
