"""MTP speculative decoding on CPU (docs/design.md §4.16), on the fitted tiny checkpoint
(``make_tiny_model --mtp``: 4 layers, W = 32, an SWA MTP layer fitted to the model's own
greedy continuations).

    python benchmarks/bench_mtp.py [--json OUT] [--batches 1,8,32] [--tokens 64]

1. Greedy decode with k = 0 / 1 / 2 / 3 drafts at 1, 8 and 32 requests (16-token prompts,
   ``--tokens`` generated each): acceptance per draft position, tokens a verify step adds (1 +
   accepted drafts), steps, decode tokens/s and its ratio to k = 0; every k's tokens checked
   equal to k = 0's.
2. Prefix-cache hit rate on 4 conversations x 5 turns (bench_kv_memory's workload) with and
   without speculation (k = 1).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np

from fastdeploy import LLM, SamplingParams
from fastdeploy.tools.make_tiny_model import make_tiny_model
from fastdeploy.tools.mtp_fit import fit_mtp


def spec(k: int) -> dict:
    return {"speculative_config": json.dumps({"method": "mtp", "num_speculative_tokens": k})} if k else {}


def decode(model_dir: str, k: int, batch: int, tokens: int) -> tuple[dict, list[list[int]]]:
    llm = LLM(model_dir, block_size=16, max_num_seqs=max(batch, 1), **spec(k))
    rng = np.random.default_rng(batch)
    prompts = [{"prompt_token_ids": [int(x) for x in rng.integers(4, 256, 16)]} for _ in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    eng = llm.engine
    steps, decode_s, t_first = 0, 0.0, None
    for i, p in enumerate(prompts):
        eng.add_request(p["prompt_token_ids"], sp, f"r{i}")
    outs = {}
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        done = eng.step()
        dt = time.perf_counter() - t
        if t_first is None:  # the prefill step
            t_first = dt
        else:
            decode_s += dt
            steps += 1
        for o in done:
            outs[o.request_id] = o
    s = eng.spec
    toks = [outs[f"r{i}"].outputs[0].token_ids for i in range(batch)]
    row = {
        "k": k,
        "batch": batch,
        "decode_steps": steps,
        "decode_tokens_per_s": (batch * tokens - batch) / decode_s,
        "acceptance_per_pos": [a / s.num_drafts for a in s.accepted_per_pos] if s.num_drafts else [],
        "mean_accepted_length": 1 + s.num_accepted_tokens / s.num_drafts if s.num_drafts else 1.0,
    }
    eng.shutdown()
    return row, toks


def multi_turn(model_dir: str, k: int) -> dict:
    llm = LLM(model_dir, block_size=16, num_gpu_blocks_override=400, enable_prefix_caching=True, **spec(k))
    rng = np.random.default_rng(1)
    convs = [[int(x) for x in rng.integers(4, 256, 40)] for _ in range(4)]
    cached = total = 0
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    for _ in range(5):
        outs = llm.generate([{"prompt_token_ids": c} for c in convs], sp)
        for c, o in zip(convs, outs, strict=True):
            cached += o.num_cached_tokens
            total += len(c)
            c += o.outputs[0].token_ids + [int(x) for x in rng.integers(4, 256, 12)]
    llm.engine.shutdown()
    return {"k": k, "cached_prompt_tokens": cached, "prompt_tokens": total, "hit_rate": cached / total}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    d = make_tiny_model(tempfile.mkdtemp(prefix="fd-mtp-"), first_k_dense=0, mtp=True)
    fit = fit_mtp(d, 0)
    print(f"fitted MTP layer: held-out first-draft acceptance {fit['acceptance_held_out']:.3f}")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        base = None
        for k in (0, 1, 2, 3):
            row, toks = decode(d, k, batch, args.tokens)
            if base is None:
                base = (row["decode_tokens_per_s"], toks)
            row["speedup"] = row["decode_tokens_per_s"] / base[0]
            row["greedy_equal"] = toks == base[1]
            rows.append(row)
            acc = " / ".join(f"{a:.2f}" for a in row["acceptance_per_pos"]) or "-"
            print(
                f"batch {batch:3d} k={k}: acceptance per position {acc}, {row['mean_accepted_length']:.2f} tokens "
                f"a step, {row['decode_steps']} steps, {row['decode_tokens_per_s']:.1f} tok/s "
                f"({row['speedup']:.2f}x), greedy equal {row['greedy_equal']}"
            )
    chat = [multi_turn(d, k) for k in (0, 1)]
    for c in chat:
        hits = f"{c['cached_prompt_tokens']}/{c['prompt_tokens']}"
        print(f"5-turn chat, k={c['k']}: {hits} prompt tokens cached ({100 * c['hit_rate']:.1f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fit": fit, "decode": rows, "multi_turn": chat}, f, indent=1)


if __name__ == "__main__":
    main()
