"""The MLA prefill forms on CPU (issue 37, item 8): one prompt's prefill through ``LLM`` in the MHA
form, the absorbed form and ``auto``, on the tiny checkpoint (4 layers, 4 heads, W 32) widened
to 8192 positions, at the lengths given. ``auto`` prices both forms with the reference
provider's ``CPU_REFERENCE_RATES``; the rates are fitted from these numbers (``--fit``: the
absorbed and MHA seconds per modelled unit, by least squares over the lengths).

    python benchmarks/bench_prefill_form_cpu.py [--lengths 650,1300,4096] [--forms mha,absorbed,auto]
        [--json OUT.json]
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
from fastdeploy.model_executor.layers.attention.prefill_form import attended_pairs  # noqa: E402
from fastdeploy.model_executor.tiny_checkpoint import make_tiny_model  # noqa: E402


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


def model_units(length: int) -> dict[str, float]:
    """The cost model's FLOPs of one prompt, summed over its chunks of ``BUDGET`` and the layers:
    the MHA form's attention, its decompression, and the absorbed form (prefill_form.py)."""
    units = {"mha_attention": 0.0, "decompress": 0.0, "absorbed": 0.0, "mha_launches": 0.0}
    for start in range(0, length, BUDGET):
        chunk = min(BUDGET, length - start)
        for w in WINDOWS:
            pairs = attended_pairs(chunk, start, w)
            keys = chunk + (min(start, w - 1) if w > 0 else start)
            units["mha_attention"] += 2 * HEADS * pairs * 320
            units["decompress"] += 2 * HEADS * keys * 512 * 256
            units["absorbed"] += 2 * HEADS * pairs * 1088
            units["mha_launches"] += 1
    return units


def fit(rows: list[dict]) -> dict[str, float]:
    """Rates from measured seconds, by least squares through the origin: the MHA form's whole
    time over its FLOPs (attention and decompression at one rate; the parts both forms share are
    charged to it, which errs toward the absorbed form only for the shortest chunks), and the
    absorbed form's time minus the MHA form's non-attention share over the absorbed FLOPs."""
    u = [model_units(r["tokens"]) for r in rows]
    mha_flops = np.array([x["mha_attention"] + x["decompress"] for x in u])
    abs_flops = np.array([x["absorbed"] for x in u])
    mha_s = np.array([r["mha"] for r in rows])
    abs_s = np.array([r["absorbed"] for r in rows])
    inv_mha = float(mha_flops @ mha_s / (mha_flops @ mha_flops))
    inv_abs = float(abs_flops @ abs_s / (abs_flops @ abs_flops))
    return {"mha_flops_per_s": 1 / inv_mha, "absorbed_flops_per_s": 1 / inv_abs}


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
            row = {
                "tokens": length,
                "full_pairs": attended_pairs(length, 0, 0),
                "swa_pairs": attended_pairs(length, 0, 32),
            }
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
