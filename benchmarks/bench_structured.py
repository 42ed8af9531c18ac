"""Structured outputs on CPU (tiny model, its 512-token vocabulary): decode tokens/s at 1 and 32
requests without a constraint, with a regex and with a JSON Schema, and the compile time of a
schema cold (a new grammar engine: llguidance's tokenizer view built, then the schema) and
cached. The constraints cannot end before max_tokens (a regex of at least 64 characters; an
array of at least 64 integers), so every run decodes the same number of tokens.

    python benchmarks/bench_structured.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.input.grammar import GrammarEngine  # noqa: E402
from fastdeploy.sampling_params import StructuredOutput  # noqa: E402

MAX_TOKENS = 64
CONSTRAINTS = {
    "none": None,
    "regex": StructuredOutput("regex", "[a-z ]{64,4000}"),
    "json_schema": StructuredOutput(
        "json", json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 64, "maxItems": 500})
    ),
}


def decode_rate(llm: LLM, n: int, so: StructuredOutput | None) -> dict:
    """Decode tokens/s of n requests: the time after every request has its first token."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, structured=so) for i in range(n)]
    eng = llm.engine
    for i, p in enumerate(params):
        eng.add_request(f"prompt {i}:", p)
    t_first = None
    tokens_after = 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        if t_first is None and all(r.output_token_ids for r in eng.requests.values()):
            t_first = time.perf_counter()
        elif t_first is not None:
            tokens_after += len(outs)
    dt = time.perf_counter() - t_first
    return {"requests": n, "decode_tokens": tokens_after, "seconds": dt, "tokens_per_s": tokens_after / dt}


def compile_times() -> dict:
    llm = LLM("tiny-mla-swa", cuda_graph_batch_sizes="")
    spec = CONSTRAINTS["json_schema"].spec
    t0 = time.perf_counter()
    g = GrammarEngine(llm.engine.tokenizer, llm.engine.config.model_config.vocab_size)
    g.compile("json", spec)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    g.compile("json", spec)
    cached = time.perf_counter() - t0
    t0 = time.perf_counter()
    g.matcher(g.compile("json", spec))
    matcher = time.perf_counter() - t0
    return {"cold_ms": cold * 1e3, "cached_ms": cached * 1e3, "cached_plus_matcher_ms": matcher * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    llm = LLM("tiny-mla-swa", cuda_graph_batch_sizes="", max_num_seqs=64)
    decode_rate(llm, 4, CONSTRAINTS["regex"])  # warm up
    rows = []
    for n in (1, 32):
        for name, so in CONSTRAINTS.items():
            r = {"constraint": name, **decode_rate(llm, n, so)}
            rows.append(r)
            print(f"{n:3d} requests {name:12s} {r['tokens_per_s']:8.1f} decode tokens/s", flush=True)
    comp = compile_times()
    print(
        f"compile: cold {comp['cold_ms']:.1f} ms, cached {comp['cached_ms']:.3f} ms (+ matcher "
        f"{comp['cached_plus_matcher_ms']:.2f} ms)"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"decode": rows, "compile": comp}, f, indent=1)


if __name__ == "__main__":
    main()
