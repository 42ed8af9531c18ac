"""KV cache memory with KV cache groups and SWA release (CPU; counts, plus tiny-model engine runs).

    python benchmarks/bench_kv_memory.py [--json OUT]

1. A DeepSeek-V3-shaped config (61 layers, W = 4096, window_attn_skip_freq 4: 46 SWA layers and
   15 full; block 64; chunk 2048): KV bytes one request holds at 4K, 32K and 128K tokens, today's
   single-pool layout (every layer keeps every token) beside the grouped one (SWA layers keep
   their window), with bf16 and fp8 full-layer caches, and how many 128K requests fit 100 GiB.
   Bytes per block come from the runner's own cache specs; the grouped SWA figure is the peak a
   BlockManager reaches driving one request through chunked prefill and decode to that length.
2. The engine on tiny checkpoints (all-SWA, and 3 SWA : 1 full), one request growing to 20W:
   the peak SWA blocks it held at any step against ceil((W - 1 + chunk) / bs) + 1.
3. Multi-turn prefix hits: 4 conversations x 5 turns on the tiny hybrid, cached prompt tokens
   over all prompt tokens with release on and off.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.cache_manager.block_manager import BlockManager  # noqa: E402
from fastdeploy.config import CacheConfig, FDConfig, ModelConfig, swa_blocks_per_request  # noqa: E402
from fastdeploy.model_executor.models.deepseek_v3 import layer_kv_specs  # noqa: E402
from fastdeploy.request import Request  # noqa: E402
from fastdeploy.tools.tiny_checkpoint import make_tiny_model  # noqa: E402
from fastdeploy.worker.kv_sizing import group_bytes_per_block  # noqa: E402

GiB = 2**30
DSV3 = dict(num_hidden_layers=61, sliding_window=4096, window_attn_skip_freq=4)  # the rest: DeepSeek-V3's defaults


def peak_blocks(length: int, W: int, bs: int, chunk: int) -> dict[str, int]:
    """Drive one request through a BlockManager to ``length`` tokens; the most blocks each pool held."""
    bm = BlockManager({"full": length // bs + 2, "swa": length // bs + 2}, bs, sliding_window=W)
    req = Request("r", [0] * (length - 16), SamplingParams())  # a long prompt, then 16 decodes
    peak = {"full": 0, "swa": 0}
    while req.num_computed_tokens < length:
        if req.num_computed_tokens >= req.num_tokens:  # decode past the prompt
            req.output_token_ids.append(0)
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert bm.allocate(req, n)
        req.num_computed_tokens += n
        for g, p in bm.pools.items():
            peak[g] = max(peak[g], p.num_used)
    return peak


def memory_table() -> list[dict]:
    bs, chunk, rows = 64, 2048, []
    mc = ModelConfig.from_dict(DSV3)
    for kv in ("bf16", "fp8"):
        fd = FDConfig(mc, CacheConfig(block_size=bs, kv_cache_dtype=kv))
        per = group_bytes_per_block(layer_kv_specs(dataclasses.replace(mc, dtype="bfloat16"), fd.cache_config), bs)
        for L in (4096, 32768, 131072):
            today = -(-L // bs) * (per["full"] + per["swa"])
            peak = peak_blocks(L, mc.sliding_window, bs, chunk)
            grouped = peak["full"] * per["full"] + peak["swa"] * per["swa"]
            rows.append(
                {
                    "full_layer_cache": kv,
                    "tokens": L,
                    "today_GB": today / 1e9,
                    "grouped_GB": grouped / 1e9,
                    "swa_blocks_peak": peak["swa"],
                    "swa_blocks_bound": swa_blocks_per_request(mc.sliding_window, chunk, bs),
                    "fit_100GiB_today": int(100 * GiB // today),
                    "fit_100GiB_grouped": int(100 * GiB // grouped),
                }
            )
    return rows


class Watch:
    """Peak SWA blocks of the scheduled request at any step, and its full blocks."""

    def __init__(self, llm: LLM) -> None:
        self.peak_swa = self.peak_full = 0
        inner = llm.engine.runner.prepare

        def prepare(scheduled):
            for req, _ in scheduled:
                self.peak_swa = max(self.peak_swa, sum(b >= 0 for b in req.block_tables.get("swa", [])))
                self.peak_full = max(self.peak_full, len(req.block_tables.get("full", [])))
            return inner(scheduled)

        llm.engine.runner.prepare = prepare


def engine_bound(tmp: str) -> list[dict]:
    W, bs, chunk, rows = 32, 16, 64, []
    for name, swa_layers in (("all SWA", [0, 1, 2, 3]), ("3 SWA : 1 full", [0, 1, 2])):
        d = make_tiny_model(os.path.join(tmp, name.replace(" ", "_").replace(":", "")), seed=7, swa_layers=swa_layers)
        llm = LLM(model=d, block_size=bs, max_num_batched_tokens=chunk, max_num_seqs=2, max_model_len=20 * W + bs)
        watch = Watch(llm)
        prompt = [int(x) for x in np.random.default_rng(0).integers(2, 500, 3 * W + 5)]
        out = llm.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=20 * W - len(prompt), ignore_eos=True)
        )
        bm = llm.engine.block_manager
        rows.append(
            {
                "checkpoint": name,
                "W": W,
                "length": len(prompt) + len(out[0].outputs[0].token_ids),
                "swa_blocks_peak": watch.peak_swa,
                "swa_blocks_bound": swa_blocks_per_request(W, chunk, bs),
                "full_blocks_at_end": watch.peak_full,
                "swa_blocks_released": bm.swa_blocks_released,
                "all_free_after": all(p.num_free == p.num_blocks for p in bm.pools.values()),
            }
        )
    return rows


def multi_turn(release: bool) -> dict:
    llm = LLM(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=400, enable_prefix_caching=True)
    llm.engine.block_manager.release_swa = release
    rng = np.random.default_rng(1)
    convs = [[int(x) for x in rng.integers(2, 500, 40)] for _ in range(4)]
    cached = total = 0
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    for _ in range(5):
        outs = llm.generate([{"prompt_token_ids": c} for c in convs], sp)
        for c, o in zip(convs, outs, strict=True):
            cached += o.num_cached_tokens
            total += len(c)
            c += o.outputs[0].token_ids + [int(x) for x in rng.integers(2, 500, 12)]
    bm = llm.engine.block_manager
    return {
        "release": release,
        "cached_prompt_tokens": cached,
        "prompt_tokens": total,
        "hit_rate": cached / total,
        "swa_blocks_released": bm.swa_blocks_released,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = {
            "memory": memory_table(),
            "engine": engine_bound(tmp),
            "multi_turn": [multi_turn(True), multi_turn(False)],
        }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    head = ("full cache", "tokens", "today GB", "grouped GB", "SWA peak/bound", "128K fit 100GiB")
    print(f"{head[0]:10} {head[1]:>7} {head[2]:>9} {head[3]:>11} {head[4]:>15} {head[5]:>16}")
    for r in res["memory"]:
        fit = f"{r['fit_100GiB_today']} -> {r['fit_100GiB_grouped']}" if r["tokens"] == 131072 else ""
        print(
            f"{r['full_layer_cache']:10} {r['tokens']:7} {r['today_GB']:9.2f} {r['grouped_GB']:11.2f} "
            f"{r['swa_blocks_peak']:>7}/{r['swa_blocks_bound']:<7} {fit:>16}"
        )
    for r in res["engine"]:
        print(
            f"engine {r['checkpoint']:15} W={r['W']} to {r['length']} tokens: SWA blocks peak {r['swa_blocks_peak']} "
            f"(bound {r['swa_blocks_bound']}), full blocks {r['full_blocks_at_end']}, all free after: "
            f"{r['all_free_after']}"
        )
    for r in res["multi_turn"]:
        print(
            f"multi-turn, release {'on ' if r['release'] else 'off'}: {r['cached_prompt_tokens']}/{r['prompt_tokens']} "
            f"prompt tokens cached ({100 * r['hit_rate']:.1f}%)"
        )


if __name__ == "__main__":
    main()
