"""The engine's host work per decode step (CPU): scheduler, step inputs, ForwardMeta builder,
the sampler's host side, output processing, detokenization and stop checks, with the model's
forward and the sampler's device compute replaced by stand-ins that return at once.

The stand-in model returns preallocated logits of DeepSeek-V3's vocabulary (129280); on a
checkout whose runner has a device sampler, its device op (``sample_tokens``) is replaced by a
stand-in returning preallocated results, so what is timed is what the host does around it. On
older checkouts (the numpy sampler) the whole host sampler is timed, as it ran.

    python benchmarks/bench_host_step.py --requests 1 32 256 [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import paddle

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fastdeploy.engine.args import EngineArgs  # noqa: E402
from fastdeploy.engine.engine import LLMEngine  # noqa: E402
from fastdeploy.sampling_params import SamplingParams  # noqa: E402
from fastdeploy.tools.make_tiny_model import make_tiny_model  # noqa: E402

VOCAB = 129280
TOKEN = 100  # what the stand-in sampler draws (a token the tiny tokenizer decodes)


class StandInModel:
    """Returns at once: no hidden states, preallocated logits rows."""

    def __init__(self, real, logits: paddle.Tensor) -> None:
        self.real, self.logits = real, logits

    def __call__(self, meta, caches):
        return None

    def compute_logits(self, hidden, rows):
        return self.logits[: rows.shape[0]]

    def __getattr__(self, name):
        return getattr(self.real, name)


def stand_in_sampler(runner, max_rows: int) -> None:
    """Replace the device sampler's op with one returning preallocated results."""
    from fastdeploy.model_executor.layers import device_sampler
    from fastdeploy.model_executor.ops.triton_ops.sampling import Sampled

    out = Sampled(
        paddle.full([max_rows], TOKEN, "int32"),
        paddle.zeros([max_rows], "float32"),
        paddle.zeros([max_rows], "float32"),
        paddle.zeros([max_rows], "bool"),
    )

    class Op:
        @staticmethod
        def sample_tokens(logits, *args, **kw):
            n = logits.shape[0]
            return Sampled(*(t[:n] for t in out))

        row_keys = staticmethod(device_sampler.sampling.row_keys)

    device_sampler.sampling = Op
    runner.sampler.vocab_size = VOCAB


def decode_ms(engine: LLMEngine, n: int, sp: SamplingParams, steps: int) -> float:
    """Median ms of ``engine.step()`` over ``steps`` steady decode steps of n requests (prompts of
    64 tokens; the overlapped loop's steady state has one step in flight); shuts the engine down."""
    for i in range(n):
        engine.add_request([5 + i % 50] * 64, sp)
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        assert len(outs) == n, (len(outs), n)
    engine.shutdown()
    return statistics.median(times) * 1e3


def run_case(model_dir: str, n: int, sampled: bool, steps: int) -> float:
    engine = LLMEngine(
        EngineArgs(model=model_dir, max_num_seqs=n, max_num_batched_tokens=max(2048, 64 * n), max_model_len=2048)
    )
    runner = engine.runner
    logits = paddle.to_tensor(np.random.default_rng(0).standard_normal((n, VOCAB)).astype(np.float32))
    runner.model = StandInModel(runner.model, logits)
    if hasattr(runner, "sampler"):
        stand_in_sampler(runner, n)
    kw = dict(temperature=0.8, top_p=0.9, top_k=50) if sampled else dict(temperature=0.0)
    return decode_ms(engine, n, SamplingParams(max_tokens=10_000, ignore_eos=True, **kw), steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    paddle.set_device("cpu")
    model_dir = make_tiny_model(os.path.join(tempfile.gettempdir(), "fd-bench-host-step"))
    rows = []
    print("| requests | sampling | host ms / decode step |")
    print("|---|---|---|")
    for n in a.requests:
        for sampled in (False, True):
            ms = run_case(model_dir, n, sampled, a.steps)
            rows.append({"requests": n, "sampled": sampled, "host_ms": ms})
            print(f"| {n} | {'T 0.8, top_p 0.9, top_k 50' if sampled else 'greedy'} | {ms:.2f} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"vocab": VOCAB, "cases": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
