"""Structured outputs through the server (live, tiny random model): response_format json_object /
json_schema on both endpoints, vLLM's guided_* and structured_outputs, the openai client streamed
and not; every answer that finishes with "stop" satisfies its constraint (jsonschema, re, choice
membership), streaming equals non-streaming for a seed, invalid constraints are 400s naming the
field, and the engine holds no KV block afterwards."""

import json
import re

import httpx
import jsonschema
import openai
import pytest
from live_server import LiveServer, wait_idle

from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.engine.engine import LLMEngine

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def base():
    eng = AsyncLLMEngine(
        LLMEngine(EngineArgs(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=400, max_model_len=512))
    )
    s = LiveServer(eng)
    yield s.base
    s.close()


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def streamed(base: str, path: str, body: dict) -> tuple[str, str | None, list[str]]:
    """(text, finish_reason, raw data lines) of a streamed request; the raw lines end in [DONE]."""
    text, finish, lines = "", None, []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line)
            if line == "data: [DONE]":
                break
            ch = json.loads(line[6:])["choices"]
            if ch:
                text += ch[0].get("text") or ch[0].get("delta", {}).get("content") or ""
                finish = ch[0].get("finish_reason") or finish
    return text, finish, lines


def test_json_schema_answers_validate_on_both_endpoints(base):
    done = 0
    for seed in range(12):
        body = {"prompt": "Person:", "max_tokens": 80, "temperature": 1.0, "seed": seed, "response_format": RF}
        r = post(base, CMPL, body).json()
        c = r["choices"][0]
        assert c["finish_reason"] in ("stop", "length")
        if c["finish_reason"] == "stop":
            jsonschema.validate(json.loads(c["text"]), SCHEMA)
            done += 1
        chat = {"messages": [{"role": "user", "content": "a person"}], "max_tokens": 80, "seed": seed}
        m = post(base, CHAT, {**chat, "response_format": RF}).json()["choices"][0]
        if m["finish_reason"] == "stop":
            jsonschema.validate(json.loads(m["message"]["content"]), SCHEMA)
            done += 1
    assert done >= 20  # nearly all finish well inside 80 tokens
    wait_idle(base)


def test_streaming_equals_non_streaming(base):
    for path, body in (
        (CMPL, {"prompt": "Person:", "max_tokens": 80, "seed": 7, "response_format": RF}),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 80, "seed": 7, "response_format": RF}),
        (CMPL, {"prompt": "n:", "max_tokens": 20, "seed": 3, "guided_regex": r"[0-9]{2,4}(-[a-z]{2})?"}),
    ):
        whole = post(base, path, body).json()["choices"][0]
        text = whole.get("text", whole.get("message", {}).get("content"))
        s_text, s_finish, lines = streamed(base, path, body)
        assert (s_text, s_finish) == (text, whole["finish_reason"]) and lines[-1] == "data: [DONE]"
    wait_idle(base)


def test_vllm_fields_regex_choice_json_object(base):
    choices = ["yes", "no", "don't know"]
    for seed in range(6):
        common = {"prompt": "Q:", "max_tokens": 30, "seed": seed, "temperature": 1.0}
        c = post(base, CMPL, {**common, "guided_choice": choices}).json()["choices"][0]
        assert c["text"] in choices and c["finish_reason"] == "stop"
        c = post(base, CMPL, {**common, "structured_outputs": {"choice": choices}}).json()["choices"][0]
        assert c["text"] in choices
        c = post(base, CMPL, {**common, "guided_regex": r"[0-9]{3}-[a-z]{2}"}).json()["choices"][0]
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", c["text"]) and c["finish_reason"] == "stop"
        body = {**common, "max_tokens": 200, "response_format": {"type": "json_object"}}
        c = post(base, CMPL, body).json()["choices"][0]
        if c["finish_reason"] == "stop":
            assert isinstance(json.loads(c["text"]), dict)
        c = post(base, CMPL, {**common, "guided_json": {"type": "integer", "minimum": 5, "maximum": 9}}).json()
        assert 5 <= json.loads(c["choices"][0]["text"]) <= 9
    wait_idle(base)


def test_n_stop_strings_length_and_logprobs(base):
    body = {"prompt": "P:", "max_tokens": 80, "n": 3, "seed": 1, "response_format": RF, "logprobs": 2}
    r = post(base, CMPL, body).json()
    assert len(r["choices"]) == 3
    for c in r["choices"]:
        if c["finish_reason"] == "stop":
            jsonschema.validate(json.loads(c["text"]), SCHEMA)
        lp = c["logprobs"]["token_logprobs"]
        assert len(lp) == len(c["logprobs"]["tokens"]) and all(x <= 0 and x > -1e4 for x in lp)
    assert r["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in r["choices"])
    # max_tokens reached: "length", the text a cut-off JSON document (documented as incomplete)
    c = post(base, CMPL, {"prompt": "P:", "max_tokens": 3, "seed": 2, "response_format": RF}).json()["choices"][0]
    assert c["finish_reason"] == "length" and c["text"].startswith("{")
    # a stop string inside the constrained text ends it there, as without a constraint
    body = {"prompt": "P:", "max_tokens": 80, "seed": 4, "response_format": RF, "stop": ['"age"']}
    c = post(base, CMPL, body).json()["choices"][0]
    assert c["finish_reason"] == "stop" and '"age"' not in c["text"] and c["text"].startswith('{"name"')
    wait_idle(base)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, None),
        ({"guided_regex": "("}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
    ],
)
def test_invalid_constraints_are_400s_naming_the_field(base, extra, param):
    r = post(base, CMPL, {"prompt": "x", "max_tokens": 4, **extra})
    err = r.json()["error"]
    want = param or "response_format.json_schema"
    assert r.status_code == 400 and err["param"] == want and err["message"].startswith(want), err
    assert post(base, CMPL, {"prompt": "x", "max_tokens": 2}).status_code == 200  # still serving


def test_openai_client_json_schema_streamed_and_not(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    kw = dict(
        model="tiny-mla-swa",
        messages=[{"role": "user", "content": "a person"}],
        max_tokens=80,
        seed=11,
        response_format=RF,
    )
    whole = client.chat.completions.create(**kw)
    text = whole.choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(parts) == text
    if whole.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(text), SCHEMA)
    wait_idle(base)
