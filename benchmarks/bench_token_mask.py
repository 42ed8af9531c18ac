"""Structured-output token masks on a GPU (torch CUDA tensors, no paddle): the path the runner
had (a bool [B, V] row per constrained request unpacked on the host, uploaded, then a
``where`` into a new logits tensor) against the one it has now (llguidance's packed int32 words
uploaded as they are, the Triton kernel writing MASKED into the logits in place), on the same
masks in the same run, at DeepSeek-V3's vocabulary.

Bytes a step: before, B x V (bool upload) + 3 x B x V x 4 (where: read logits and mask, write
a new tensor); after, B x V / 8 (words upload) + at most B x V x 4 written (disallowed tokens
only). Host: before unpacks the words (numpy), after does nothing. Each row allows a random 10%
of the vocabulary (a JSON string position allows most tokens, a structural one a few: the
device work does not depend on it, the written bytes do).

    python benchmarks/bench_token_mask.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from common import copy_gbps, per_call_ms  # CUDA-event timing and the copy ceiling

from fastdeploy.model_executor.ops.triton_ops.token_mask_kernel import launch_apply_token_bitmask

VOCAB = 129280
MASKED = -1e30


def unpack_bitmask(words: np.ndarray, vocab: int) -> np.ndarray:
    """The host unpack the runner did (``input/grammar.py``'s, which imports llguidance: not on
    the GPU host)."""
    as_bytes = words.view(np.uint8).reshape(len(words), -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab].astype(bool)


def case(B: int, rows: int, rng) -> dict:
    logits = torch.randn(B, VOCAB, device="cuda")
    keep = rng.random((rows, VOCAB)) < 0.1
    packed = np.packbits(np.pad(keep, ((0, 0), (0, -VOCAB % 32))), axis=1, bitorder="little")
    words = packed.view(np.int32)  # llguidance's layout: bit t % 32 of word t // 32
    idx = np.sort(rng.choice(B, rows, replace=False)).astype(np.int32)
    assert (unpack_bitmask(words, VOCAB) == keep).all()

    def before():
        full = np.ones((B, VOCAB), bool)
        full[idx] = unpack_bitmask(words, VOCAB)
        mask = torch.from_numpy(full).cuda()
        return torch.where(mask, logits, torch.full_like(logits, MASKED))

    def after():
        dev_words = torch.from_numpy(words).cuda()
        dev_rows = torch.from_numpy(idx).cuda()
        launch_apply_token_bitmask(logits, dev_words, dev_rows, MASKED)
        return logits

    want = before()
    got = after().clone()
    assert torch.equal(got, want), "the kernel disagrees with the where path"
    dev_words, dev_rows = torch.from_numpy(words).cuda(), torch.from_numpy(idx).cuda()
    kernel_ms = per_call_ms(lambda: launch_apply_token_bitmask(logits, dev_words, dev_rows, MASKED))
    t = time.perf_counter()
    for _ in range(20):
        full = np.ones((B, VOCAB), bool)
        full[idx] = unpack_bitmask(words, VOCAB)
    host_unpack_ms = (time.perf_counter() - t) / 20 * 1e3
    written = int((~keep).sum()) * 4 + words.nbytes
    return {
        "B": B,
        "rows": rows,
        "before_ms": per_call_ms(before),
        "after_ms": per_call_ms(after),
        "kernel_ms": kernel_ms,
        "kernel_gbs": written / kernel_ms / 1e6,
        "host_unpack_ms_before": host_unpack_ms,
        "upload_bytes_before": B * VOCAB,
        "upload_bytes_after": words.nbytes + idx.nbytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    copy = copy_gbps(2**30, per_call_ms)
    rows = [case(B, r, rng) for B, r in ((1, 1), (32, 32), (256, 32), (256, 256))]
    print(f"device copy {copy:.0f} GB/s, vocab {VOCAB}")
    print("| B | masked rows | before ms | after ms | speedup | kernel ms | kernel GB/s | host unpack ms (before) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['B']} | {r['rows']} | {r['before_ms']:.3f} | {r['after_ms']:.3f} | "
            f"{r['before_ms'] / r['after_ms']:.1f}x | {r['kernel_ms']:.4f} | {r['kernel_gbs']:.0f} | "
            f"{r['host_unpack_ms_before']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbs": copy, "vocab": VOCAB, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
