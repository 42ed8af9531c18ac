"""Data-parallel engine cores and expert parallelism on CPU over gloo (docs/design.md §4.19): DP 2 x
EP 2 and DP 2 x TP 2 against one rank, the router, the front's metrics, and a core that fails.
Every multi-process test is bounded in time and leaves no process behind."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from live_server import free_port, wait_idle

from fastdeploy.engine.dp_router import Router

FLAGS = ("--block-size", "16", "--num-gpu-blocks-override", "64", "--max-model-len", "256", "--log-level", "warning")

KW = dict(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=64, max_model_len=256)
W = 32  # the tiny preset's sliding window

RUN = """
import json, sys
from fastdeploy import LLM, SamplingParams
a = json.loads(sys.argv[1])
llm = LLM(**a["engine"])
outs = [o for ps in a["batches"] for o in llm.generate(ps, SamplingParams(**a["sampling"]))]
lps = lambda es: [None if e is None else {str(k): v for k, v in e.items()} for e in es or []]
rows = [[c.token_ids, lps(c.logprobs), o.num_cached_tokens] for o in outs for c in o.outputs]
print("RESULT " + json.dumps(rows))
"""


def run(batches, **kw) -> list:
    """(token ids, top logprobs, cached tokens) of each batch's outputs in turn, on one engine (or
    front) in a process of its own."""
    sampling = {"max_tokens": 40, "temperature": 0, "logprobs": 4, "ignore_eos": True}
    arg = json.dumps({"engine": {**KW, **kw}, "batches": batches, "sampling": sampling})
    p = subprocess.run([sys.executable, "-c", RUN, arg], capture_output=True, text=True, timeout=300)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stderr[-3000:]
    return json.loads(line[0][len("RESULT ") :])


def assert_same(a, b, worst: float = 1e-4, typical: float = 1e-4) -> None:
    """Identical tokens; the largest difference of each step's top logprobs (those both report):
    every one within ``worst``, their median within ``typical``."""
    assert [r[0] for r in a] == [r[0] for r in b]
    errs = []
    for (_, lpa, _), (_, lpb, _) in zip(a, b, strict=True):
        for la, lb in zip(lpa, lpb, strict=True):
            shared = sorted(set(la) & set(lb))
            assert len(shared) >= 3
            errs.append(max(abs(la[k] - lb[k]) for k in shared))
    assert max(errs) <= worst and np.median(errs) <= typical, (max(errs), np.median(errs))


def batches(rng) -> list:
    """One request alone (the other core idles through dummy steps): 2W + a block + 7 tokens,
    prefilled in chunks above and below W; then a request with a 3-block prefix, and two more
    that share it (prefix hits where the router sends them), 40 tokens each across the window."""
    ids = lambda n: [int(x) for x in rng.integers(2, 500, n)]  # noqa: E731
    shared = ids(48)
    return [
        [{"prompt_token_ids": ids(2 * W + 16 + 7)}],
        [{"prompt_token_ids": shared + ids(W - 1)}],
        [{"prompt_token_ids": shared + ids(n)} for n in (W, W + 1)],
    ]


@pytest.mark.parametrize("kw", [{"enable_expert_parallel": True}, {}], ids=["ep2", "replicas"])
def test_dp2_gives_one_ranks_tokens_and_logprobs(kw, rng):
    """DP 2 with experts split over both cores (and, without EP, two whole replicas): the greedy
    tokens of one engine, logprobs within 1e-4, through chunked prefill (budget 48: chunks of 48
    and 39 for a W = 32 window), prefix hits and an idle core."""
    bs = batches(rng)
    eng = dict(max_num_batched_tokens=48, enable_prefix_caching=True)
    one = run(bs, **eng)
    two = run(bs, data_parallel_size=2, **eng, **kw)
    assert_same(two, one)
    assert two[2][2] >= 48 and two[3][2] >= 48  # the later prompts of the shared prefix hit it


def test_dp2_ep2_serves_fp8_and_dsa_checkpoints_like_one_rank(tmp_path, rng):
    """An FP8 checkpoint (each rank reads only its experts' e4m3 blocks and scales) whose layers
    1 and 3 are DSA (DeepSeek-V3.2's lightning indexer), 0 SWA: DP 2 x EP 2 gives one engine's
    tokens and logprobs."""
    from fastdeploy.tools.make_tiny_model import make_tiny_model

    d = make_tiny_model(str(tmp_path / "m"), fp8=True, swa_layers=[0], dsa_layers=[1, 3], index_topk=16)
    bs = [[{"prompt_token_ids": [int(x) for x in rng.integers(2, 500, n)]} for n in (2 * W + 21, 12)]]
    one = run(bs, model=d)
    assert_same(run(bs, model=d, data_parallel_size=2, enable_expert_parallel=True), one)


def test_dp2_tp2_with_expert_parallel_equals_one_rank(rng):
    """Four ranks: two cores of TP 2, the experts over all four (each TP rank dispatches half of
    its core's rows). TP's all-reduces sum in another order than one rank's matmul, which moves
    an SWA latent across an e4m3 rounding boundary now and then (tests/distributed/
    test_tensor_parallel.py measures the effect: up to 1e-3, most steps within 1e-5)."""
    bs = [[{"prompt_token_ids": [int(x) for x in rng.integers(2, 500, n)]} for n in (2 * W + 19, 9, 40)]]
    one = run(bs)
    four = run(bs, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    assert_same(four, one, worst=1e-3, typical=2e-5)


def test_the_router_keeps_a_chat_on_its_core_and_balances_the_rest():
    """A 4-turn chat: each turn's prompt extends the last turn's prompt and answer, so every turn
    after the first goes to the first turn's core, while other prompts go to the least loaded."""
    rng = np.random.default_rng(3)
    r = Router(num_ranks=3, block_size=16, balance=8)
    toks = lambda n: [int(x) for x in rng.integers(2, 500, n)]  # noqa: E731
    r.sent(r.choose(toks(40)), [])  # other traffic: cores 0 and 1 carry one request each
    r.sent(r.choose(toks(40)), [])
    chat, cores = toks(30), []
    for _ in range(4):
        core = r.choose(chat)
        cores.append(core)
        r.sent(core, chat)
        answer = toks(20)
        r.finished(core, chat + answer)
        chat = chat + answer + toks(25)
    assert cores == [2, 2, 2, 2]  # the first turn: the least loaded; then its prefix
    assert r.load == [1, 1, 0]
    assert r.choose(toks(40)) == 2  # no prefix anywhere: the least loaded
    for _ in range(9):  # the chat's core 8 above the lightest: still within the balance
        r.sent(2, [])
    assert r.choose(chat) == 2
    r.sent(2, [])  # 9 above: its prefix no longer wins
    assert r.choose(chat) == 0


def test_the_router_forgets_the_oldest_blocks_past_its_capacity():
    r = Router(num_ranks=2, block_size=4, balance=100, capacity=3)
    r.sent(1, list(range(20)))  # 5 blocks: the first 2 forgotten
    assert len(r.seen[1]) == 3 and r.matched(1, r.hashes(list(range(20)))) == 0
    r.sent(1, list(range(8)))
    assert r.choose(list(range(12))) == 1  # its 2 leading blocks are known again


def labelled(base: str, name: str) -> dict[str, float]:
    """``fastdeploy:NAME`` by dp_rank (summed over other labels)."""
    out: dict[str, float] = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(f"fastdeploy:{name}{{"):
            rank = line.split('dp_rank="')[1].split('"')[0]
            out[rank] = out.get(rank, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_server_dp2_ep2_keeps_a_chat_on_one_core(procs):
    """The API server over two expert-parallel cores: a 4-turn chat (each turn sends the whole
    conversation) runs on one core, whose prefix cache it hits from the second turn on, the
    other core idle; /metrics gives each core's counts under dp_rank; every block is free after."""
    s = procs("--data-parallel-size", "2", "--enable-expert-parallel", "--enable-prefix-caching")
    messages = [{"role": "user", "content": "Tell me a story about a lighthouse keeper and the sea " * 3}]
    for turn in range(4):
        body = {"model": "tiny-mla-swa", "messages": messages, "max_tokens": 12, "temperature": 0}
        r = httpx.post(s.base + "/v1/chat/completions", json=body, timeout=120).json()
        assert r["usage"]["completion_tokens"] == 12
        messages += [r["choices"][0]["message"], {"role": "user", "content": f"And then, part {turn + 2}?"}]
    generated = labelled(s.base, "generation_tokens_total")
    hits = labelled(s.base, "prefix_cache_hits_total")
    busy = max(generated, key=generated.get)
    assert set(generated) == {"0", "1"} and generated[busy] == 48 and sum(generated.values()) == 48
    assert hits[busy] >= 3 * 16 and sum(hits.values()) == hits[busy]
    used = labelled(s.base, "kv_cache_blocks_used")
    assert used == {"0": 0.0, "1": 0.0}
    assert httpx.get(s.base + "/health").status_code == 200


def test_server_dp2_ep2_samples_aborts_and_constrains(procs):
    """Through the front: n = 3 seeded samples of one prompt (one core: their prefill shared), a
    stream the client drops mid-way (aborted on its core: every block free after), and a JSON
    constraint (its matcher made again on the core) give what one engine gives."""
    outs = {}
    for dp in ("1", "2"):
        extra = ("--enable-expert-parallel",) if dp == "2" else ()
        s = procs("--data-parallel-size", dp, "--enable-prefix-caching", *extra)
        body = {"model": "tiny-mla-swa", "prompt": "Once upon a time " * 4, "max_tokens": 10, "n": 3, "seed": 7}
        r = httpx.post(s.base + "/v1/completions", json=body, timeout=120).json()
        assert r["usage"]["completion_tokens"] == 30 and len(r["choices"]) == 3
        texts = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
        if dp == "2":  # the three samples on one core
            assert sorted(labelled(s.base, "generation_tokens_total").values()) == [0.0, 30.0]
        stream = {**body, "n": 1, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.base + "/v1/completions", json=stream, timeout=120) as st:
            for i, _ in enumerate(st.iter_lines()):
                if i == 6:
                    break  # the client goes away mid-generation
        chat = {
            "model": "tiny-mla-swa",
            "messages": [{"role": "user", "content": "Give me a JSON object."}],
            "max_tokens": 30,
            "temperature": 0,
            "response_format": {"type": "json_object"},
        }
        r = httpx.post(s.base + "/v1/chat/completions", json=chat, timeout=120).json()
        outs[dp] = (texts, r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"])
        wait_idle(s.base)  # the dropped stream's blocks freed on its core too
        if dp == "2":
            assert labelled(s.base, "kv_cache_blocks_used") == {"0": 0.0, "1": 0.0}
    assert outs["2"] == outs["1"]


@pytest.mark.parametrize("how, when", [("kill", "step"), ("stop", "step"), ("kill", "idle")])
def test_a_failed_core_stops_the_front(procs, how, when):
    """A core killed or stopped, mid-generation or idle: the clients are told (an error event or a
    503), /health 503, the front exits 1 within --dist-timeout + 10 s, no process left."""
    timeout = 3
    s = procs("--data-parallel-size", "2", "--enable-expert-parallel", "--dist-timeout", str(timeout))
    cores = [p for p in s.group_pids() if p != s.p.pid]
    assert len(cores) == 2
    stream = s.stream_in_background(1, max_tokens=200)[0] if when == "step" else None
    os.kill(cores[1], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    t0 = time.time()
    answers = []
    if when == "idle":
        while time.time() - t0 < timeout + 5:
            if httpx.get(s.base + "/health", timeout=2).status_code == 503:
                break
            time.sleep(0.1)
        answers.append(httpx.post(s.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code)
    assert s.p.wait(timeout=30) == 1 and time.time() - t0 < timeout + 10
    assert all(a == 503 for a in answers), answers
    if stream is not None:
        s.threads[0].join(timeout=10)
        assert "transport_error" in stream or any("error" in e for e in stream["events"]), stream["events"][-3:]
    deadline = time.time() + 5
    while s.group_pids() and time.time() < deadline:
        time.sleep(0.1)
    assert s.group_pids() == []


def test_under_paddles_launcher_rank_0_serves_and_the_other_core_connects(tmp_path, rng):
    """``python -m paddle.distributed.launch --nproc_per_node 2 SERVER --data-parallel-size 2
    --enable-expert-parallel``: rank 0 serves HTTP with core 0 in a child process, rank 1's core
    connects over TCP; two prompts (one each) give one engine's greedy tokens; the launcher's
    process group leaves nothing behind."""
    from fastdeploy.entrypoints.openai import api_server

    port = free_port()
    prompts = [[int(x) for x in rng.integers(2, 500, n)] for n in (2 * W + 5, 20)]
    from fastdeploy import LLM, SamplingParams

    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [o.outputs[0].text for o in LLM(**KW).generate([{"prompt_token_ids": p} for p in prompts], sp)]
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--log_dir", str(tmp_path), "--nproc_per_node", "2"]
    cmd += [
        api_server.__file__,
        *FLAGS,
        "--port",
        str(port),
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
    ]
    env = {**os.environ, "FD_DP_AUTHKEY": "test-key"}
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
            assert p.poll() is None, (tmp_path / "workerlog.0").read_text()[-3000:]
        body = {"model": "tiny-mla-swa", "prompt": prompts, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        r = httpx.post(base + "/v1/completions", json=body, timeout=120).json()
        got = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
        assert got == want, r
        generated = labelled(base, "generation_tokens_total")
        assert sorted(generated.values()) == [40.0, 40.0]  # one prompt a core
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=30)
        deadline = time.time() + 10
        while subprocess.run(["pgrep", "-g", str(p.pid)], capture_output=True).stdout and time.time() < deadline:
            time.sleep(0.2)
        assert not subprocess.run(["pgrep", "-g", str(p.pid)], capture_output=True).stdout
