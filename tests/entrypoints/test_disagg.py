"""Prefill and decode on separate servers behind the proxy (docs/design.md §4.20): three servers on
127.0.0.1 (a prefill instance, a decode instance, and a single server to compare with) and the
proxy, the KV moved by Mooncake's transfer engine over TCP. Every block is free on both instances
after each case, and both keep serving after each fault."""

import json
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn
from live_server import LiveServer, free_port, metric

from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.entrypoints.disagg_proxy import build_proxy

W, BS = 32, 16
KW = dict(model="tiny-mla-swa", block_size=BS, num_gpu_blocks_override=64, max_model_len=256)
KW.update(enable_prefix_caching=True, max_num_batched_tokens=40)  # chunked prefill: chunks of 40 (above W)
KV = '{"kv_connector": "MooncakeConnector", "kv_role": "%s", "kv_timeout": %s}'


class Proxy:
    def __init__(self, prefill: str, decode: str, timeout: float = 30) -> None:
        port = free_port()
        cfg = uvicorn.Config(build_proxy(prefill, decode, timeout), host="127.0.0.1", port=port, log_level="warning")
        self.srv = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.srv.run, daemon=True)
        self.thread.start()
        while not self.srv.started:
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.srv.should_exit = True
        self.thread.join(timeout=10)


def server(kv: str | None = None) -> LiveServer:
    return LiveServer(AsyncLLMEngine(LLMEngine(EngineArgs(**KW, kv_transfer_config=kv))))


@pytest.fixture(scope="module")
def pd():
    one, pre, dec = server(), server(KV % ("kv_producer", 30)), server(KV % ("kv_consumer", 3))
    proxy = Proxy(pre.base, dec.base)
    yield one, pre, dec, proxy
    proxy.close()
    for s in (one, pre, dec):
        s.close()


def all_free(*servers) -> None:
    deadline = time.time() + 10
    while time.time() < deadline:
        if all(metric(s.base, "kv_cache_blocks_used") == 0 for s in servers):
            return
        time.sleep(0.05)
    raise AssertionError([metric(s.base, "kv_cache_blocks_used") for s in servers])


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/{path}", json=body, timeout=120)


def test_through_the_proxy_a_completion_is_one_servers(pd, rng):
    """Prompts past 3W as token ids, greedy with top logprobs: the same tokens, logprobs and usage
    as one server; a second prompt extending the first hits both instances' prefix caches; the
    SWA layers' blocks sent are the window's only."""
    one, pre, dec, proxy = pd
    first = [int(x) for x in rng.integers(2, 500, 3 * W + 9)]
    prompts = [first, first + [int(x) for x in rng.integers(2, 500, 40)]]
    kv = pre.engine.engine.kv
    for p in prompts:
        body = {"model": "tiny-mla-swa", "prompt": p, "max_tokens": 12, "temperature": 0, "logprobs": 3}
        body["ignore_eos"] = True
        sent = dict(kv.blocks_sent)
        a, b = post(proxy.base, "completions", body).json(), post(one.base, "completions", body).json()
        assert a["usage"] == b["usage"] and a["usage"]["completion_tokens"] == 12, a
        ca, cb = a["choices"][0], b["choices"][0]
        assert ca["text"] == cb["text"] and ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]
        np.testing.assert_allclose(ca["logprobs"]["token_logprobs"], cb["logprobs"]["token_logprobs"], atol=1e-5)
        swa = kv.blocks_sent["swa"] - sent.get("swa", 0)
        assert swa <= -(-W // BS) + 1  # the window's blocks (W + the partial last block), not the prompt's
    assert metric(dec.base, "prefix_cache_hits_total") > 0 and metric(pre.base, "prefix_cache_hits_total") > 0
    all_free(pre, dec)


def test_through_the_proxy_streams_samples_and_chats_are_one_servers(pd):
    """A stream ends in data: [DONE] with one server's text; n = 2 seeded samples and a chat
    completion give one server's choices."""
    one, pre, dec, proxy = pd
    body = {"model": "tiny-mla-swa", "prompt": "The lighthouse keeper " * 9, "max_tokens": 10, "temperature": 0}
    with httpx.stream("POST", proxy.base + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1] if json.loads(x[6:])["choices"])
    assert text == post(one.base, "completions", body).json()["choices"][0]["text"]
    sampled = {**body, "n": 2, "seed": 11, "temperature": 0.9}
    got = sorted((c["index"], c["text"]) for c in post(proxy.base, "completions", sampled).json()["choices"])
    assert got == sorted((c["index"], c["text"]) for c in post(one.base, "completions", sampled).json()["choices"])
    chat = {"model": "tiny-mla-swa", "messages": [{"role": "user", "content": "Tell a story " * 8}], "max_tokens": 9}
    chat["temperature"] = 0
    a, b = post(proxy.base, "chat/completions", chat).json(), post(one.base, "chat/completions", chat).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"] and a["usage"] == b["usage"]
    all_free(pre, dec)


