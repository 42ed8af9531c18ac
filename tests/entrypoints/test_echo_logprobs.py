"""What evaluation harnesses send: echo, max_tokens 0, logprobs over the echoed prompt, vLLM's
prompt_logprobs, and vLLM's /tokenize, /detokenize and /tokenizer_info; over real HTTP against
the offline engine's values."""

import httpx
import openai
import pytest
from live_server import LiveServer, wait_idle

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.engine.engine import LLMEngine

ENGINE = dict(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=300, max_model_len=256)
PROMPT = "Sliding windows keep the cache small while the context grows long enough to matter."


@pytest.fixture(scope="module")
def server():
    eng = AsyncLLMEngine(LLMEngine(EngineArgs(**ENGINE, enable_prefix_caching=True, max_num_batched_tokens=24)))
    live = LiveServer(eng)
    yield live.base
    live.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    return LLM(**ENGINE)


def offline_prompt_logprobs(offline, ids, k):
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k)
    return offline.generate({"prompt_token_ids": ids}, sp)[0]


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(client, offline, server):
    """lm-evaluation-harness's log-likelihood request: the prompt back with each token's logprob
    (the first None), no completion tokens, finish_reason "length"; twice, so the second finds the
    prompt cached and must still compute every logprob."""
    tok = offline.get_tokenizer()
    ids = tok.encode(PROMPT)
    want = offline_prompt_logprobs(offline, ids, 2)
    for _ in range(2):
        r = client.completions.create(model="tiny-mla-swa", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
        c = r.choices[0]
        assert c.text == PROMPT and c.finish_reason == "length"
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
        assert c.logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
        for p in range(1, len(ids)):
            assert c.logprobs.token_logprobs[p] == pytest.approx(want.prompt_logprobs[p][ids[p]], abs=3e-3)
            # keyed by text, as OpenAI's format is (byte tokens that decode alike share a key)
            top = {tok.decode([t], skip_special_tokens=False): v for t, v in want.prompt_logprobs[p].items()}
            assert c.logprobs.top_logprobs[p].keys() == top.keys()
            assert list(c.logprobs.top_logprobs[p].values()) == pytest.approx(list(top.values()), abs=3e-3)
    wait_idle(server)


def test_echo_with_generation_streamed_equals_non_streamed(client, offline):
    """echo + generated tokens: text is prompt + completion, logprobs cover both; the stream's
    concatenation equals the whole answer; token-id prompts echo their decoded text."""
    tok = offline.get_tokenizer()
    ids = tok.encode("Tell me about windows")
    kw = dict(model="tiny-mla-swa", prompt=ids, max_tokens=5, echo=True, logprobs=1, temperature=0)
    r = client.completions.create(**kw)
    gen = offline.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=5, temperature=0))[0].outputs[0]
    prompt_text = tok.decode(ids, skip_special_tokens=False)
    c = r.choices[0]
    assert c.text == prompt_text + gen.text
    assert len(c.logprobs.tokens) == len(ids) + 5 and r.usage.completion_tokens == 5
    assert c.logprobs.text_offset[0] == 0 and c.logprobs.token_logprobs[0] is None
    chunks = [ch.choices[0] for ch in client.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(ch.text for ch in chunks) == c.text
    assert sum((ch.logprobs.tokens for ch in chunks), []) == c.logprobs.tokens
    streamed = sum((ch.logprobs.token_logprobs for ch in chunks), [])
    assert streamed[0] is None and streamed[1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=3e-3)


def test_echo_with_batched_prompts_and_n(client):
    r = client.completions.create(
        model="tiny-mla-swa", prompt=["one two", "three four five"], max_tokens=0, echo=True, n=2
    )
    assert [c.text for c in r.choices] == ["one two", "one two", "three four five", "three four five"]
    assert r.usage.completion_tokens == 0 and all(c.logprobs is None for c in r.choices)


def test_vllm_prompt_logprobs_field(server, offline):
    ids = offline.get_tokenizer().encode(PROMPT)
    want = offline_prompt_logprobs(offline, ids, 3)
    body = {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 3, "temperature": 0}
    r = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for p in range(1, len(ids)):
        entry = plp[p][str(ids[p])]
        assert entry["logprob"] == pytest.approx(want.prompt_logprobs[p][ids[p]], abs=3e-3)
        assert abs(entry["rank"] - want.prompt_ranks[p]) <= 2  # FP8 window cache: near-ties may swap
        ranks = sorted(v["rank"] for t, v in plp[p].items() if int(t) != ids[p])
        assert ranks == list(range(1, len(ranks) + 1)) and len(plp[p]) in (3, 4)
    assert r["choices"][0]["logprobs"] is None and r["usage"]["completion_tokens"] == 2
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0}
    r = httpx.post(server + "/v1/chat/completions", json=chat, timeout=60).json()
    assert r["prompt_logprobs"][0] is None and all(len(e) == 1 for e in r["prompt_logprobs"][1:])
    assert len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "echo": 1}, "echo"),
    ],
)
def test_bad_echo_and_prompt_logprobs_values_are_400s(server, body, param):
    r = httpx.post(server + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_tokenize_detokenize_and_tokenizer_info(server, offline):
    tok = offline.get_tokenizer()
    r = httpx.post(server + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert r["token_strs"] == [tok.decode([t], skip_special_tokens=False) for t in r["tokens"]]
    plain = httpx.post(server + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(PROMPT, add_special_tokens=False) and plain["token_strs"] is None
    msgs = [{"role": "user", "content": "hello"}]
    chat = httpx.post(server + "/tokenize", json={"messages": msgs}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    back = httpx.post(server + "/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    info = httpx.get(server + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] and info["model_max_length"] == 256
    for path, body, param in [
        ("/detokenize", {"tokens": [tok.vocab_size]}, "tokens.0"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens.1"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/tokenize", {"prompt": 3}, "prompt"),
    ]:
        r = httpx.post(server + path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, body, r.text)
    lone = httpx.post(
        server + "/tokenize", content=b'{"prompt": "a\\ud800"}', headers={"content-type": "application/json"}
    )
    assert lone.status_code == 400 and lone.json()["error"]["param"] == "prompt"
    lone_model = b'{"tokens": [1], "model": "x\\udc00"}'
    lone = httpx.post(server + "/detokenize", content=lone_model, headers={"content-type": "application/json"})
    assert lone.status_code == 400 and lone.json()["error"]["param"] == "model"
