"""The overlapped loop's device side on a CUDA GPU (torch; no paddle): a step in turn against a
step launched behind the running one, with the engine's order of operations (docs/design.md
§4.18), at the host and device times of the CPU stand-in table.

A step's device work is a CUDA graph of a spin kernel sized to ``device_ms`` (the projected TP-8
decode step of the last H200 run; GEMMs would be stretched by the power limit over a long run),
then the draw's stand-in (an arg-max over [B, 129280] float32 logits) and, launched behind a
running step, the placeholder fill: the previous draw's tokens gathered by row and scattered into
the step's input ids, as ``GPUModelRunner.launch`` does. The host's work a step is a spin of
``host_ms`` (what ``bench_overlap.py`` measured on CPU). Each step's tokens are copied to pinned
host memory right behind its draw, with an event (a blocking copy taken after step N+1 is queued
would wait for N+1 too). In turn: wait for the step's event, host work, launch the next.
Overlapped: launch step N+1, wait for step N's event, host work; so the host work of one step
runs while the next computes. Also timed alone: the fill's device time.

    python benchmarks/bench_overlap_gpu.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

VOCAB = 129280
CASES = [(1, 13.3, 1.13), (32, 24.4, 1.77), (256, 72.9, 5.72)]  # B, device ms, host ms


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def busy_graph(device_ms: float) -> tuple[torch.cuda.CUDAGraph, float]:
    """A graph of one ``torch.cuda._sleep`` kernel (the GPU spins for a count of cycles: a fixed
    device time that no clock or power limit stretches) of about device_ms; and its measured ms."""

    def timed(cycles: int) -> tuple[torch.cuda.CUDAGraph, float]:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch.cuda._sleep(cycles)
        g.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(5):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        return g, e0.elapsed_time(e1) / 5

    _, one = timed(10_000_000)
    return timed(int(10_000_000 * device_ms / one))


class Step:
    """One engine step's device work for B rows: fill (behind a running step), replay, draw."""

    def __init__(self, B: int, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.B = graph, B
        self.logits = torch.randn(B, VOCAB, device="cuda")
        self.ids = torch.zeros(B, dtype=torch.int64, device="cuda")
        self.at = torch.arange(B, device="cuda")  # every row a placeholder: steady decode
        self.src = torch.arange(B, device="cuda")
        self.pinned = [torch.empty(B, dtype=torch.int64, pin_memory=True) for _ in range(2)]  # double-buffered
        self.n = 0

    def fill(self, prev: torch.Tensor) -> None:
        known = torch.cat([prev, torch.zeros(1, dtype=torch.int64, device="cuda")])
        self.ids.scatter_(0, self.at, known.gather(0, self.src))

    def launch(self, prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
        """Queue the step; its tokens' copy to pinned host memory is queued right behind the draw,
        before any later step's work, with its own event."""
        if prev is not None:
            self.fill(prev)
        self.graph.replay()
        tokens = self.logits.argmax(1)
        host = self.pinned[self.n % 2]
        self.n += 1
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return tokens, host, done

    @staticmethod
    def take(tokens: torch.Tensor, host: torch.Tensor, done: torch.cuda.Event) -> list[int]:
        done.synchronize()
        return host.tolist()


def run(B: int, device_ms: float, host_ms: float, steps: int) -> dict:
    graph, replay_ms = busy_graph(device_ms)
    step = Step(B, graph)
    times = {}
    for mode in ("in_turn", "overlapped"):
        torch.cuda.synchronize()
        per = []
        running = step.launch(None)
        for _ in range(steps + 3):
            t = time.perf_counter()
            if mode == "in_turn":
                step.take(*running)
                spin(host_ms)
                running = step.launch(running[0])
            else:
                behind = step.launch(running[0])
                step.take(*running)
                spin(host_ms)
                running = behind
            per.append((time.perf_counter() - t) * 1e3)
        step.take(*running)
        times[mode] = statistics.median(per[3:])
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    prev = torch.zeros(B, dtype=torch.int64, device="cuda")
    for _ in range(10):
        step.fill(prev)
    e0.record()
    for _ in range(100):
        step.fill(prev)
    e1.record()
    torch.cuda.synchronize()
    return {
        "requests": B,
        "device_ms": replay_ms,
        "host_ms": host_ms,
        "in_turn_ms": times["in_turn"],
        "overlapped_ms": times["overlapped"],
        "fill_us": e0.elapsed_time(e1) / 100 * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = [run(B, d, h, a.steps) for B, d, h in CASES]
    print(torch.cuda.get_device_name())
    print("| requests | device ms (graph) | host ms | in turn ms | overlapped ms | overlapped - max | fill us |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        over = r["overlapped_ms"] - max(r["device_ms"], r["host_ms"])
        print(
            f"| {r['requests']} | {r['device_ms']:.2f} | {r['host_ms']:.2f} | {r['in_turn_ms']:.2f} | "
            f"{r['overlapped_ms']:.2f} | {over:+.2f} | {r['fill_us']:.1f} |"
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "cases": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