def test_through_the_proxy_echo_and_prompt_logprobs_are_one_servers(pd, rng):
    """echo with logprobs (the prompt's tokens and logprobs first) and vLLM's prompt_logprobs, on
    a prompt past 2W, completions and chat: the prefill instance computes them and they travel
    with the first token, so the response is one server's; prompt logprobs that are not one entry
    a prompt token, or missing where asked for, are a 400."""
    one, pre, dec, proxy = pd
    prompt = [int(x) for x in rng.integers(2, 500, 2 * W + BS + 3)]
    body = {"model": "tiny-mla-swa", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    for extra in ({"echo": True, "logprobs": 2}, {"prompt_logprobs": 3, "logprobs": 1}):
        a, b = (
            post(proxy.base, "completions", {**body, **extra}).json(),
            post(one.base, "completions", {**body, **extra}).json(),
        )
        ca, cb = a["choices"][0], b["choices"][0]
        assert ca["text"] == cb["text"] and a["usage"] == b["usage"]
        assert ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]
        assert ca["logprobs"]["top_logprobs"][0] == cb["logprobs"]["top_logprobs"][0]  # None for the first token
        got, want = ca["logprobs"]["token_logprobs"], cb["logprobs"]["token_logprobs"]
        assert (got[0], want[0]) == (None, None) if "echo" in extra else len(got) == 5
        np.testing.assert_allclose(got[1:], want[1:], atol=1e-5)
        if "prompt_logprobs" in extra:
            pa, pb = ca["prompt_logprobs"], cb["prompt_logprobs"]
            assert pa[0] is None and len(pa) == len(prompt) == len(pb)
            for ea, eb in zip(pa[1:], pb[1:], strict=True):
                assert {t: e["rank"] for t, e in ea.items()} == {t: e["rank"] for t, e in eb.items()}
                np.testing.assert_allclose(
                    [e["logprob"] for e in ea.values()], [e["logprob"] for e in eb.values()], atol=1e-5
                )
    chat = {"model": "tiny-mla-swa", "messages": [{"role": "user", "content": "Rivers " * 30}], "max_tokens": 4}
    chat.update(temperature=0, prompt_logprobs=1)
    a, b = post(proxy.base, "chat/completions", chat).json(), post(one.base, "chat/completions", chat).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert [e and sorted(e) for e in a["prompt_logprobs"]] == [e and sorted(e) for e in b["prompt_logprobs"]]
    res = post(dec.base, "kv/reserve", {"path": "completions", "body": {**body, "prompt_logprobs": 1}}).json()
    short = {"token_id": 5, "prompt_logprobs": [None], "prompt_ranks": [None]}
    r = post(dec.base, "kv/continue", {"handle": res["handle"], "first_tokens": [short]})
    assert r.status_code == 400 and "one entry a prompt token" in r.json()["error"]["message"]
    res = post(dec.base, "kv/reserve", {"path": "completions", "body": {**body, "prompt_logprobs": 1}}).json()
    r = post(dec.base, "kv/continue", {"handle": res["handle"], "first_tokens": [{"token_id": 5}]})
    assert r.status_code == 400 and "asked for and missing" in r.json()["error"]["message"]
    all_free(pre, dec)


