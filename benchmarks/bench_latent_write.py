"""A full layer's latent cache write in a decode step, before and after its static shape (issue
37): ``MLAAttentionBackend.write_cache`` on a bf16 latent cache used to keep the rows whose slot
is >= 0 (``nonzero``: the count on the host, a stream sync, and no CUDA graph), and now writes
every row, slot -1 rows into the null block's slot. The GPU host has no paddle, so both forms
run as their torch equivalents (the same ops: compare, nonzero, two gathers and an index write;
against compare, where and an index write) on CUDA tensors, eagerly and, for the new form, as a
graph replay.

Bytes: T rows of 576 bf16 values read and written (2 * T * 1152) plus the int32 slots; the floor
is that over the copy bandwidth measured in the same run. At decode sizes the launches dominate.

    python benchmarks/bench_latent_write.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from common import bench_ms, copy_gbps

BLOCKS, BLOCK = 4097, 64  # 4096 blocks of 64 tokens and the null block, the last


def old_form(cache, rows, slots):
    keep = torch.nonzero(slots >= 0).flatten()
    cache.view(-1, 576)[slots.long()[keep]] = rows[keep]


def new_form(cache, rows, slots):
    flat = cache.view(-1, 576)
    flat[torch.where(slots >= 0, slots, flat.shape[0] - 1).long()] = rows


def bench(fn) -> float:
    """Median milliseconds of fn (events, after a warm-up)."""
    return bench_ms(fn, rep=300, warmup=50, mode="median")


def check(T: int) -> None:
    """Both forms write the same real slots, fresh random rows, some slots -1."""
    g = torch.Generator(device="cuda").manual_seed(T)
    rows = torch.randn(T, 576, device="cuda", generator=g).bfloat16()
    slots = torch.randperm((BLOCKS - 1) * BLOCK, device="cuda", generator=g)[:T].int()
    slots[::5] = -1
    a = torch.full((BLOCKS, BLOCK, 1, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    b = a.clone()
    old_form(a, rows, slots)
    new_form(b, rows, slots)
    real = (BLOCKS - 1) * BLOCK
    assert torch.equal(a.view(-1, 576)[:real].nan_to_num(7.0), b.view(-1, 576)[:real].nan_to_num(7.0))
    ok = slots >= 0
    assert torch.equal(b.view(-1, 576)[slots[ok].long()], rows[ok])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ceiling = copy_gbps(2**30, bench)
    cache = torch.empty((BLOCKS, BLOCK, 1, 576), dtype=torch.bfloat16, device="cuda").normal_()
    table = []
    for T in (1, 8, 32, 128, 256):
        check(T)
        rows = torch.randn(T, 576, device="cuda").bfloat16()
        slots = torch.randperm((BLOCKS - 1) * BLOCK, device="cuda")[:T].int()
        old = bench(lambda r=rows, s=slots: old_form(cache, r, s))
        new = bench(lambda r=rows, s=slots: new_form(cache, r, s))
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            new_form(cache, rows, slots)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            new_form(cache, rows, slots)
        replay = bench(graph.replay)
        nbytes = 2 * T * 1152 + 4 * T
        table.append(
            {
                "T": T,
                "old_us": old * 1e3,
                "new_us": new * 1e3,
                "new_graph_us": replay * 1e3,
                "floor_us": nbytes / (ceiling * 1e3),
                "new_graph_GBps": nbytes / (replay * 1e6),
            }
        )
    print(f"device {torch.cuda.get_device_name()}; copy ceiling {ceiling:.0f} GB/s")
    print("   T  old (nonzero) us  new (static) us  new as graph us  floor us")
    for r in table:
        print(f"{r['T']:4d}  {r['old_us']:16.1f}  {r['new_us']:15.1f}  {r['new_graph_us']:15.1f}  {r['floor_us']:8.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": ceiling, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
