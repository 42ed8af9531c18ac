"""Tensor parallelism on CPU (gloo): step times of the tiny model at TP 1, 2 and 4.

    python benchmarks/bench_tp_cpu.py [--json OUT]

Each TP size runs in a process of its own (a process sets up paddle.distributed once): a
512-token prefill in one step, then 64 decode steps of 1 sequence and of 16 sequences. On a CPU
the ranks share the cores, so this shows the cost of the collectives, not a speed-up.
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
llm = LLM(model="tiny-mla-swa", tensor_parallel_size=int(sys.argv[1]), block_size=16, num_gpu_blocks_override=400,
          max_model_len=1024, max_num_batched_tokens=512)
rng = np.random.default_rng(0)
ids = lambda n: {"prompt_token_ids": [int(x) for x in rng.integers(4, 500, n)]}
llm.generate([ids(8)], SamplingParams(max_tokens=2))  # warm up
t = time.perf_counter(); llm.generate([ids(511)], SamplingParams(max_tokens=1)); prefill = time.perf_counter() - t
t = time.perf_counter(); llm.generate([ids(8)], SamplingParams(max_tokens=65, ignore_eos=True))
one = time.perf_counter() - t
t = time.perf_counter(); llm.generate([ids(8) for _ in range(16)], SamplingParams(max_tokens=65, ignore_eos=True))
many = time.perf_counter() - t
print("RESULT " + json.dumps({"prefill_512_ms": 1e3 * prefill, "decode_step_ms_1_seq": 1e3 * one / 65,
                              "decode_step_ms_16_seqs": 1e3 * many / 65}))
llm.engine.shutdown()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    res = {}
    for tp in (1, 2, 4):
        p = subprocess.run([sys.executable, "-c", RUN, str(tp)], capture_output=True, text=True, cwd=root, timeout=600)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            sys.exit(p.stderr[-3000:])
        res[f"tp{tp}"] = json.loads(line[0][len("RESULT ") :])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), **res}, f, indent=1)
    print(f"{'':5} {'prefill 512 (ms)':>17} {'decode step, 1 seq (ms)':>24} {'decode step, 16 seqs (ms)':>26}")
    for k, r in res.items():
        print(
            f"{k:5} {r['prefill_512_ms']:17.1f} {r['decode_step_ms_1_seq']:24.1f} {r['decode_step_ms_16_seqs']:26.1f}"
        )


if __name__ == "__main__":
    main()
