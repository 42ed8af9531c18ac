"""Captured speculation on a CUDA GPU (torch; no paddle): what lies between a verify step's draw
and its draft passes, the host's way (before) against the draft graph's (after; docs/design.md
§4.16).

Per case, B requests verifying k drafts (T = B (k + 1) rows), a step is: a CUDA graph for the
verify step (a spin kernel of ``verify_ms``, ``bench_overlap_gpu.busy_graph``), the draw's
stand-in (an arg-max over [T, 129280] float32 logits), then
  before: the draw copied to pinned host memory with an event and waited for; the acceptance and
          ``MTPProposer.plan``'s loop in Python (next ids, rows, positions, depths); the plan
          uploaded; the draft graph (a spin of ``draft_ms``); its drafts copied back and waited for.
  after:  one graph with the acceptance (``DraftGraphs.accept``'s ops, in torch) and the draft
          spin, queued behind the draw; the draw and the out [B, k + 2] copied back once.
The acceptance ops' own device time (their graph, alone) is timed too. Wall ms a step, medians
of 50 steps after 5 warm-ups. The drafts are the verify rows' own tokens with 70% kept, so
acceptance lengths vary.

    python benchmarks/bench_spec_accept_gpu.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from bench_overlap_gpu import busy_graph  # a spin kernel's graph of a given length
from common import events_ms

VOCAB = 129280
K = 3
CASES = [(1, 14.0, 1.5), (8, 19.0, 2.0), (32, 26.0, 3.0)]  # B, verify ms, draft ms


def accept(tok, ok, req, index, draft, first, m, start, left, covered, may, B):
    """``DraftGraphs.accept`` in torch ops (int64 tensors)."""
    eq = (tok == draft).long() * ok
    zero = torch.zeros(1, dtype=torch.int64, device=tok.device)
    missed = torch.cat([zero, torch.cumsum(1 - eq, 0)])
    reached = (missed[:B] == missed[first][req]).long()
    kept = torch.cat([zero, torch.cumsum(reached * ok, 0)])
    accepted = kept[first + m + 1] - kept[first]
    next_ids = torch.where(index < accepted[req], tok, torch.zeros_like(tok))
    last = torch.clamp(accepted - 1, min=0)
    pos = start + last
    room = torch.minimum(left - accepted - 1, covered - pos)
    depth = torch.clamp(room, 0, K) * may * (accepted > 0).long()
    return next_ids, accepted, first + last, pos, depth


def plan_on_host(tok: np.ndarray, drafts: list[list[int]], start: list[int], left: list[int], covered: list[int]):
    """The host's acceptance and ``MTPProposer.plan`` for one step: next ids, rows, pos, depth."""
    next_ids, rows, pos, depth, at = [0] * len(tok), [], [], [], 0
    for b, d in enumerate(drafts):
        a = 0
        for j in range(len(d) + 1):
            a += 1
            if j == len(d) or tok[at + j] != d[j]:
                break
        next_ids[at : at + a] = tok[at : at + a].tolist()
        p = start[b] + a - 1
        dd = min(K, left[b] - a - 1, covered[b] - p)
        if dd > 0:
            rows.append(at + a - 1)
            pos.append(p)
            depth.append(dd)
        at += len(d) + 1
    return np.asarray(next_ids + rows + pos + depth, np.int32)


