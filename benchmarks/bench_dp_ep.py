"""Data-parallel cores with expert parallelism against tensor parallelism (docs/design.md §4.19).

    python benchmarks/bench_dp_ep.py [--json OUT] [--config benchmarks/configs/deepseek_v3.json]

1. Bytes one rank sends per MoE layer in a decode step, from the shapes the code moves
   (layers/moe.py, layers/moe_dispatch.py) for a config at 8 ranks: TP 8 all-reduces the float32
   output of every token; DP 8 / EP 8 all-gathers each rank's hidden states (the model dtype),
   top-k ids (int64) and weights (float32) with a count first, then reduce-scatters the float32
   partial outputs (NCCL) or, on gloo, all-reduces them and keeps its slice. Ring algorithms: an
   all-gather or reduce-scatter of S bytes in all sends (n - 1) / n x S a rank, an all-reduce
   twice that.
2. CPU (gloo, this machine's cores shared by the ranks): a decode step of the tiny model at the
   same global batch under TP 2 and under DP 2 x EP 2, each in a process of its own; a step's time
   is the difference of two runs of m and 2m tokens over m.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

RUN = """
import json, sys, time
import numpy as np
from fastdeploy import LLM, SamplingParams
kw, batch = json.loads(sys.argv[1]), int(sys.argv[2])
llm = LLM(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=400, max_model_len=512, **kw)
rng = np.random.default_rng(0)
ids = lambda n: {"prompt_token_ids": [int(x) for x in rng.integers(4, 500, n)]}
llm.generate([ids(8)], SamplingParams(max_tokens=2))  # warm up
times = {}
for m in (16, 48):
    t = time.perf_counter()
    llm.generate([ids(8) for _ in range(batch)], SamplingParams(max_tokens=m, ignore_eos=True))
    times[m] = time.perf_counter() - t
print("RESULT " + json.dumps(1e3 * (times[48] - times[16]) / 32))
llm.engine.shutdown()
"""

LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "dp2_ep2": {"data_parallel_size": 2, "enable_expert_parallel": True}}


def moe_bytes(cfg: dict, batch: int, ranks: int = 8, dtype_bytes: int = 2) -> dict:
    """Bytes one rank sends per MoE layer in a decode step of ``batch`` requests a rank (DP) or
    ``batch`` x ``ranks`` requests over the TP group (the same global batch)."""
    H, k, n = cfg["hidden_size"], cfg["num_experts_per_tok"], ranks
    ring = (n - 1) / n
    tp_tokens = batch * n
    tp = 2 * ring * tp_tokens * H * 4  # all-reduce of float32 [tokens, H]
    own = batch * (H * dtype_bytes + k * 8 + k * 4) + 8  # hidden, ids, weights, count
    gather = ring * n * own
    scatter = ring * n * batch * H * 4  # reduce-scatter of float32 [n * batch, H]
    return {
        "global_batch": tp_tokens,
        "tp_all_reduce": tp,
        "ep_all_gather": gather,
        "ep_reduce_scatter_nccl": scatter,
        "ep_all_reduce_gloo": 2 * scatter,
        "ep_total_nccl": gather + scatter,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "configs", "deepseek_v3.json"))
    ap.add_argument("--batches", default="8,32")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)
    res: dict = {"cpus": os.cpu_count(), "bytes": {b: moe_bytes(cfg, b) for b in (1, 32, 256)}}
    mb = lambda x: f"{x / 1e6:8.2f} MB"  # noqa: E731
    print(f"bytes a rank sends per MoE layer per decode step, {os.path.basename(args.config)}, 8 ranks")
    print(f"{'batch a rank':>12} {'TP 8 all-reduce':>16} {'EP gather':>12} {'EP scatter':>12} {'EP total':>12}")
    for b, r in res["bytes"].items():
        print(
            f"{b:12d} {mb(r['tp_all_reduce']):>16} {mb(r['ep_all_gather']):>12} "
            f"{mb(r['ep_reduce_scatter_nccl']):>12} {mb(r['ep_total_nccl']):>12}"
        )
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    steps: dict = {}
    for batch in (int(x) for x in args.batches.split(",")):
        for name, kw in LAYOUTS.items():
            cmd = [sys.executable, "-c", RUN, json.dumps(kw), str(batch)]
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=600)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not line:
                sys.exit(p.stderr[-3000:])
            steps.setdefault(batch, {})[name] = json.loads(line[0][len("RESULT ") :])
    res["cpu_decode_step_ms"] = steps
    print("\nCPU decode step (ms), tiny model, gloo, the same global batch")
    print(f"{'global batch':>12} {'TP 2':>8} {'DP 2 x EP 2':>12} {'ratio':>6}")
    for batch, r in steps.items():
        print(f"{batch:12d} {r['tp2']:8.1f} {r['dp2_ep2']:12.1f} {r['dp2_ep2'] / r['tp2']:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
