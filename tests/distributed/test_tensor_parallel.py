"""Tensor parallelism on CPU over gloo: TP 2 and 4 against TP 1, sharded loading, a dying rank.
Every multi-process test is bounded in time and leaves no process behind."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from fastdeploy import LLM
from fastdeploy.config import FDConfig, ModelConfig
from fastdeploy.distributed.parallel import TPGroup
from fastdeploy.model_executor.load_weight_utils import load_weights
from fastdeploy.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
from fastdeploy.model_executor.safetensors_io import SafeTensorsFile

KW = dict(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=64, max_model_len=256)


RUN = """
import json, sys
from fastdeploy import LLM, SamplingParams
a = json.loads(sys.argv[1])
llm = LLM(tensor_parallel_size=a["tp"], **a["engine"])
outs = [o for ps in a["batches"] for o in llm.generate(ps, SamplingParams(**a["sampling"]))]
lps = lambda es: [None if e is None else {str(k): v for k, v in e.items()} for e in es or []]
rows = [[c.token_ids, lps(c.logprobs), o.num_cached_tokens, lps(o.prompt_logprobs)] for o in outs for c in o.outputs]
print("RESULT " + json.dumps(rows))
print("REPLAYS " + str(llm.engine.runner.graphs.replays if llm.engine.runner.graphs else 0))
print("ACCEPTED " + str(llm.engine.spec.num_accepted_tokens) + " " + str(llm.engine.num_chained_steps))
"""


def run(tp: int, batches, sampling: dict, replays: list | None = None, accepted: list | None = None, **kw) -> list:
    """(token ids, logprobs, cached tokens) of each batch's outputs in turn, on one engine in a
    process of its own (a process sets up paddle.distributed once); ``replays`` gets the number
    of decode steps the driver ran captured, ``accepted`` the drafts it accepted."""
    arg = json.dumps({"tp": tp, "engine": {**KW, **kw}, "batches": batches, "sampling": sampling})
    p = subprocess.run([sys.executable, "-c", RUN, arg], capture_output=True, text=True, timeout=300)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stderr[-3000:]
    if replays is not None:
        replays += [int(x.split()[1]) for x in p.stdout.splitlines() if x.startswith("REPLAYS ")]
    if accepted is not None:
        accepted += [tuple(map(int, x.split()[1:])) for x in p.stdout.splitlines() if x.startswith("ACCEPTED ")]
    return json.loads(line[0][len("RESULT ") :])


# An all-reduce sums partial products in another order than one rank's matmul: an ulp that moves
# an SWA layer's latent across an e4m3 rounding boundary moves that cached value by up to 1/16 of
# its tile scale, and the logits of later positions by ~1e-4 (tests/models/test_swa.py measures the
# same effect for batch shapes). Most steps stay within 1e-5.
TYPICAL, WORST = 1e-5, 1e-3


def assert_same(a, b) -> list[float]:
    """Identical tokens; the relative error of each step's top logprobs (the ones both report):
    median within TYPICAL, every one within WORST. Returns the errors."""
    errs = []
    for (ta, lpa, *_), (tb, lpb, *_) in zip(a, b, strict=True):
        assert ta == tb
        for la, lb in zip(lpa, lpb, strict=True):
            shared = sorted(set(la) & set(lb))
            assert len(shared) >= 3
            va, vb = np.array([la[k] for k in shared]), np.array([lb[k] for k in shared])
            errs.append(float(np.linalg.norm(va - vb) / np.linalg.norm(va)))
    assert np.median(errs) <= TYPICAL and max(errs) <= WORST, (np.median(errs), max(errs))
    return errs


@pytest.mark.parametrize("tp, steps", [(2, 64), (4, 12)])
def test_tp_equals_tp1(tp, steps, rng):
    """The hybrid tiny model (SWA layers 0 and 2, MoE layers 1..3) with chunked prefill and a
    prefix hit: the same greedy tokens and the same logprobs at TP 1 and TP N."""
    shared = [int(x) for x in rng.integers(2, 500, 48)]
    ps = [{"prompt_token_ids": shared + [int(x) for x in rng.integers(2, 500, n)]} for n in (5, 60)]
    ps.append({"prompt_token_ids": [int(x) for x in rng.integers(2, 500, 7)]})
    sp = dict(max_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=5)
    kw = dict(max_num_batched_tokens=45, enable_prefix_caching=True)
    warm = [{"prompt_token_ids": shared + [1, 2]}]
    want = run(1, [warm, ps], sp, **kw)
    got = run(tp, [warm, ps], sp, **kw)
    assert got[1][2] == 48 and got[2][2] == 48  # the prefix hit happened
    errs = assert_same(want, got)
    stats = f"median {np.median(errs):.1e}, p90 {np.quantile(errs, 0.9):.1e}, max {max(errs):.1e}"
    print(f"TP {tp} vs 1: {len(errs)} steps, {stats}")


def test_prompt_logprobs_at_tp2_equal_tp1(rng):
    """Prompt logprobs need the LM head on every rank (it gathers the vocabulary shards): TP 2
    gives TP 1's, chunk by chunk, first entry None."""
    ps = [{"prompt_token_ids": [int(x) for x in rng.integers(2, 500, n)]} for n in (70, 9)]
    sp = dict(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    want, got = (run(tp, [ps], sp, max_num_batched_tokens=32) for tp in (1, 2))
    for (ta, _, _, pa), (tb, _, _, pb), p in zip(want, got, ps, strict=True):
        ids = p["prompt_token_ids"]
        assert ta == tb and len(pa) == len(pb) == len(ids) and pa[0] is None and pb[0] is None
        a = np.array([pa[i][str(ids[i])] for i in range(1, len(ids))])
        b = np.array([pb[i][str(ids[i])] for i in range(1, len(ids))])
        assert np.abs(a - b).max() <= WORST * np.abs(a).max()


def test_captured_decode_at_tp2_equals_tp1_eager(rng):
    """Every rank captures its buckets at start (the all-reduces inside them in the same order)
    and replays them in lockstep: TP 2 with captured decode steps gives TP 1's eager tokens."""
    ps = [{"prompt_token_ids": [int(x) for x in rng.integers(2, 500, n)]} for n in (40, 9, 23)]
    sp = dict(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
    want = run(1, [ps], sp, cuda_graph_batch_sizes="")
    replays = []
    got = run(2, [ps], sp, replays, cuda_graph_batch_sizes="2,4", cuda_graph_capture=True)
    assert_same(want, got)
    assert replays[0] >= 23  # every decode step: 3 requests run as the bucket of 4


def test_speculative_decoding_at_tp2_equals_tp1_without(mtp_model_dir, rng):
    """Every rank runs the driver's draft passes (its "draft" message; after a captured step the
    driver's draft staging, accepted on its device, by broadcast) and, captured, the verify
    steps chained behind the running one (their tokens and positions from the driver's device,
    by broadcast): TP 2 with k = 2, eager and captured, gives the greedy tokens of TP 1 without
    speculation, and captured accepts the drafts eager does (a rank drafting from other inputs
    would change the drafts)."""
    ps = [{"prompt_token_ids": [int(x) for x in rng.integers(4, 256, n)]} for n in (70, 9)]
    sp = dict(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=3)
    want = run(1, [ps], sp, model=mtp_model_dir)
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    accepted, replays = [], []
    for kw in (dict(cuda_graph_batch_sizes=""), dict(cuda_graph_batch_sizes="1,2", cuda_graph_capture=True)):
        got = run(2, [ps], sp, replays, accepted, model=mtp_model_dir, speculative_config=spec, **kw)
        assert [r[0] for r in got] == [r[0] for r in want] and all(len(r[0]) == 40 for r in got)
    (eager, none), (captured, chained) = accepted
    assert eager == captured > 0 and none == 0 and chained > 0 and replays[1] > 0


def test_dsa_layers_at_tp2_equal_tp1(dsa_model_dir, rng):
    """DSA layers under TP 2: the attention heads split, the indexer's heads whole on every rank
    (its weights replicated), so both ranks pick the same keys as TP 1; a window, indexed and full
    hybrid with prompts past 4 x index_topk, chunked: TP 1's greedy tokens and logprobs."""
    ps = [{"prompt_token_ids": [int(x) for x in rng.integers(2, 500, n)]} for n in (70, 21)]
    sp = dict(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
    want, got = (run(tp, [ps], sp, model=dsa_model_dir, max_num_batched_tokens=40) for tp in (1, 2))
    assert_same(want, got)


def test_each_rank_reads_only_its_slices(tiny_model_dir):
    """Loading with TP 2 reads each rank's slices: their bytes add up to the checkpoint plus the
    replicated tensors once more, and every parameter is the matching slice of the TP 1 one."""
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    full = DeepseekV3ForCausalLM(FDConfig(model_config=cfg))
    total = load_weights(full, tiny_model_dir, cfg.num_hidden_layers, show_progress=False)
    whole = dict(full.named_parameters())
    disk = SafeTensorsFile(f"{tiny_model_dir}/model.safetensors")
    read, replicated = [], 0
    for rank in range(2):
        part = DeepseekV3ForCausalLM(FDConfig(model_config=cfg), TPGroup(rank=rank, world_size=2))
        read.append(load_weights(part, tiny_model_dir, cfg.num_hidden_layers, show_progress=False))
        for name, p in part.named_parameters():
            shard = getattr(p, "tp_shard", None)
            w = whole[name].numpy()
            if shard is None:
                replicated += disk.nbytes(name) if rank == 0 else 0
                np.testing.assert_array_equal(p.numpy(), w)
            else:
                dim, start, end, _ = shard
                np.testing.assert_array_equal(p.numpy(), np.take(w, range(start, end), axis=dim))
        assert sum(p.numel() for p in part.parameters()) < sum(p.numel() for p in full.parameters())
    assert read[0] < total and read[1] < total
    assert read[0] + read[1] == total + replicated


def test_indivisible_config_is_named():
    with pytest.raises(ValueError, match="'num_attention_heads'=4 does not divide over tensor_parallel_size=3"):
        LLM(tensor_parallel_size=3, **KW)


# ---------------------------------------------------------------- the server


def metrics_of(base: str) -> dict[str, float]:
    keep = ("generation_tokens_total", "prompt_tokens_total", "request_success_total{", "prefix_cache_hits_total")
    out = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith("fastdeploy:") and any(k in line for k in keep):
            name, v = line.rsplit(" ", 1)
            out[name] = float(v)
    return out


def test_server_tp2_serves_like_tp1(procs):
    results = {}
    for tp in (1, 2):
        s = procs("--tensor-parallel-size", str(tp), "--dist-timeout", "3")
        if tp == 2:  # idle past --dist-timeout: the worker's beats keep it from counting as stopped
            time.sleep(4.5)
            assert s.p.poll() is None and httpx.get(s.base + "/health").status_code == 200
        client = openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0, timeout=120)
        text = client.completions.create(model="tiny-mla-swa", prompt="Hello", max_tokens=12, temperature=0)
        chunks = client.chat.completions.create(
            model="tiny-mla-swa", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        results[tp] = (text.choices[0].text, text.usage.completion_tokens, streamed, metrics_of(s.base))
    assert results[2] == results[1] and results[2][1] == 12


LONG = """
import json, sys, time
from fastdeploy import LLM, SamplingParams
a = json.loads(sys.argv[1])
eng = LLM(**a["engine"]).engine
eng.add_request(a["prompt"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), "r")
steps, tokens = [], None
while eng.has_unfinished_requests():
    t = time.monotonic()
    tokens = [o.outputs[0].token_ids for o in eng.step()] or tokens
    steps.append(time.monotonic() - t)
print("RESULT " + json.dumps({"steps": steps, "tokens": tokens}))
"""


def test_a_long_step_whose_ranks_compute_does_not_stop_the_driver(rng):
    """A 400-token prefill in the absorbed form takes seconds on CPU, several times
    --dist-timeout (0.8 s here): the ranks beat that they compute, so the step is long, not
    hung; it finishes with TP 1's tokens."""
    timeout, prompt = 0.8, [int(x) for x in rng.integers(2, 500, 400)]
    got = {}
    for tp in (1, 2):
        engine = {**KW, "max_model_len": 512, "max_num_batched_tokens": 512, "num_gpu_blocks_override": 96}
        engine.update(tensor_parallel_size=tp, dist_timeout=timeout, mla_prefill_form="absorbed")
        arg = json.dumps({"engine": engine, "prompt": prompt})
        p = subprocess.run([sys.executable, "-c", LONG, arg], capture_output=True, text=True, timeout=300)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        assert p.returncode == 0 and line, p.stderr[-3000:]
        got[tp] = json.loads(line[0][len("RESULT ") :])
    assert max(got[2]["steps"]) > 2 * timeout  # the prefill step really outlasted the timeout
    assert got[2]["tokens"] == got[1]["tokens"] and len(got[2]["tokens"][0]) == 3


@pytest.mark.parametrize(
    "how, when",
    [
        ("kill", "step"),  # a rank that dies mid-generation
        ("stop", "step"),  # one that stops answering inside a step
        ("stop", "broadcast"),  # stopped, then a request: the driver waits in the step's broadcast
        ("stop", "idle"),  # stopped between steps, no request at all: only its beats can tell
        ("kill", "idle"),
    ],
)
def test_a_failed_worker_stops_the_driver(procs, how, when):
    """Wherever the fault lands: /health 503 and every client a 503 or an error event (never a
    500 or a hang), then exit 1 within --dist-timeout + 10 s with no process left behind."""
    timeout = 3
    s = procs("--tensor-parallel-size", "2", "--dist-timeout", str(timeout))
    (worker,) = [p for p in s.group_pids() if p != s.p.pid]
    stream = s.stream_in_background(1, max_tokens=200)[0] if when == "step" else None  # returns mid-generation
    os.kill(worker, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    t0 = time.time()
    answers = []
    if when == "broadcast":
        body = {"prompt": "go", "max_tokens": 8}
        answers.append(httpx.post(s.base + "/v1/completions", json=body, timeout=60).status_code)
    if when == "idle":
        while time.time() - t0 < timeout + 5:
            if httpx.get(s.base + "/health", timeout=2).status_code == 503:
                break
            time.sleep(0.1)
        assert time.time() - t0 < timeout + 5, "/health never said 503"
        answers.append(httpx.post(s.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code)
    assert s.p.wait(timeout=30) == 1 and time.time() - t0 < timeout + 10  # dist_timeout plus the answer grace
    assert all(a == 503 for a in answers), answers
    if stream is not None:
        s.threads[0].join(timeout=10)
        told = "transport_error" in stream or any("error" in e for e in stream["events"])
        assert told, stream["events"][-3:]  # the stream was told
    deadline = time.time() + 5  # a killed process leaves the table once reaped; under load that takes a moment
    while s.group_pids() and time.time() < deadline:
        time.sleep(0.1)
    assert s.group_pids() == []  # the driver killed its worker: no process left behind
    r = None
    try:
        r = httpx.get(s.base + "/health", timeout=2)
    except httpx.TransportError:
        pass
    assert r is None  # the server is gone