def case(B: int, verify_ms: float, draft_ms: float, steps: int) -> dict:
    T = B * (K + 1)
    g = torch.Generator(device="cuda").manual_seed(B)
    logits = torch.randn(T, VOCAB, device="cuda", generator=g)
    tok_host = logits.argmax(1).cpu().numpy()
    keep = np.random.default_rng(B).random(T) < 0.7
    drafts = []
    for b in range(B):
        rows = tok_host[b * (K + 1) : b * (K + 1) + K]
        drafts.append([int(t) if keep[b * (K + 1) + j] else int(t) + 1 for j, t in enumerate(rows)])
    start, left, covered = [100 * b for b in range(B)], [64] * B, [100 * b + 2 * K + 2 for b in range(B)]
    (verify, _), (draft, _) = busy_graph(verify_ms), busy_graph(draft_ms)
    dev = {
        "req": torch.arange(B, device="cuda").repeat_interleave(K + 1),
        "index": torch.arange(K + 1, device="cuda").repeat(B),
        "draft": torch.tensor([x for d in drafts for x in d + [-1]], device="cuda"),
        "first": torch.arange(B, device="cuda") * (K + 1),
        "m": torch.full((B,), K, device="cuda"),
        "start": torch.tensor(start, device="cuda"),
        "left": torch.tensor(left, device="cuda"),
        "covered": torch.tensor(covered, device="cuda"),
        "may": torch.ones(B, dtype=torch.int64, device="cuda"),
    }
    tok = torch.zeros(T, dtype=torch.int64, device="cuda")
    ok = torch.ones(T, dtype=torch.int64, device="cuda")
    args = [dev[k] for k in ("req", "index", "draft", "first", "m", "start", "left", "covered", "may")]
    plan_buf = torch.zeros(T + 3 * B, dtype=torch.int32, device="cuda")
    pinned = {n: torch.empty(n, dtype=torch.int64, pin_memory=True) for n in (T, B * (K + 2))}

    accept_graph, after_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    accept(tok, ok, *args, B=T)  # warm-up outside capture
    torch.cuda.synchronize()
    with torch.cuda.graph(accept_graph):
        accept(tok, ok, *args, B=T)
    with torch.cuda.graph(after_graph):
        _, accepted, _, _, depth = accept(tok, ok, *args, B=T)
        out = torch.cat([accepted[:, None], depth[:, None], torch.zeros(B, K, dtype=torch.int64, device="cuda")], 1)

    def draw() -> None:
        tok.copy_(logits.argmax(1))

    def before() -> None:
        verify.replay()
        draw()
        pinned[T].copy_(tok, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        ev.synchronize()
        buf = plan_on_host(pinned[T].numpy(), drafts, start, left, covered)
        plan_buf[: len(buf)].copy_(torch.from_numpy(buf))
        draft.replay()
        pinned[B * (K + 2)][: B * K].copy_(plan_buf[: B * K].long(), non_blocking=True)  # the drafts' copy
        ev = torch.cuda.Event()
        ev.record()
        ev.synchronize()

    def after() -> None:
        verify.replay()
        draw()
        after_graph.replay()
        draft.replay()
        pinned[T].copy_(tok, non_blocking=True)
        pinned[B * (K + 2)].copy_(out.reshape(-1), non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        ev.synchronize()

    def wall(fn) -> float:
        for _ in range(5):
            fn()
        ts = []
        for _ in range(steps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3

    got_before, got_after = wall(before), wall(after)
    accept_ms = events_ms(accept_graph.replay, iters=100)
    want = plan_on_host(tok.cpu().numpy(), drafts, start, left, covered)
    _, acc, rows, pos, dep = accept(tok, ok, *args, B=T)
    n = len(want) - T
    assert (dep > 0).sum().item() == n // 3, "the torch acceptance disagrees with the host's"
    return {
        "B": B,
        "k": K,
        "verify_ms": verify_ms,
        "draft_ms": draft_ms,
        "before_ms": got_before,
        "after_ms": got_after,
        "saved_ms": got_before - got_after,
        "accept_graph_us": accept_ms * 1e3,
        "mean_accepted": float(acc.float().mean().item()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    print(f"# {torch.cuda.get_device_name()}")
    print("| B | k | verify ms | draft ms | before ms | after ms | saved ms | acceptance graph us | mean accepted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B, v, d in CASES:
        r = case(B, v, d, a.steps)
        rows.append(r)
        print(
            f"| {B} | {K} | {v} | {d} | {r['before_ms']:.3f} | {r['after_ms']:.3f} | {r['saved_ms']:+.3f} | "
            f"{r['accept_graph_us']:.1f} | {r['mean_accepted']:.2f} |",
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "cases": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
