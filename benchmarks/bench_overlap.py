"""The whole decode loop on CPU with the device replaced by a stand-in of a given length: time a
step with the overlapped loop (``async_scheduling``) on and off (docs/design.md §4.18).

The stand-in is a device clock. The model's forward "launches" ``device_ms`` of work (returns at
once; that work ends ``device_ms`` past the later of now and the end of the work before it), and
the copy-back of the step's draw, its one sync point, waits until its forward's work has ended. Everything else the
engine does is real: scheduling, step inputs, ForwardMeta, the sampler's host side, output
processing, detokenization, stop checks. The logits and the sampled tokens are preallocated
(``bench_host_step``'s stand-ins), so a step's host work is what it is at DeepSeek-V3's
vocabulary. Host work is measured with a zero-length stand-in (in order); the device lengths
default to the H200 run's projected TP-8 decode steps at 4K (13.3 / 24.4 / 72.9 ms at batch 1 /
32 / 256). The target: with overlap, a step takes max(host, device) + at most 0.3 ms; in order
it takes their sum.

    python benchmarks/bench_overlap.py [--requests 1 32 256] [--device-ms 13.3 24.4 72.9] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import paddle

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_host_step import VOCAB, StandInModel, decode_ms, stand_in_sampler  # noqa: E402

from fastdeploy.engine.args import EngineArgs  # noqa: E402
from fastdeploy.engine.engine import LLMEngine  # noqa: E402
from fastdeploy.sampling_params import SamplingParams  # noqa: E402
from fastdeploy.tools.make_tiny_model import make_tiny_model  # noqa: E402

PROJECTED_MS = {1: 13.3, 32: 24.4, 256: 72.9}  # the H200 run's TP-8 decode step at 4K, by batch


class DeviceClock:
    """A device that runs launched work in order: ``launch`` queues ``ms`` of it (``last_end``:
    when that work is done), ``wait_until`` blocks (sleeping, so the host's other work is not
    held) until a given end."""

    def __init__(self, ms: float) -> None:
        self.s, self.busy_until, self.last_end = ms / 1e3, 0.0, 0.0

    def launch(self) -> None:
        self.busy_until = self.last_end = max(time.perf_counter(), self.busy_until) + self.s

    @staticmethod
    def wait_until(end: float) -> None:
        left = end - time.perf_counter()
        if left > 0:
            time.sleep(left)


class TimedModel(StandInModel):
    """``StandInModel`` whose forward launches the clock's step."""

    def __init__(self, real, logits: paddle.Tensor, clock: DeviceClock) -> None:
        super().__init__(real, logits)
        self.clock = clock

    def __call__(self, meta, caches):
        self.clock.launch()
        return None


def timed_sampler(runner, max_rows: int, clock: DeviceClock) -> None:
    """The device sampler's op returns preallocated results at once; the copy-back of a draw
    (``collect``, the step's sync point) waits until the forward launched before it is done."""
    stand_in_sampler(runner, max_rows)
    sampler, ready = runner.sampler, {}
    draw, collect = sampler.draw, sampler.collect

    def timed_draw(logits, batch):
        drawn = draw(logits, batch)
        ready[id(drawn)] = clock.last_end
        return drawn

    def timed_collect(drawn):
        clock.wait_until(ready.pop(id(drawn)))
        return collect(drawn)

    sampler.draw, sampler.collect = timed_draw, timed_collect


def bench_engine(model_dir: str, n: int, overlap: bool, **kw) -> LLMEngine:
    """An engine for n decoding requests of the benchmark's prompts; ``kw``: more engine args."""
    args = dict(max_num_seqs=n, max_num_batched_tokens=max(2048, 64 * n), max_model_len=2048)
    return LLMEngine(EngineArgs(model=model_dir, async_scheduling=overlap, **args, **kw))


def run_case(model_dir: str, n: int, device_ms: float, overlap: bool, steps: int) -> float:
    """Median ms of a decode step of n requests (all decoding), the stand-in ``device_ms`` long."""
    engine = bench_engine(model_dir, n, overlap)
    runner, clock = engine.runner, DeviceClock(device_ms)
    logits = paddle.to_tensor(np.random.default_rng(0).standard_normal((n, VOCAB)).astype(np.float32))
    runner.model = TimedModel(runner.model, logits, clock)
    timed_sampler(runner, n, clock)
    sp = SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=50)
    return decode_ms(engine, n, sp, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--device-ms", type=float, nargs="+", default=None, help="one per --requests entry")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    device = a.device_ms or [PROJECTED_MS.get(n, 20.0) for n in a.requests]
    paddle.set_device("cpu")
    model_dir = make_tiny_model(os.path.join(tempfile.gettempdir(), "fd-bench-overlap"))
    rows = []
    print("| requests | host ms | stand-in ms | in turn ms | overlapped ms | overlapped - max(host, stand-in) |")
    print("|---|---|---|---|---|---|")
    for n, d in zip(a.requests, device, strict=True):
        host = run_case(model_dir, n, 0.0, False, a.steps)
        sync = run_case(model_dir, n, d, False, a.steps)
        over = run_case(model_dir, n, d, True, a.steps)
        rows.append({"requests": n, "host_ms": host, "device_ms": d, "in_turn_ms": sync, "overlapped_ms": over})
        print(f"| {n} | {host:.2f} | {d:.1f} | {sync:.2f} | {over:.2f} | {over - max(host, d):+.2f} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"vocab": VOCAB, "cases": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
