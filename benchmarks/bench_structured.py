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


class SyntheticVocab:
    """A stand-in tokenizer of DeepSeek-V3's size for llguidance's TokenizerWrapper: the 256 bytes
    plus seeded random 2-8 letter / punctuation strings (no real BPE: only the mask's cost is
    timed, not the text)."""

    def __init__(self, size: int = 129280, seed: int = 0) -> None:
        import numpy as np

        rng = np.random.default_rng(seed)
        alphabet = list(b'abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ0123456789{}[]":,.-_\n')
        toks = {bytes([b]) for b in range(256)}
        while len(toks) < size - 1:
            toks.add(bytes(rng.choice(alphabet, rng.integers(2, 9))))
        self.tokens = sorted(toks) + [b"<eos>"]
        self.eos_token_id, self.bos_token_id = size - 1, None
        self.special_token_ids = [size - 1]

    def __call__(self, data: bytes) -> list[int]:
        return [self.tokens.index(bytes([b])) for b in data]  # byte by byte: only used for forced text


def mask_cost(rows: int = 32, vocab: int = 129280, steps: int = 20, forward_ms: float = 20.0) -> dict:
    """ms a step of computing ``rows`` JSON-schema masks at DeepSeek-V3's vocabulary size
    (llguidance's packed words, as the runner takes them), of applying them with the runner's CPU
    op (paddle), and of a step whose forward is a ``forward_ms`` wait (what the host sees while
    the GPU runs: the GIL is free) with the masks computed before it (as the runner did) and
    beside it in the runner's mask thread (as it does now)."""
    from concurrent.futures import ThreadPoolExecutor

    import llguidance
    import numpy as np
    import paddle

    from fastdeploy.input.grammar import token_bitmask, unpack_bitmask
    from fastdeploy.model_executor.ops.triton_ops.token_mask import apply_token_bitmask

    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(SyntheticVocab(vocab)), n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.loads(CONSTRAINTS["json_schema"].spec))
    matchers = [llguidance.LLMatcher(lltok, grammar, log_level=0) for _ in range(rows)]
    rng = np.random.default_rng(0)
    logits = paddle.randn([rows, vocab])
    pool = ThreadPoolExecutor(1)
    t_mask = t_apply = t_serial = t_overlap = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        words = token_bitmask([(m, []) for m in matchers], vocab)
        t1 = time.perf_counter()
        out = apply_token_bitmask(logits, words, list(range(rows)), triton=False)
        float(out[0, 0])
        t2 = time.perf_counter()
        time.sleep(forward_ms / 1e3)  # serial: masks, then the forward
        t3 = time.perf_counter()
        fut = pool.submit(token_bitmask, matchers, vocab)
        time.sleep(forward_ms / 1e3)
        fut.result()
        t4 = time.perf_counter()
        t_mask, t_apply = t_mask + t1 - t0, t_apply + t2 - t1
        t_serial, t_overlap = t_serial + t3 - t0 - (t2 - t1), t_overlap + t4 - t3
        for m, k in zip(matchers, unpack_bitmask(words, vocab), strict=True):
            m.consume_token(int(rng.choice(np.flatnonzero(k))))
    ms = 1e3 / steps
    return {
        "rows": rows,
        "vocab": vocab,
        "mask_ms": t_mask * ms,
        "apply_ms_cpu": t_apply * ms,
        "forward_ms": forward_ms,
        "step_ms_masks_then_forward": t_serial * ms,
        "step_ms_masks_beside_forward": t_overlap * ms,
    }


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
    mc = mask_cost()
    print(
        f"{mc['rows']} masks at vocabulary {mc['vocab']}: {mc['mask_ms']:.2f} ms a step; masking op on CPU "
        f"{mc['apply_ms_cpu']:.2f} ms; a step with a {mc['forward_ms']:.0f} ms forward: "
        f"{mc['step_ms_masks_then_forward']:.2f} ms masks first, {mc['step_ms_masks_beside_forward']:.2f} ms beside it"
    )
    comp = compile_times()
    print(
        f"compile: cold {comp['cold_ms']:.1f} ms, cached {comp['cached_ms']:.3f} ms (+ matcher "
        f"{comp['cached_plus_matcher_ms']:.2f} ms)"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"decode": rows, "compile": comp, "mask_at_v3_vocab": mc}, f, indent=1)


if __name__ == "__main__":
    main()
