"""The OpenAI server over real HTTP (uvicorn on a free localhost port) with the openai client."""

import dataclasses
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from live_server import LiveServer, free_port, metric, wait_idle

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.entrypoints.openai import api_server

KEY = "test-key"
ENGINE = dict(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=400, max_model_len=512)


@pytest.fixture(scope="module")
def server():
    eng = AsyncLLMEngine(LLMEngine(EngineArgs(**ENGINE, enable_prefix_caching=True, max_num_batched_tokens=256)))
    live = LiveServer(eng, api_key=KEY)
    yield live.base, eng
    live.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    return LLM(**ENGINE)


def test_completion_and_chat_match_offline(client, offline):
    r = client.completions.create(model="tiny-mla-swa", prompt="Hello", max_tokens=10, temperature=0)
    want = offline.generate(["Hello"], SamplingParams(max_tokens=10, temperature=0))[0]
    assert r.choices[0].text == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) and r.usage.completion_tokens == 10
    stream = client.completions.create(model="tiny-mla-swa", prompt="Hello", max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.outputs[0].text

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    tok = offline.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    want = offline.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=8, temperature=0))[0]
    r = client.chat.completions.create(model="tiny-mla-swa", messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want.outputs[0].text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(
        client.chat.completions.create(
            model="tiny-mla-swa",
            messages=msgs,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-2].choices[0].finish_reason == "length"


def test_logprobs_formats(client):
    r = client.completions.create(model="tiny-mla-swa", prompt="Hi", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3
    # keyed by text: 2 alternatives + the token, fewer where byte tokens decode alike; greedy: the max
    assert all(
        1 <= len(t) <= 3 and max(t.values()) == v for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    r = client.chat.completions.create(
        model="tiny-mla-swa",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == max(t.logprob for t in content[0].top_logprobs)


def test_16_concurrent_streams_match_alone_and_free_blocks(server, client, offline):
    base, _ = server
    rng = np.random.default_rng(0)
    lens = [int(n) for n in rng.integers(3, 140, 16)]
    lens[:3] = [97, 120, 139]  # beyond 3W
    prompts = [[int(x) for x in rng.integers(4, 500, n)] for n in lens]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [offline.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].text for p in prompts]

    def run(p):
        s = client.completions.create(
            model="tiny-mla-swa", prompt=p, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        return "".join(c.choices[0].text for c in s if c.choices)

    with ThreadPoolExecutor(16) as ex:
        got = list(ex.map(run, prompts))
    assert got == alone
    wait_idle(base)


def test_prefix_cache_hits_show_in_metrics(server, client, offline):
    base, _ = server
    shared = "The cache stores 656 bytes a token: 512 e4m3 values, 4 float32 scales and 64 bf16 values. " * 2
    before = metric(base, "prefix_cache_hits_total")
    outs = [
        client.completions.create(model="tiny-mla-swa", prompt=shared + s, max_tokens=6, temperature=0).choices[0].text
        for s in ("one", "two")
    ]
    assert metric(base, "prefix_cache_hits_total") > before
    want = [
        o.outputs[0].text
        for o in offline.generate([shared + "one", shared + "two"], SamplingParams(max_tokens=6, temperature=0))
    ]
    assert outs == want


def test_disconnect_mid_stream_frees_blocks(server):
    base, _ = server
    aborted = metric(base, 'request_success_total{finished_reason="abort"}')
    body = {
        "model": "tiny-mla-swa",
        "prompt": "Hello",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    wait_idle(base)
    assert metric(base, 'request_success_total{finished_reason="abort"}') == aborted + 1


@pytest.mark.parametrize(
    "path, body, status, field",
    [
        ("/v1/completions", {"model": "tiny-mla-swa"}, 400, "prompt"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": "x " * 600}, 400, "prompt"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": "x", "echo": "yes"}, 400, "echo"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": "x", "frequency_penalty": 3}, 400, "frequency_penalty"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": "x", "bogus": 1}, 400, "bogus"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": [[1, 2], []]}, 400, "prompt.1"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": [1, 99999]}, 400, "prompt"),
        ("/v1/completions", {"model": "tiny-mla-swa", "prompt": []}, 400, "prompt"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/v1/chat/completions", {"model": "tiny-mla-swa", "messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": "tiny-mla-swa", "messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "tiny-mla-swa",
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"model": "tiny-mla-swa", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
    ],
)
def test_bad_requests_name_the_field(server, path, body, status, field):
    base, _ = server
    r = httpx.post(base + path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert field in err["message"] and err["type"]
    ok = httpx.post(
        base + "/v1/completions",
        json={"model": "tiny-mla-swa", "prompt": "x", "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert ok.status_code == 200  # the server keeps serving


def test_invalid_json_auth_health_models(server):
    base, _ = server
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(base + "/v1/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.post(base + "/v1/completions", json={"prompt": "x"}).status_code == 401
    r = httpx.post(base + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert httpx.get(base + "/health").status_code == 200
    models = httpx.get(base + "/v1/models", headers=h).json()
    assert models["data"][0]["id"] == "tiny-mla-swa" and models["data"][0]["max_model_len"] == 512


def test_cli_serves_and_rejects_bad_flags(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "fastdeploy.entrypoints.openai.api_server",
        "--port",
        str(port),
        "--block-size",
        "16",
        "--max-model-len",
        "256",
        "--num-gpu-blocks-override",
        "64",
    ]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        body = {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}  # unseeded sampling may draw EOS
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        p.terminate()
        p.wait(timeout=30)
    bad = subprocess.run([*cmd[:3], "--tensor-parallel-size", "3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "num_attention_heads" in bad.stderr
    ns = api_server.make_parser().parse_args(["--kv-cache-dtype", "fp8", "--enable-prefix-caching"])
    a = EngineArgs.from_cli_args(ns)
    assert a.kv_cache_dtype == "fp8" and a.enable_prefix_caching and a.block_size == 64


def test_help_shows_every_flag_with_its_default():
    env = {**os.environ, "COLUMNS": "400"}  # no wrapping inside a default
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server", "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    flags = 0
    for cls in (api_server.ServerArgs, EngineArgs):
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            start = text.index("\n  " + flag)
            end = text.find("\n  -", start + 1)
            entry = " ".join(text[start:end].split())
            assert f"(default: {f.default})" in entry, entry
            flags += 1
    assert flags == text.count("(default:") == 40  # 12 server settings, 28 engine settings
    ns = api_server.make_parser().parse_args(["--max-model-len", "None", "--no-enable-chunked-prefill", "--port", "9"])
    assert ns.max_model_len is None and ns.enable_chunked_prefill is False and ns.port == 9
    assert api_server.make_parser().parse_args(["--max-model-len", "256"]).max_model_len == 256


def test_multi_turn_chat_keeps_hitting_with_swa_release(server, client):
    """Each turn's prompt is the last one plus the answer and a new message: with SWA blocks
    released during every answer (longer than W = 32), the next turn still finds the last
    prompt's blocks, the window before the hit point included, cached."""
    base, eng = server
    released_before = metric(base, "swa_blocks_released_total")
    messages = [{"role": "user", "content": "Tell me about sliding windows and caches, at length."}]
    last_prompt = 0
    for turn in range(5):
        r = client.chat.completions.create(
            model="tiny-mla-swa", messages=messages, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
        )
        u = r.usage
        assert u.completion_tokens == 40 and u.total_tokens == u.prompt_tokens + 40
        cached = u.prompt_tokens_details.cached_tokens
        if turn:
            assert cached >= last_prompt // 16 * 16 - 32, (turn, cached, last_prompt)
        assert cached < u.prompt_tokens
        last_prompt = u.prompt_tokens
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"And turn {turn + 2}?"},
        ]
    assert metric(base, "swa_blocks_released_total") > released_before
    text = httpx.get(base + "/metrics").text
    for g in ("full", "swa"):
        assert f'fastdeploy:kv_cache_blocks_used{{group="{g}"}} 0' in text
        assert f'fastdeploy:kv_cache_blocks_free{{group="{g}"}} {eng.engine.block_manager.pools[g].num_blocks}' in text
        assert f'fastdeploy:prefix_cache_hit_blocks_total{{group="{g}"}}' in text
    for family in (
        "kv_cache_blocks_used",
        "kv_cache_blocks_free",
        "prefix_cache_hit_blocks_total",
        "request_success_total",
    ):
        # no unlabeled sum beside the parts (PromQL's sum() would count each block twice)
        assert not any(line.startswith(f"fastdeploy:{family} ") for line in text.splitlines()), family
    assert metric(base, "kv_cache_blocks_used") == 0


def test_huge_prompt_does_not_stall_the_event_loop(server):
    """A 4 MB prompt (under the 16 MiB body limit) tokenizes in a worker thread without holding
    the GIL: /health answers promptly meanwhile, and the prompt gets a 400 for its length."""
    base, _ = server
    result = {}

    def big():
        body = {"prompt": "hello world " * 350_000, "max_tokens": 2}
        result["r"] = httpx.post(
            base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
        )

    th = threading.Thread(target=big)
    th.start()
    worst = 0.0
    while th.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(base + "/health", timeout=30).status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.02)
    th.join()
    r = result["r"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert worst < 1.0, worst


def test_docs_follow_the_key_health_and_metrics_stay_open(server):
    base, _ = server
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(base + path).status_code == 401
        assert httpx.get(base + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(base + "/health").status_code == 200 and httpx.get(base + "/metrics").status_code == 200
