"""The data-parallel front and an engine core's loop, in this process (docs/design.md §4.19): a
core served over a pipe by its real loop, and the front over two replica cores against one
engine. The multi-process cases (expert parallelism, faults, the launcher) are in
tests/distributed/test_data_parallel.py."""

import threading

import numpy as np

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.dp_core import serve
from fastdeploy.engine.dp_messages import CoreRequest
from fastdeploy.request import Request

KW = dict(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=64, max_model_len=256)
W = 32


def close(a: list[dict], b: list[dict]) -> None:
    """Per position the same tokens, logprobs within 1e-4 (the batch shapes differ)."""
    assert [x.keys() for x in a] == [y.keys() for y in b]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(list(x.values()), [y[k] for k in x], atol=1e-4)


def test_a_core_serves_its_front_over_a_pipe(rng):
    """dp_core.serve on a pipe: hello and ready, then each step's deltas, applied to the front's
    copies, rebuild one engine's tokens, text and logprobs; a duplicate id is refused with a
    "failed" message, an abort ends a request, stop ends the loop."""
    from multiprocessing import Pipe

    one = LLM(**KW)
    engine = LLM(**KW).engine
    front, core = Pipe()
    sp = SamplingParams(max_tokens=2 * W, temperature=0, logprobs=2, ignore_eos=True, prompt_logprobs=1)
    prompts = [[int(x) for x in rng.integers(2, 500, n)] for n in (2 * W + 16 + 3, 9)]
    copies = {}
    for i, p in enumerate(prompts + [prompts[1]]):
        rid = f"r{min(i, 1)}"  # the third reuses the second's id
        copies.setdefault(rid, Request(rid, p, sp))
        front.send(("add", CoreRequest(rid, p, sp, None, 0.0, None, None)))
    long = [int(x) for x in rng.integers(2, 500, 20)]
    front.send(("add", CoreRequest("gone", long, sp, None, 0.0, None, None)))
    front.send(("abort", "gone"))
    loop = threading.Thread(target=serve, args=(engine, core), daemon=True)  # takes the queued messages at once
    loop.start()
    assert front.recv() == ("hello", 0) and front.recv()[0] == "ready"
    failed, finished = [], set()
    while len(finished) < 2:
        msg = front.recv()
        if msg[0] == "failed":
            failed.append(msg)
            continue
        _, outs, stats = msg
        assert stats["num_requests_running"] + stats["num_requests_waiting"] <= 3
        for co in outs:
            assert co.request_id != "gone"
            co.apply(copies[co.request_id])
            if co.finished:
                finished.add(co.request_id)
    front.send(("stop",))
    loop.join(timeout=30)
    assert not loop.is_alive()
    assert [(f[1], "already in use" in f[2]) for f in failed] == [("r1", True)]
    want = one.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for w, rid in zip(want, ("r0", "r1"), strict=True):
        got = copies[rid]
        assert got.output_token_ids == w.outputs[0].token_ids and got.output_text == w.outputs[0].text
        assert got.finish_reason == "length" and got.is_finished
        for a, b in zip(got.output_logprobs, w.outputs[0].logprobs, strict=True):
            np.testing.assert_allclose(list(a.values()), list(b.values()), atol=1e-4)  # batch shapes differ
        close(got.prompt_logprobs[1:], w.prompt_logprobs[1:])
    assert {g: p.num_used for g, p in engine.block_manager.pools.items()} == {"full": 0, "swa": 0}


def test_the_front_over_two_replica_cores_gives_one_engines_outputs(rng):
    """DPEngine in this process over two replica cores (processes of their own): n = 2 seeded
    samples with top and prompt logprobs equal one engine's; the samples of a prompt stay on one
    core; an abort ends a request once; each core's counts come labelled; shutdown leaves no
    process."""
    one = LLM(**KW)
    dp = LLM(**KW, data_parallel_size=2)
    front = dp.engine
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=5, n=2, logprobs=2, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": [int(x) for x in rng.integers(2, 500, n)]} for n in (2 * W + 5, 20, 41)]
    got, want = dp.generate(prompts, sp), one.generate(prompts, sp)
    for g, w in zip(got, want, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.text for c in g.outputs] == [c.text for c in w.outputs]
        close(g.prompt_logprobs[1:], w.prompt_logprobs[1:])
    generated = [s["generation_tokens"] for _, s in front.rank_stats()]
    assert sorted(generated) == [24, 48] and [labels for labels, _ in front.rank_stats()] == [
        {"dp_rank": "0"},
        {"dp_rank": "1"},
    ]
    req = front.make_request([5] * 30, SamplingParams(max_tokens=200, ignore_eos=True), "long")
    front.enqueue(req)
    front.step()
    assert front.abort_request("long") and not front.abort_request("long")
    assert not front.has_unfinished_requests() and req.finish_reason == "abort"
    procs = list(front.procs)
    front.shutdown()
    assert all(p.poll() is not None for p in procs)
