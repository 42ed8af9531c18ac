"""The device sampler on a GPU (torch CUDA tensors, no paddle): its two kernels plus the count
update, against torch's sort-based top-k / top-p sampler and the host path it replaced (copy
the logits to numpy, the numpy sampler row by row), on the same logits in the same run.

Bytes: the logits are read once by the prepare pass and the processed row is written and read
back by the select pass (cut points, compaction): >= 3 x B x V x 4 bytes a step; GB/s is
reported on that count against a device-to-device copy measured in the same run.

    python benchmarks/bench_sampler.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import copy_gbps, per_call_ms  # noqa: E402

from fastdeploy.model_executor.layers.sampler import sample  # noqa: E402
from fastdeploy.model_executor.ops.triton_ops import sampling_kernel  # noqa: E402
from fastdeploy.model_executor.ops.triton_ops.sampling_kernel import (  # noqa: E402
    CUT_DEPTHS,
    KMAX,
    launch_count,
    row_keys,
)
from fastdeploy.sampling_params import SamplingState  # noqa: E402

VOCAB = 129280  # DeepSeek-V3


def torch_sampler(logits, temp, top_k, top_p, gen):
    """Sort-based: temperature, top-k and top-p by a full sort, then an exponential race."""
    y = logits / temp
    s, idx = y.sort(dim=-1, descending=True)
    kth = s.gather(1, (top_k - 1).unsqueeze(1))
    s = s.masked_fill(s < kth, float("-inf"))
    p = s.softmax(-1)
    cut = p.cumsum(-1) - p > top_p.unsqueeze(1)
    p = p.masked_fill(cut, 0)
    q = torch.empty_like(p).exponential_(generator=gen)
    return idx.gather(1, (p / q).argmax(-1, keepdim=True)).squeeze(1)


def case(B: int, sampled: bool, penalties: bool, rng, block: int = 2048, warps: int = 4, before=None) -> dict:
    dev = "cuda"
    logits = torch.from_numpy((rng.standard_normal((B, VOCAB)) * 3).astype(np.float32)).to(dev)
    f = np.zeros((B, 8), np.float32)
    i = np.zeros((B, 4), np.int32)
    f[:, 0] = 0.8 if sampled else 0.0
    f[:, 1] = 0.9 if sampled else 1.0
    f[:, 3] = 1.1 if penalties else 1.0
    f[:, 4:6] = (0.2, 0.1) if penalties else (0.0, 0.0)
    i[:, 0] = 50 if sampled else -1
    i[:, 1] = np.arange(B) if penalties else -1
    counts = np.zeros((max(B, 1), VOCAB), np.int32)
    seen = np.zeros((max(B, 1), VOCAB), np.uint8)
    if penalties:
        for b in range(B):
            np.add.at(counts[b], rng.integers(0, VOCAB, 1000), 1)
            seen[b, rng.integers(0, VOCAB, 4000)] = 1
    t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
    args = dict(
        counts=t(counts),
        seen=t(seen),
        fparams=t(f),
        iparams=t(i),
        seeds=t(row_keys(rng.integers(0, 2**63, B, dtype=np.uint64), np.zeros(B, np.uint64))),
        bias_ids=torch.full((B, 1), -1, dtype=torch.int32, device=dev),
        bias_vals=torch.zeros((B, 1), dtype=torch.float32, device=dev),
        depths=torch.tensor(CUT_DEPTHS, dtype=torch.float32, device=dev),
        work=torch.empty((B, VOCAB), dtype=torch.float32, device=dev),
        stats=torch.empty((B, 4), dtype=torch.float32, device=dev),
        argmax=torch.empty(B, dtype=torch.int32, device=dev),
        scratch_y=torch.empty((B, KMAX), dtype=torch.float32, device=dev),
        scratch_id=torch.empty((B, KMAX), dtype=torch.int32, device=dev),
        tokens=torch.empty(B, dtype=torch.int32, device=dev),
        logprobs=torch.empty(B, dtype=torch.float32, device=dev),
    )

    C = sampling_kernel.num_chunks(B, VOCAB, block)
    part = torch.empty((B, C, 8), dtype=torch.float32, device=dev)
    cuts = torch.empty((B, C, 34), dtype=torch.float32, device=dev)
    names = ["work", "counts", "seen", "fparams", "iparams", "seeds", "bias_ids", "bias_vals", "depths"]
    names += ["stats", "argmax", "scratch_y", "scratch_id", "tokens", "logprobs"]

    def run(mod):
        extra = (part, cuts) if hasattr(mod, "num_chunks") else ()
        mod.launch_sample(logits, *(args[k] for k in names), *extra, block=block, num_warps=warps)
        if penalties:
            launch_count(args["tokens"], args["iparams"], args["counts"])

    def ours():
        run(sampling_kernel)

    ours_ms = per_call_ms(ours)
    ours()  # the same launches captured: GPU time without the eager launch cost
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            ours()
    graph_ms = per_call_ms(graph.replay, iters=20) / 10
    del graph
    before_ms = per_call_ms(lambda: run(before)) if before is not None else float("nan")
    # correctness on the device: greedy = arg-max; sampled tokens inside torch's top-50 / top-0.9 set
    args["counts"].zero_()
    ours()
    tok = args["tokens"].long()
    if not sampled:
        ok = bool((tok == logits.argmax(-1)).all()) if not penalties else True
    else:
        y = logits / 0.8
        s, idx = y.sort(dim=-1, descending=True)
        p = s[:, :50].softmax(-1)
        keep_n = ((p.cumsum(-1) - p) < 0.9).sum(-1)
        rank = (idx == tok.unsqueeze(1)).float().argmax(-1)
        ok = bool((rank < keep_n).all()) if not penalties else True
    gen = torch.Generator(device=dev).manual_seed(0)
    temp = torch.full((B, 1), 0.8, device=dev)
    tk = torch.full((B,), 50, device=dev, dtype=torch.long)
    tp = torch.full((B,), 0.9, device=dev)
    torch_ms = (
        per_call_ms(lambda: torch_sampler(logits, temp, tk, tp, gen))
        if sampled
        else per_call_ms(lambda: logits.argmax(-1))
    )
    states = [
        SamplingState(
            temperature=float(f[0, 0]),
            top_p=float(f[0, 1]),
            top_k=int(i[0, 0]),
            repetition_penalty=float(f[0, 3]),
            presence_penalty=float(f[0, 4]),
            frequency_penalty=float(f[0, 5]),
            rng=np.random.default_rng(0),
        )
        for _ in range(B)
    ]
    hist = [(list(range(100)), list(range(50)))] * B
    t0 = time.perf_counter()
    host = logits.cpu().numpy()
    sample(host, states, hist)
    host_ms = (time.perf_counter() - t0) * 1e3
    nbytes = 3 * B * VOCAB * 4
    return {
        "B": B,
        "sampled": sampled,
        "penalties": penalties,
        "ours_ms": ours_ms,
        "ours_graph_ms": graph_ms,
        "before_ms": before_ms,
        "ours_GBs": nbytes / ours_ms / 1e6,
        "torch_ms": torch_ms,
        "host_numpy_ms": host_ms,
        "checked": ok,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--before", default=None, help="a file with an earlier sampling_kernel.py, timed beside")
    ap.add_argument("--sweep", action="store_true", help="time launch tiles (block x warps) at B 1 / 256")
    ap.add_argument("--profile", action="store_true", help="per-kernel times at B 256, sampled with penalties")
    ap.add_argument("--programs-sweep", action="store_true", help="graph ms by programs a pass aims for, and block")
    a = ap.parse_args()
    if a.programs_sweep:
        rows = []
        for programs in (512, 1024, 2048, 4096):
            sampling_kernel.SAMPLER_PROGRAMS = programs
            for block in (1024, 2048):
                row = {"programs": programs, "block": block}
                for B, sampled, pen in ((1, True, True), (32, True, True), (256, True, True), (256, False, False)):
                    r = case(B, sampled, pen, np.random.default_rng(0), block)
                    row[f"B{B}_{'pen' if pen else 'greedy'}_graph_ms"] = r["ours_graph_ms"]
                    row[f"B{B}_{'pen' if pen else 'greedy'}_ok"] = r["checked"]
                rows.append(row)
                print(json.dumps(row), flush=True)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(rows, fh, indent=1)
        return
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            case(256, True, True, np.random.default_rng(0))
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=40))
        return
    if a.sweep:
        for block in (512, 1024, 2048, 4096):
            for warps in (4, 8, 16):
                r1 = case(1, True, False, np.random.default_rng(0), block, warps)
                r2 = case(256, True, True, np.random.default_rng(0), block, warps)
                print(f"block {block} warps {warps}: B=1 {r1['ours_ms']:.3f} ms, B=256 {r2['ours_ms']:.3f} ms")
        return
    rng = np.random.default_rng(0)
    before = None
    if a.before:
        import importlib.util

        spec = importlib.util.spec_from_file_location("sampling_kernel_before", a.before)
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
    ceiling = copy_gbps(2**30, per_call_ms)
    rows = []
    print(f"device copy: {ceiling:.0f} GB/s")
    print(
        "| B | sampled | penalties | ours ms | ours graph ms | ours GB/s (3 passes) | before ms | torch sort ms | "
        "host numpy ms | ok |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for B in (1, 32, 256):
        for sampled, pen in ((False, False), (True, False), (True, True)):
            r = case(B, sampled, pen, rng, before=before)
            rows.append(r)
            print(
                f"| {B} | {sampled} | {pen} | {r['ours_ms']:.3f} | {r['ours_graph_ms']:.3f} | {r['ours_GBs']:.0f} | "
                f"{r['before_ms']:.3f} | "
                f"{r['torch_ms']:.3f} | "
                f"{r['host_numpy_ms']:.1f} | {r['checked']} |"
            )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"copy_GBs": ceiling, "cases": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
