"""Prefill/decode disaggregation's KV transfer (docs/design.md §4.20).

    python benchmarks/bench_kv_transfer.py [--json OUT] [--prompt 4000] [--connector MooncakeConnector] [--reps 5]

1. The tiny SWA checkpoint (max_position_embeddings raised so a 4K prompt fits; W = 32, block 16):
   a decode engine reserves a prompt's blocks, a prefill engine computes the prompt and pushes
   them through the transfer engine over TCP on 127.0.0.1, in one batch once the first token is
   drawn (``kv_push`` end) or layer by layer during the prompt's last step (``kv_push`` layer);
   the bytes by KV cache group, and the push's time after the first token against the transfer
   engine's own time for one contiguous write of as many bytes between the same two endpoints
   (the target: within 2x), and the whole prefill's.
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


def measure_tiny(n: int, connector: str, push: str = "end", reps: int = 5) -> dict:
    """``reps`` fresh prompts of n tokens handed off with ``kv_push`` ``push``: the median push
    (the wait in ``KVHandoff.push`` once the first token is drawn: what the transfer adds to the
    prefill) and the median prefill (enqueue to the pushed first token)."""
    from fastdeploy import LLM, SamplingParams

    tmp = tempfile.mkdtemp()
    try:
        model = tiny_4k_model(os.path.join(tmp, "m"))
        kw = dict(model=model, block_size=16, num_gpu_blocks_override=n // 16 + 8, max_model_len=n + 64)
        kw["max_num_batched_tokens"] = 1024
        cfg = '{"kv_connector": "%s", "kv_role": "%s", "kv_timeout": 60, "kv_push": "%s"}'
        pre = LLM(**kw, kv_transfer_config=cfg % (connector, "kv_producer", push)).engine
        dec = LLM(**kw, kv_transfer_config=cfg % (connector, "kv_consumer", push)).engine
        sp = SamplingParams(max_tokens=1, temperature=0)
        timed, push_s, prefill_s = {}, [], []
        pushed = pre.kv.push

        def timed_push(tables, t):
            t0 = time.perf_counter()
            sent = pushed(tables, t)
            timed["push_s"] = time.perf_counter() - t0
            return sent

        pre.kv.push = timed_push
        rng = np.random.default_rng(0)
        for r in range(reps + 1):  # the first warms up
            ids = [int(x) for x in rng.integers(2, 500, n)]
            target = dec.reserve(dec.make_request(ids, sp, f"d{r}"))
            preq = pre.make_request(ids, sp, f"p{r}")
            preq.kv_target = target
            t0 = time.perf_counter()
            pre.enqueue(preq)
            while pre.has_unfinished_requests():
                pre.step()
            if r:
                prefill_s.append(time.perf_counter() - t0)
                push_s.append(timed["push_s"])
            assert preq.error is None, preq.error
            dec.abort_request(f"d{r}")  # its blocks back for the next
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
        push_med, prefill_med = float(np.median(push_s)), float(np.median(prefill_s))
        return {
            "prompt_tokens": n,
            "kv_push": push,
            "bytes_sent": sent,
            "bytes_if_every_block": every,
            "push_ms": 1e3 * push_med,
            "push_ms_each": [1e3 * x for x in push_s],
            "prefill_ms": 1e3 * prefill_med,
            "prefill_ms_each": [1e3 * x for x in prefill_s],
            "raw_write_ms": 1e3 * raw,
            "push_GBps": total / push_med / 1e9,
            "raw_GBps": total / raw / 1e9,
            "ratio": push_med / raw,
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
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    runs = {push: measure_tiny(a.prompt, a.connector, push, a.reps) for push in ("end", "layer")}
    tiny = runs["end"]
    v3 = deepseek_v3()
    mb = lambda x: f"{x / 1e6:.2f} MB"  # noqa: E731
    print(f"tiny SWA checkpoint, {tiny['prompt_tokens']}-token prompt, {a.connector} over TCP:")
    for g, b in tiny["bytes_sent"].items():
        print(f"  {g}: sent {mb(b)} (every block would be {mb(tiny['bytes_if_every_block'][g])})")
    for push, t in runs.items():
        print(
            f"  kv_push {push}: push {t['push_ms']:.1f} ms after the first token ({t['push_GBps']:.2f} GB/s); the "
            f"transfer engine's own write of as many bytes {t['raw_write_ms']:.1f} ms ({t['raw_GBps']:.2f} GB/s); "
            f"ratio {t['ratio']:.2f} (target <= 2); prefill and push {t['prefill_ms']:.0f} ms (medians of {a.reps})"
        )
    print("DeepSeek-V3, 30 of 61 layers SWA, a 4096-token prompt:")
    for w, r in v3.items():
        print(
            f"  {w}: full layers {mb(r['full_layers'])}, SWA layers {mb(r['swa_window_only'])} "
            f"(every block: {mb(r['swa_every_block'])}); total {mb(r['full_layers'] + r['swa_window_only'])}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "connector": a.connector, "tiny": runs, "deepseek_v3": v3}, f, indent=1)


if __name__ == "__main__":
    main()