def test_faults_free_every_block_and_both_instances_serve_on(pd, rng):
    """A prefill instance that is unreachable (502), a reservation never continued (freed after
    kv_timeout, then a 408), malformed first tokens (a token or draft outside the vocabulary
    included) and malformed targets (400s), a client that
    leaves a stream through the proxy: each an OpenAI-shaped error (or an abort), every block free
    on both sides, and the next request served."""
    one, pre, dec, proxy = pd
    prompt = [int(x) for x in rng.integers(2, 500, 80)]
    body = {"model": "tiny-mla-swa", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    dead = Proxy("http://127.0.0.1:9", dec.base, timeout=5)
    try:
        r = post(dead.base, "completions", body)
        assert r.status_code == 502 and "prefill instance" in r.json()["error"]["message"]
    finally:
        dead.close()
    all_free(dec)
    handle = post(dec.base, "kv/reserve", {"path": "completions", "body": body}).json()["handle"]
    assert metric(dec.base, "kv_cache_blocks_used") > 0
    time.sleep(3.7)  # the decode instance's kv_timeout is 3 s
    all_free(dec)
    r = post(dec.base, "kv/continue", {"handle": handle, "first_tokens": [{"token_id": 5}]})
    assert r.status_code == 408 and r.json()["error"]["param"] == "handle"
    res = post(dec.base, "kv/reserve", {"path": "completions", "body": body}).json()
    r = post(dec.base, "kv/continue", {"handle": res["handle"], "first_tokens": [{"token": 1}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "first_tokens"
    for bad in ({"token_id": 10**6}, {"token_id": 5, "draft_token_ids": [3, -1]}):  # outside the vocabulary
        res = post(dec.base, "kv/reserve", {"path": "completions", "body": body}).json()
        r = post(dec.base, "kv/continue", {"handle": res["handle"], "first_tokens": [bad]})
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    all_free(dec)
    bad = {**body, "max_tokens": 1, "kv_transfer_params": {"targets": [{"session": "x"}]}}
    r = post(pre.base, "completions", bad)
    assert r.status_code == 400 and "not a KV target" in r.json()["error"]["message"]
    r = post(dec.base, "kv/reserve", {"path": "completions", "body": {**body, "max_tokens": -1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    all_free(pre, dec)
    stream = {**body, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", proxy.base + "/v1/completions", json=stream, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 4:
                break  # the client goes away mid-generation: the decode instance aborts
    all_free(pre, dec)
    ok = post(proxy.base, "completions", body).json()
    assert ok["choices"][0]["text"] == post(one.base, "completions", body).json()["choices"][0]["text"]
    all_free(pre, dec)


def test_the_proxys_own_endpoints_and_what_it_refuses(pd):
    """/health and /v1/models through the proxy; a body that is not a JSON object, an unreachable
    decode instance (502, and /health 503), a prefill body with the wrong number of targets or
    more than one token (400s); min_tokens kept for the first token."""
    one, pre, dec, proxy = pd
    assert httpx.get(proxy.base + "/health").status_code == 200
    assert httpx.get(proxy.base + "/v1/models").json()["data"][0]["id"] == "tiny-mla-swa"
    r = httpx.post(proxy.base + "/v1/completions", content=b"[1]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    body = {"model": "tiny-mla-swa", "prompt": "A tale of two cities " * 5, "max_tokens": 6, "temperature": 0}
    no_decode = Proxy(pre.base, "http://127.0.0.1:9", timeout=5)
    try:
        assert httpx.get(no_decode.base + "/health").status_code == 503
        assert httpx.get(no_decode.base + "/v1/models").status_code == 502
        r = post(no_decode.base, "completions", body)
        assert r.status_code == 502 and "decode instance" in r.json()["error"]["message"]
    finally:
        no_decode.close()
    r = post(pre.base, "completions", {**body, "max_tokens": 1, "kv_transfer_params": {"targets": []}})
    assert r.status_code == 400 and "1 KV targets expected" in r.json()["error"]["message"]
    res = post(dec.base, "kv/reserve", {"path": "completions", "body": body}).json()
    r = post(pre.base, "completions", {**body, "max_tokens": 2, "kv_transfer_params": {"targets": res["targets"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert post(dec.base, "kv/cancel", {"handle": res["handle"]}).json() == {"cancelled": True}
    assert post(dec.base, "kv/cancel", {"handle": res["handle"]}).json() == {"cancelled": False}
    res = post(dec.base, "kv/reserve", {"path": "completions", "body": body}).json()
    r = post(dec.base, "kv/continue", {"handle": res["handle"], "first_tokens": []})
    assert r.status_code == 400 and "1 expected" in r.json()["error"]["message"]
    r = post(dec.base, "kv/reserve", {"path": "embeddings", "body": body})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    r = httpx.post(dec.base + "/v1/kv/reserve", content=b"1", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    held = {**body, "min_tokens": 3, "stop_token_ids": list(range(500))}
    got, want = post(proxy.base, "completions", held).json(), post(one.base, "completions", held).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"] and got["usage"] == want["usage"]
    all_free(pre, dec)
