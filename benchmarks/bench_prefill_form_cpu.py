"""The MLA prefill forms on CPU (issue 37, item 8): one prompt's prefill through ``LLM`` in the MHA
form, the absorbed form and ``auto``, on the tiny checkpoint (4 layers, 4 heads, W 32) widened
to 8192 positions, at the lengths given. ``auto`` prices both forms with the reference
provider's ``CPU_REFERENCE_RATES``, which are fitted from the MHA and absorbed rows
(``--fit FILE.json``: each form's seconds over the cost model's FLOPs, by least squares).

    python benchmarks/bench_prefill_form_cpu.py [--lengths 650,1300,4096] [--forms mha,absorbed,auto]
        [--json OUT.json]
    python benchmarks/bench_prefill_form_cpu.py --fit OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.model_executor.layers.attention.prefill_form import PrefillRates, prefill_seconds  # noqa: E402
from fastdeploy.tools.tiny_checkpoint import make_tiny_model  # noqa: E402


def widened_checkpoint(root: str, positions: int) -> str:
    """The tiny checkpoint with ``max_position_embeddings`` (and the tokenizer's limit) raised."""
    path = make_tiny_model(os.path.join(root, "tiny"))
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        with open(os.path.join(path, name), encoding="utf-8") as f:
            cfg = json.load(f)
        cfg[key] = positions
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(cfg, f)
    return path


def time_prefill(model: str, form: str, length: int, vocab: int) -> float:
    """Seconds of one greedy 1-token request of ``length`` prompt tokens (after a 64-token warm-up)."""
    llm = LLM(model=model, mla_prefill_form=form, max_model_len=length + 8)
    ids = [(7 * i + 3) % (vocab - 8) + 4 for i in range(length)]
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate({"prompt_token_ids": ids[:64]}, sp)
    t = time.perf_counter()
    llm.generate({"prompt_token_ids": ids}, sp)
    return time.perf_counter() - t


HEADS, WINDOWS, BUDGET = 4, (32, 0, 32, 0), 2048  # the tiny checkpoint's layers; the default token budget
FLOPS = PrefillRates(mha_attention=1.0, decompress=1.0, absorbed=1.0, mha_fixed=0.0)  # "seconds" = FLOPs


def model_flops(length: int) -> dict[str, float]:
    """The cost model's FLOPs of one prompt in each form (``prefill_seconds`` at unit rates, the
    MHA form's attention and decompression together), summed over its chunks of ``BUDGET`` and
    the layers."""
    total = {"mha": 0.0, "absorbed": 0.0}
    for start in range(0, length, BUDGET):
        for w in WINDOWS:
            for form, flops in prefill_seconds(min(BUDGET, length - start), start, w, HEADS, FLOPS).items():
                total[form] += flops
    return total


def fit(rows: list[dict]) -> dict[str, float]:
    """Each form's rate from its measured seconds over its modelled FLOPs, by least squares
    through the origin over the lengths. The parts of a step both forms share (MoE, norms,
    sampling) are charged to the rates too, which matters only where the attention is small."""
    flops = [model_flops(r["tokens"]) for r in rows]
    rates = {}
    for form in ("mha", "absorbed"):
        x = np.array([f[form] for f in flops])
        y = np.array([r[form] for r in rows])
        rates[f"{form}_flops_per_s"] = float(x @ x / (x @ y))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="650,1300,4096")
    ap.add_argument("--forms", default="mha,absorbed,auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fit", default=None, help="a JSON this script wrote (mha and absorbed): fit the rates")
    args = ap.parse_args()
    if args.fit:
        with open(args.fit, encoding="utf-8") as f:
            print(fit(json.load(f)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as root:
        model = widened_checkpoint(root, 8192)
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            vocab = json.load(f)["vocab_size"]
        for length in map(int, args.lengths.split(",")):
            row = {"tokens": length}
            for form in args.forms.split(","):
                row[form] = time_prefill(model, form, length, vocab)
                print(length, form, f"{row[form]:.2f} s", flush=True)
            rows.append(row)
    print("\n| tokens | " + " | ".join(f"{f} s" for f in args.forms.split(",")) + " |")
    for r in rows:
        print(f"| {r['tokens']} | " + " | ".join(f"{r[f]:.2f}" for f in args.forms.split(",")) + " |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
