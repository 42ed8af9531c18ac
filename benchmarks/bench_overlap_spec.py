"""The speculating decode loop on CPU with the device replaced by a clock: captured verify steps
in turn against verify steps chained behind the running one (docs/design.md §4.18).

The clock (``bench_overlap.DeviceClock``) stands for the device: a captured verify step's replay
queues ``verify_ms`` of work, its draft graph's replay ``draft_ms``, and every copy back
(``HostCopy.wait``) waits until the device work queued before the copy is done. Everything else
is the engine's own: scheduling, step inputs, the staging copies, the draw's packing, the draft
staging, the chain's device ops (on CPU paddle runs them at once, so here they count as host work;
on a GPU they are queued kernels: an upper bound), taking the outputs, detokenization. The stand-in
sampler draws token 100 on every row and the draft graph proposes it, so every draft is accepted
(k + 1 tokens a step). Host work is the in-turn loop with both lengths 0. The device lengths
default to the H100 projection of a TP-8 verify step at 4K with k = 3 (benchmarks/README.md
"Verify steps (MTP) as graph replays": 16.5 ms at batch 1, of which ~1.2 ms the draft passes;
56 ms at batch 32, ~3 ms of them). Target (issue 42): chained, a step takes max(host, device)
plus at most 0.3 ms; in turn, their sum.

    python benchmarks/bench_overlap_spec.py [--requests 1 32] [--k 3] [--json OUT]
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

from bench_host_step import TOKEN, VOCAB, StandInModel, decode_ms, stand_in_sampler  # noqa: E402
from bench_overlap import DeviceClock, bench_engine  # noqa: E402

from fastdeploy.model_executor.layers.device_sampler import HostCopy  # noqa: E402
from fastdeploy.sampling_params import SamplingParams  # noqa: E402
from fastdeploy.tools.make_tiny_model import make_tiny_model  # noqa: E402

PROJECTED_MS = {1: (15.3, 1.2), 32: (53.0, 3.0)}  # verify ms, draft ms (H100 projection, k = 3)


def timed_copies(clock: DeviceClock) -> None:
    """A copy back waits for the device work queued before it was made."""

    def init(self, tensors):
        self.event, self.tensors, self.ready = None, tensors, clock.last_end

    def wait(self):
        clock.wait_until(self.ready)
        return [t.numpy() for t in self.tensors]

    HostCopy.__init__, HostCopy.wait = init, wait


def run_case(model_dir: str, n: int, k: int, verify_ms: float, draft_ms: float, chained: bool, steps: int) -> float:
    """Median ms of a verify step of n requests, k drafts each, all accepted."""
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": k})
    engine = bench_engine(
        model_dir, n, chained, cuda_graph_capture=True, cuda_graph_batch_sizes=str(n), speculative_config=spec
    )
    runner, rows = engine.runner, n * (k + 1)
    graphs, drafts = runner.graphs, runner.spec.graphs
    clock = DeviceClock(0.0)
    timed_copies(clock)
    runner.model = StandInModel(runner.model, paddle.zeros([rows, VOCAB], "float32"))
    stand_in_sampler(runner, rows)
    hidden = paddle.zeros([max(graphs.buckets), runner.fd.model_config.hidden_size], "float32")
    logits = paddle.zeros([max(graphs.buckets), VOCAB], "float32")
    metas = {}

    def body(B):  # the replay: its ForwardMeta made once a bucket, as the graph keeps it
        if B not in metas:
            ids, pos = graphs.staging[:B].astype("int64"), graphs.staging[B : 2 * B].astype("int64")
            tables = dict(zip(graphs.null_block, graphs.table_views(B), strict=True))
            metas[B] = graphs.builder.build_decode(ids, pos, tables, graphs.max_model_len)
        clock.s = verify_ms / 1e3
        clock.launch()
        return metas[B], hidden[:B], logits[:B]

    def draft_body(B, meta, hidden):  # every draft verified accepted, the next k the sampler's token
        clock.s = draft_ms / 1e3
        clock.launch()
        R = drafts.requests[B]
        verified = drafts.staging[drafts.slot(B, "drafts")].astype("int64").unsqueeze(1)
        rest = paddle.to_tensor(np.concatenate([np.full((R, 1), k), np.full((R, k), TOKEN)], 1).astype(np.int64))
        return paddle.concat([verified + 1, rest], 1)

    graphs.body, drafts.body = body, draft_body
    runner.spec.draft = lambda msg, cache, builder: np.full((len(msg.rows), k), TOKEN, np.int64)  # after prefill
    sp = SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=50)
    ms = decode_ms(engine, n, sp, steps)
    assert not chained or engine.num_chained_steps >= steps, engine.num_chained_steps
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    paddle.set_device("cpu")
    model_dir = make_tiny_model(os.path.join(tempfile.gettempdir(), "fd-bench-overlap-spec"), first_k_dense=0, mtp=True)
    rows = []
    print("| requests | k | host ms | device ms (verify + drafts) | in turn ms | chained ms | chained - max |")
    print("|---|---|---|---|---|---|---|")
    for n in a.requests:
        v, d = PROJECTED_MS.get(n, (20.0, 2.0))
        host = run_case(model_dir, n, a.k, 0.0, 0.0, False, a.steps)
        turn = run_case(model_dir, n, a.k, v, d, False, a.steps)
        chain = run_case(model_dir, n, a.k, v, d, True, a.steps)
        dev = v + d
        rows.append(
            {"requests": n, "k": a.k, "host_ms": host, "device_ms": dev, "in_turn_ms": turn, "chained_ms": chain}
        )
        print(f"| {n} | {a.k} | {host:.2f} | {dev:.1f} | {turn:.2f} | {chain:.2f} | {chain - max(host, dev):+.2f} |")
        time.sleep(0.1)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"vocab": VOCAB, "cases": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
