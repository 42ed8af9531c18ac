"""Accuracy of the paddle model (CPU, float32) against the independent float64 numpy model of
fastdeploy/model_executor/models/deepseek_v3_reference.py on tiny checkpoints, as README's Accuracy section reports it.

    python benchmarks/accuracy.py [--json OUT]

- per-position relative logit error over a prompt of 3W + 5 tokens, against the reference with the
  same per-layer windows (exact) and with SWA layers' kv_c / k_pe rounded as the FP8 record keeps them;
- greedy agreement over 64 generated tokens: at each step, whether the reference's argmax on the
  same prefix equals the token the engine chose (teacher-forced, so one flip does not cascade),
  against both references.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.config import CacheConfig, FDConfig, ModelConfig  # noqa: E402
from fastdeploy.model_executor.models.deepseek_v3_reference import forward, load_np  # noqa: E402
from fastdeploy.tools.tiny_checkpoint import make_tiny_model  # noqa: E402
from fastdeploy.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

BLOCK = 16


def prompt_logits(d: str, ids: list[int]) -> np.ndarray:
    """float64 logits [len(ids), vocab] of one prefill through the paddle model (CPU reference path)."""
    n_blocks = -(-len(ids) // BLOCK)
    fd = FDConfig(ModelConfig.from_pretrained(d), CacheConfig(block_size=BLOCK, num_gpu_blocks_override=n_blocks))
    runner = GPUModelRunner(fd)
    meta = runner.meta_builder.build(ids, [len(ids)], [0], [list(range(n_blocks))])
    return runner.model.compute_logits(runner.model(meta, runner.caches)).numpy().astype(np.float64)


def position_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Relative error of each position's logits."""
    return np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)


def stats(e: np.ndarray) -> dict:
    return {"median": float(np.median(e)), "p90": float(np.quantile(e, 0.9)), "max": float(e.max())}


def run(name: str, d: str, seed: int = 0) -> dict:
    cfg = json.load(open(os.path.join(d, "config.json")))
    W = cfg["sliding_window"]
    windows = [W if f else None for f in cfg["window_attn_skip_freq"]]
    rng = np.random.default_rng(seed)
    ids = [int(x) for x in rng.integers(4, 500, 3 * W + 5)]
    w = load_np(d)
    got = prompt_logits(d, ids)
    res = {
        "checkpoint": name,
        "swa_layers": [i for i, x in enumerate(windows) if x],
        "W": W,
        "prompt": len(ids),
        "vs_exact": stats(position_errors(got, forward(w, cfg, ids, windows))),
        "vs_fp8_kv_reference": stats(position_errors(got, forward(w, cfg, ids, windows, fp8_kv=True))),
    }
    llm = LLM(model=d, block_size=16, num_gpu_blocks_override=64, max_model_len=512)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    gen = out[0].outputs[0].token_ids
    for key, fp8 in (("greedy_agreement_64", False), ("greedy_agreement_64_fp8_kv_ref", True)):
        ref_logits = forward(w, cfg, ids + gen[:-1], windows, fp8_kv=fp8)[len(ids) - 1 :]
        res[key] = float(np.mean(np.argmax(ref_logits, -1) == np.array(gen)))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    runs = [
        run("no SWA layers", make_tiny_model(os.path.join(tmp, "none"), seed=1, swa_layers=[])),
        run("layers 0, 2 SWA (default)", make_tiny_model(os.path.join(tmp, "mixed"), seed=2)),
        run(
            "all SWA, W=8", make_tiny_model(os.path.join(tmp, "all"), seed=3, sliding_window=8, swa_layers=[0, 1, 2, 3])
        ),
    ]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    print(
        f"{'checkpoint':28} {'vs exact: median / p90':>24} {'vs FP8-KV ref: median / p90':>28} "
        f"{'greedy 64 (exact / FP8-KV ref)':>30}"
    )
    for r in runs:
        a, b = r["vs_exact"], r["vs_fp8_kv_reference"]
        print(
            f"{r['checkpoint']:28} {a['median']:11.1e} / {a['p90']:8.1e} {b['median']:15.1e} / {b['p90']:8.1e} "
            f"{r['greedy_agreement_64']:14.3f} / {r['greedy_agreement_64_fp8_kv_ref']:.3f}"
        )


if __name__ == "__main__":
    main()
