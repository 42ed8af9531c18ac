"""The server never goes down: a fuzz corpus of bad requests, a request the engine fails, clients
that disconnect, a dead engine, raw SSE, n samples and batched prompts (live server on loopback)."""

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import pytest
from live_server import LiveServer, metric, wait_idle

from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.engine.engine import LLMEngine

ENGINE = dict(
    model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=200, max_model_len=256, enable_prefix_caching=True
)
LIMIT = 64 * 1024
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    eng = AsyncLLMEngine(LLMEngine(EngineArgs(**ENGINE)))
    s = LiveServer(eng, max_request_bytes=LIMIT)
    yield s
    s.close()


@pytest.fixture(scope="module")
def live(server):
    return server.base, server.engine


GREEDY = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}


def greedy_text(base: str) -> list[int]:
    r = httpx.post(base + CMPL, json={**GREEDY, "logprobs": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


# ---------------------------------------------------------------- the fuzz corpus

BAD = {  # field -> values that must be a 400 naming that field (completions)
    "prompt": [5, None, True, [1.5], [["a"]], {}, [-1], [10**9], [], [[]], [1, "a"]],
    "max_tokens": ["16", True, 0, -1, 1.5, 10**6, [16]],  # 0: only with echo
    "prompt_logprobs": [-1, 21, "1", True, 1.5],
    "temperature": ["1", True, -0.1, 2.5, None, [1], {"x": 1}],
    "top_p": [0, -1, 1.01, "0.5", True, None],
    "top_k": [-2, 0, 1.5, "5", True],
    "seed": ["1", 1.5, True, 2**64, -(2**63) - 1],
    "stop": [5, [1], ["a", "b", "c", "d", "e"], [""], {"a": 1}, [None]],
    "stop_token_ids": [[-1], [100000], "1", [1.5], 3],
    "n": [0, 65, "2", True, 1.5],
    "presence_penalty": [2.5, -3, "0", True],
    "frequency_penalty": [2.5, -3, "0", None],
    "repetition_penalty": [0, -1, 11, "1"],
    "logit_bias": [{"abc": 1}, {"99999": 1}, {"5": 101}, {"5": "1"}, [1], {"5": -100.5}],
    "min_tokens": [-1, "1", 1.5, 100],
    "logprobs": [-1, 21, "1", True, 2.5],
    "echo": ["yes", 1, None],
    "stream": ["true", 1],
    "stream_options": [{"include_usage": "yes"}, {"bogus": 1}, {"include_usage": True}, "x"],
    "ignore_eos": ["no", 0],
    "user": [5, ["u"]],
    "response_format": [
        "text",
        {"type": "json_schema", "json_schema": {}},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        {"type": "json_schema", "json_schema": {"schema": "{}"}},
        {"type": "xml"},
        {"kind": "text"},
    ],
    "guided_json": [{"type": "object", "properties": 5}, "{not json", 5],
    "guided_regex": ["(", 5],
    "guided_choice": [[], [1], "yes"],
    "guided_grammar": ["start: undefined_rule", "nonsense ::: x", 5],
    "structured_outputs": [{"regex": "a", "choice": ["b"]}, {"bogus": 1}, {"choice": []}],
    "tools": [[{"type": "function", "function": {"name": "f"}}]],
    "tool_choice": ["auto"],
    "functions": [[{"name": "f"}]],
    "model": [5, "gpt-4"],
    "bogus": [1],
    "best_of": [2],
    "suffix": ["x"],
}
BAD_CHAT = {
    "messages": [
        [],
        "hi",
        [{"role": "robot", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": "x", "extra": 1}],
        [{"content": "x"}],
    ],
    "max_completion_tokens": [0, "5"],
    "top_logprobs": [21, 3],  # 3 without logprobs=true
    "logprobs": ["true"],
    "add_generation_prompt": ["yes"],
}
DEGENERATE_OK = [  # valid, extreme sampling values: 200 with exact token counts
    {"temperature": 1e-310},
    {"temperature": 0, "top_p": 1e-9},
    {"temperature": 2, "top_k": 1},
    {"temperature": 1e-6, "top_k": 1, "top_p": 1e-300},
    {"logprobs": 0},
    {"logprobs": 20},
    {"repetition_penalty": 10},
    {"repetition_penalty": 0.01},
    {"presence_penalty": -2, "frequency_penalty": 2},
    {"seed": -1},
    {"seed": 2**64 - 1},
    {"min_tokens": 4, "max_tokens": 4},
    {"response_format": {"type": "text"}},
    {"user": "someone", "n": 2},
    {"stop": ["a", "b", "c", "d"], "min_tokens": 4},  # min_tokens: no stop before 4 tokens
    {"stop_token_ids": [0, 1, 2], "min_tokens": 4},
    {"top_k": 100000},
    {"top_k": 2**63 - 1},  # above the vocabulary: the whole vocabulary (vLLM), never an int32 overflow
    {"top_k": 2**63},
    {"top_k": 10**30},
]


def corpus() -> list[tuple[str, object, int, str | None]]:
    """(path, body as JSON-able or raw bytes, status, field) cases."""
    cases = []
    for field, values in BAD.items():
        status = 404 if field == "model" else 400
        for v in values:
            body = {"prompt": "hi", "max_tokens": 2, field: v}
            if field == "model" and v == 5:
                cases.append((CMPL, body, 400, field))
                continue
            if field == "stream_options" and v == {"include_usage": True}:
                pass  # valid alone, but only with stream=true: still a 400 on stream_options
            cases.append((CMPL, body, status, field))
    for field, values in BAD_CHAT.items():
        for v in values:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: v}
            cases.append((CHAT, body, 400, "messages" if field == "messages" else field))
    for extra in DEGENERATE_OK:
        cases.append((CMPL, {"prompt": "hi", "max_tokens": 4, "ignore_eos": True, **extra}, 200, None))
        chat = dict(extra)
        if "logprobs" in chat:  # chat's logprobs is a bool, the count is top_logprobs
            chat["top_logprobs"], chat["logprobs"] = chat["logprobs"], True
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True, **chat}
        cases.append((CHAT, body, 200, None))
    raw = [  # bodies that are not valid JSON text, or not valid Unicode
        (b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
        (b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
        (b'{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
        (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "body"),
        (b'{"prompt": "caf\xc3", "max_tokens": 2}', "body"),
        (b'{"prompt": ', "body"),
        (b'{"prompt": "hi",}', "body"),
        (b"[1, 2]", "body"),
        (b"null", "body"),
        (b"", "body"),
        (b'{"prompt": "hi", "max_tokens": NaN}', "max_tokens"),
        (b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
        (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ]
    cases += [(CMPL, body, 400, field) for body, field in raw]
    chat_surrogate = b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'
    cases.append((CHAT, chat_surrogate, 400, "messages"))
    big = json.dumps({"prompt": "x" * (LIMIT + 10)}).encode()
    cases += [(CMPL, big, 413, "body"), (CHAT, big, 413, "body")]
    return cases


def send(base: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(base + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    return httpx.post(base + path, json=body, timeout=60)


def test_fuzz_corpus_never_stops_the_server(live):
    base, eng = live
    before = greedy_text(base)
    cases = corpus()
    assert len(cases) >= 150
    for path, body, status, field in cases:
        r = send(base, path, body)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        if status >= 400:
            err = r.json().get("error")
            assert err and err["param"] and (err["param"] == field or err["param"].startswith(field + ".")), (body, err)
            assert err["param"] in err["message"], err
        else:
            out = r.json()
            n = body.get("n", 1)
            assert len(out["choices"]) == n and out["usage"]["completion_tokens"] == 4 * n
    chunked = httpx.post(base + CMPL, content=iter([b'{"prompt": "', b"x" * LIMIT, b'"}']), timeout=60)
    assert chunked.status_code == 413  # no Content-Length: cut off as the bytes arrive
    assert eng.healthy and httpx.get(base + "/health").status_code == 200
    assert greedy_text(base) == before  # the same greedy tokens as before the corpus
    wait_idle(base)


def test_degenerate_sampling_values_are_greedy_or_bounded(live):
    base, _ = live
    want = greedy_text(base)
    for extra in ({"temperature": 1e-310}, {"temperature": 1.5, "top_p": 1e-12}, {"temperature": 2.0, "top_k": 1}):
        r = httpx.post(base + CMPL, json={**GREEDY, "logprobs": 0, **extra}, timeout=60)
        assert r.json()["choices"][0]["logprobs"]["tokens"] == want, extra
    seeded = {**GREEDY, "temperature": 1.0, "seed": 7, "logprobs": 0}
    whole = httpx.post(base + CMPL, json=seeded, timeout=60).json()["choices"][0]["logprobs"]["tokens"]
    for k in (2**63 - 1, 2**63, 10**30):  # above the vocabulary: the whole vocabulary, as vLLM
        r = httpx.post(base + CMPL, json={**seeded, "top_k": k}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["tokens"] == whole, (k, r.text)
    r = httpx.post(base + CMPL, json={**GREEDY, "temperature": 1.0, "logit_bias": {"65": 100}, "logprobs": 0})
    assert r.status_code == 200
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 8 and len(set(tokens)) == 1  # +100 on one token: it is always drawn


def test_accepted_extremes_never_fail_a_request(live):
    """repetition_penalty at the bottom of its range (5e-324, 1e-310, 1e-305) with sampled and
    near-greedy temperatures: 200 with the asked tokens, never 500 (issue 25, item 3)."""
    base, _ = live
    for rep, temp in ((5e-324, 0.7), (1e-310, 0.7), (1e-305, 0.001), (1e-305, 2.0)):
        body = {**GREEDY, "temperature": temp, "repetition_penalty": rep, "prompt": "aaaa aaaa aaaa"}
        r = httpx.post(base + CMPL, json=body, timeout=60)
        assert r.status_code == 200, (rep, temp, r.text)
        assert r.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        (CMPL, {**GREEDY, "model": "\ud800"}, 400, "model"),  # a lone surrogate: 400, not 500
        (CMPL, {**GREEDY, "model": "other"}, 404, "model"),
        (CMPL, {**GREEDY, "stop": ""}, 400, "stop"),  # as [""]
        (CMPL, {**GREEDY, "stop": [""]}, 400, "stop"),
        (CMPL, {**GREEDY, "logit_bias": {"\u0661": 1}}, 400, "logit_bias"),  # Arabic-Indic one
        (CMPL, {**GREEDY, "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),  # superscript two
        (CMPL, {**GREEDY, "n": 9, "prompt": ["a"] * 30}, 400, "n"),  # 270 sequences > 256
        (
            CHAT,
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6},
            400,
            "max_completion_tokens",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]}]},
            400,
            "messages.0.content.0",
        ),
    ],
)
def test_validation_is_consistent(live, path, body, status, param):
    """Issue 25, items 4, 5 and 7: each case a clean OpenAI error naming its field."""
    base, _ = live
    raw = json.dumps(body).replace("\\\\u", "\\u")
    r = httpx.post(base + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    if status == 404:
        assert err["code"] == "model_not_found"


# ---------------------------------------------------------------- failures pinned to requests


def test_engine_step_failure_fails_only_its_request(live):
    base, eng = live
    runner = eng.engine.runner
    inner = runner.launch
    marker = 499  # a token id only the poisoned prompt contains

    def launch(prep, *a):
        if any(marker in req.prompt_token_ids for req, _ in prep.scheduled):
            raise RuntimeError("injected step failure")
        return inner(prep, *a)

    runner.launch = launch
    try:
        want = {
            i: httpx.post(base + CMPL, json={"prompt": [5, 6, 7 + i], "max_tokens": 6, "temperature": 0}).json()
            for i in range(3)
        }
        errors_before = metric(base, "engine_errors_total")

        async def run():
            async with httpx.AsyncClient(timeout=60) as c:
                good = [
                    c.post(base + CMPL, json={"prompt": [5, 6, 7 + i], "max_tokens": 6, "temperature": 0})
                    for i in range(3)
                ]
                bad = c.post(base + CMPL, json={"prompt": [5, marker, 9], "max_tokens": 6})
                return await asyncio.gather(bad, *good)

        bad, *good = asyncio.run(run())
        assert bad.status_code == 500 and "injected step failure" in bad.json()["error"]["message"], bad.text
        for i, r in enumerate(good):
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[i]["choices"][0]["text"]
        assert metric(base, "engine_errors_total") == errors_before + 1
        assert eng.healthy
    finally:
        runner.launch = inner
    wait_idle(base)


def test_dead_engine_answers_503_at_once_and_calls_on_fatal():
    fatal = threading.Event()
    eng = AsyncLLMEngine(LLMEngine(EngineArgs(**ENGINE)), on_fatal=fatal.set)
    server = LiveServer(eng)
    base = server.base
    try:
        sched = eng.engine.scheduler
        inner = sched.schedule
        calls = []

        def schedule():
            calls.append(1)
            if len(calls) > 2:
                raise RuntimeError("scheduler bug")  # outside the per-request isolation
            return inner()

        sched.schedule = schedule
        r = httpx.post(base + CMPL, json={"prompt": "hi", "max_tokens": 50, "ignore_eos": True}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert fatal.wait(5) and not eng.healthy
        assert httpx.get(base + "/health").status_code == 503
        t0 = time.time()
        r = httpx.post(base + CMPL, json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and time.time() - t0 < 5
        r = httpx.post(base + CMPL, json={"prompt": "hi", "max_tokens": 2, "stream": True}, timeout=30)
        assert r.status_code == 503
    finally:
        server.close()


# ---------------------------------------------------------------- disconnects


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_aborts_and_frees_blocks(live, stream):
    base, _ = live
    wait_idle(base)
    aborts = metric(base, 'request_success_total{finished_reason="abort"}')
    body = {"prompt": "tell me a long story", "max_tokens": 200, "ignore_eos": True, "stream": stream}

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            task = asyncio.ensure_future(c.post(base + CMPL, json=body))
            deadline = time.time() + 20
            while metric(base, "kv_cache_blocks_used") == 0 and time.time() < deadline:
                await asyncio.sleep(0.02)
            task.cancel()  # the client goes away mid-request
            try:
                await task
            except asyncio.CancelledError:
                pass

    asyncio.run(go())
    wait_idle(base, timeout=10)
    assert metric(base, 'request_success_total{finished_reason="abort"}') == aborts + 1
    assert metric(base, "kv_cache_blocks_used") == 0 and metric(base, "num_requests_running") == 0


# ---------------------------------------------------------------- the wire format


def sse_events(base: str, path: str, body: dict) -> list:
    with httpx.stream("POST", base + path, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    blocks = raw.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    events = []
    for b in blocks[:-2]:
        assert b.startswith("data: ")
        events.append(json.loads(b[len("data: ") :]))
    return events


def test_raw_sse_usage_and_cached_tokens(live):
    base, _ = live
    prompt = [int(x) for x in range(40, 40 + 70)]
    body = {
        "prompt": prompt,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    for attempt in range(2):  # the second time, the prompt's 4 full blocks are a prefix hit
        events = sse_events(base, CMPL, body)
        usage = events[-1]["usage"]
        assert events[-1]["choices"] == [] and all("usage" not in e for e in events[:-1])
        text_events = events[:-1]
        assert text_events[-1]["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] == 70 and usage["completion_tokens"] == 5 and usage["total_tokens"] == 75
        assert usage["prompt_tokens_details"]["cached_tokens"] == (64 if attempt else 0)
    chat = sse_events(
        base,
        CHAT,
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        },
    )
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat[-1]["usage"]["completion_tokens"] == 3
    wait_idle(base)


def test_n_samples_reproduce_and_batched_prompts_keep_order(live):
    base, _ = live
    body = {"prompt": "Once upon a time", "max_tokens": 6, "n": 3, "seed": 11, "temperature": 1.0}
    a, b = (httpx.post(base + CMPL, json=body, timeout=60).json() for _ in range(2))
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert len({c["text"] for c in a["choices"]}) > 1  # independent samples
    assert a["usage"]["completion_tokens"] == 18 and a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    prompts = ["alpha", [5, 6, 7], "gamma"]
    alone = [httpx.post(base + CMPL, json={"prompt": p, "max_tokens": 4, "temperature": 0}).json() for p in prompts]
    batch = httpx.post(base + CMPL, json={"prompt": prompts[::2], "max_tokens": 4, "temperature": 0}).json()
    assert [c["text"] for c in batch["choices"]] == [alone[0]["choices"][0]["text"], alone[2]["choices"][0]["text"]]
    ids = httpx.post(base + CMPL, json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 4, "temperature": 0}).json()
    assert ids["choices"][0]["text"] == alone[1]["choices"][0]["text"] and len(ids["choices"]) == 2
    assert ids["usage"]["prompt_tokens"] == 5
    streamed = sse_events(base, CMPL, {**body, "stream": True})
    texts = {}
    for e in streamed:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(3)] == [c["text"] for c in a["choices"]]
    wait_idle(base)


def test_stop_strings_never_reach_the_client(live):
    base, _ = live
    free = httpx.post(base + CMPL, json={"prompt": "hello", "max_tokens": 30, "temperature": 0, "ignore_eos": True})
    text = free.json()["choices"][0]["text"]
    stop = text[5:8]  # a string the greedy output contains, after some text
    assert len(stop) == 3 and stop in text
    body = {"prompt": "hello", "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    plain = httpx.post(base + CMPL, json=body).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and stop not in plain["text"] and text.startswith(plain["text"])
    streamed = "".join(e["choices"][0]["text"] for e in sse_events(base, CMPL, {**body, "stream": True}))
    assert streamed == plain["text"]
    wait_idle(base)


def test_n_samples_share_the_prompt_blocks(live):
    base, _ = live
    wait_idle(base)
    prompt = [int(x) for x in range(100, 170)]  # 70 tokens: 4 full blocks of 16
    hits = metric(base, "prefix_cache_hits_total")
    body = {"prompt": prompt, "max_tokens": 5, "n": 3, "seed": 4, "temperature": 1.0, "ignore_eos": True}
    r = httpx.post(base + CMPL, json=body, timeout=60).json()
    assert len(r["choices"]) == 3 and r["usage"]["completion_tokens"] == 15 and r["usage"]["prompt_tokens"] == 70
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # samples 2 and 3 reuse the first's blocks
    assert metric(base, "prefix_cache_hits_total") == hits + 2 * 64
    alone = [
        httpx.post(base + CMPL, json={**body, "n": 1, "seed": 4 + k}).json()["choices"][0]["text"] for k in range(3)
    ]
    assert [c["text"] for c in r["choices"]] == alone  # sample k is the request with seed + k
    wait_idle(base)


def test_a_bug_in_a_handler_is_an_openai_shaped_500(server, monkeypatch):
    srv = server.app.server

    def broken(body, rid):
        raise RuntimeError("a handler bug")

    monkeypatch.setattr(srv.mapping, "prepare_completion", broken)
    r = httpx.post(server.base + CMPL, json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_server_error"
    assert "a handler bug" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert httpx.post(server.base + CMPL, json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_sampling_fields_reach_the_sampler_as_named(live):
    """Each penalty field over HTTP gives the tokens the offline LLM gives with that SamplingParams
    field (same preset weights), and differs from the unpenalized output, so a field wired to
    another (presence taken from frequency) fails here."""
    from fastdeploy import LLM, SamplingParams

    base, _ = live
    offline = LLM(**ENGINE)
    fields = (("presence_penalty", 2.0), ("frequency_penalty", 2.0), ("repetition_penalty", 5.0))

    def greedy(prompt, **kw):
        sp = SamplingParams(max_tokens=10, temperature=0.0, **kw)
        return offline.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids

    rng = np.random.default_rng(0)
    for _ in range(20):  # a prompt where each penalty changes the greedy output (one repeats a token)
        prompt = [int(x) for x in rng.integers(4, 60, 3)] * 2
        plain_ids = greedy(prompt)
        if all(greedy(prompt, **{f: v}) != plain_ids for f, v in fields):
            break
    for field, value in fields:
        want = greedy(prompt, **{field: value})
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, field: value}
        r = httpx.post(base + CMPL, json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == len(want), r.text
        assert want != plain_ids, field  # the field matters for this prompt
        text = offline.get_tokenizer().decode(want)
        assert r.json()["choices"][0]["text"] == text, field


def test_a_logit_bias_key_past_the_vocabulary_is_a_400(live):
    base, eng = live
    vocab = eng.engine.config.model_config.vocab_size
    for key, status in ((vocab - 1, 200), (vocab, 400)):
        r = httpx.post(base + CMPL, json={**GREEDY, "logit_bias": {str(key): 1}}, timeout=60)
        assert r.status_code == status, (key, r.text)
        if status == 400:
            assert r.json()["error"]["param"] == "logit_bias"


def test_the_body_limit_is_exact_with_and_without_content_length(live):
    """A body of exactly the limit is read; one byte more is a 413, whether its length is
    declared (Content-Length) or only streamed (chunked)."""
    base, _ = live
    body = json.dumps(GREEDY)
    exact = body[:-1] + " " * (LIMIT - len(body)) + "}"
    assert len(exact.encode()) == LIMIT
    over = exact[:-1] + " }"
    headers = {"content-type": "application/json"}
    assert httpx.post(base + CMPL, content=exact, headers=headers, timeout=60).status_code == 200
    assert httpx.post(base + CMPL, content=over, headers=headers, timeout=60).status_code == 413

    def chunked(text):
        data = text.encode()
        for i in range(0, len(data), 4096):
            yield data[i : i + 4096]

    assert httpx.post(base + CMPL, content=chunked(exact), headers=headers, timeout=60).status_code == 200
    assert httpx.post(base + CMPL, content=chunked(over), headers=headers, timeout=60).status_code == 413


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-8-sig"])
def test_a_body_that_is_not_utf8_is_a_400(live, encoding):
    """UTF-16 / UTF-32 (with or without a byte order mark) and BOM-prefixed UTF-8 bodies, which
    json.loads would decode, are refused as the error text says (issue 25, item 7)."""
    base, _ = live
    raw = json.dumps({**GREEDY, "prompt": "héllo"}, ensure_ascii=False).encode(encoding)
    r = httpx.post(base + CMPL, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text
    plain = json.dumps({**GREEDY, "prompt": "héllo"}, ensure_ascii=False).encode("utf-8")
    ok = httpx.post(base + CMPL, content=plain, headers={"content-type": "application/json"}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_large_request_does_not_starve_a_small_one():
    """Issue 25's amplification case, scaled to 8 slots: one call of 15 prompts x n=16 (240
    sequences) is running when a 2-token call arrives; fair admission gives it the next free
    slot, so it is answered long before the large call ends (arrival order made it wait for all
    240)."""
    eng = AsyncLLMEngine(LLMEngine(EngineArgs(**ENGINE, max_num_seqs=8)))
    s = LiveServer(eng)
    try:
        big = {"prompt": ["a b c"] * 15, "n": 16, "max_tokens": 16, "ignore_eos": True}
        done = {}

        def run_big():
            t = time.monotonic()
            r = httpx.post(s.base + CMPL, json=big, timeout=300)
            done["big"] = (time.monotonic() - t, r.status_code, r.json()["usage"]["completion_tokens"])

        th = threading.Thread(target=run_big)
        started = time.monotonic()
        th.start()
        while metric(s.base, "num_requests_running") < 8:
            time.sleep(0.01)
        t = time.monotonic()
        small = httpx.post(s.base + CMPL, json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True}, timeout=300)
        small_s, small_at = time.monotonic() - t, time.monotonic() - started
        th.join(300)
        big_s, status, tokens = done["big"]
        assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2
        assert status == 200 and tokens == 240 * 16
        assert small_at < big_s / 4 and small_s < big_s / 4, (small_s, small_at, big_s)
        wait_idle(s.base)
    finally:
        s.close()
