"""--reasoning-parser deepseek_r1: the split of <think> ... </think> into reasoning_content and
content, whole and streamed. Streaming must not depend on how the text is chunked: for any text
made of tag fragments and words and any chunking, the concatenated deltas equal the whole-text
split (Hypothesis). The server carries the fields on chat, streamed equal to non-streamed, and a
response_format constrains only what follows </think>."""

import json

import httpx
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from live_server import LiveServer, wait_idle

from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.entrypoints.openai.reasoning import ReasoningStream, split_reasoning

PIECES = ["<think>", "</think>", "<thi", "</thi", "<", "/", "think", ">", "a", "b c", "\n", "é", "</think>x"]


@pytest.mark.parametrize(
    "text, want",
    [
        ("<think>why</think>answer", ("why", "answer")),
        ("why</think>answer", ("why", "answer")),  # R1's template opens the block in the prompt
        ("<think>still thinking", ("still thinking", "")),  # cut off: all reasoning (vLLM)
        ("</think>", ("", "")),
        ("<think></think>", ("", "")),
        ("a</think>b</think>c", ("a", "b</think>c")),  # the first end tag ends the reasoning
        ("<think><think>x</think>", ("<think>x", "")),
        ("", ("", "")),
    ],
)
def test_split(text, want):
    assert split_reasoning(text) == want


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    edges = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(edges, edges[1:], strict=False)]


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12), st.lists(st.integers(0, 200), max_size=10))
def test_streamed_deltas_concatenate_to_the_split(parts, cuts):
    text = "".join(parts)
    s = ReasoningStream()
    chunks = chunked(text, cuts) or [""]
    got_r = got_c = ""
    want_r, want_c = split_reasoning(text)
    for i, c in enumerate(chunks):
        r, t = s.feed(c, final=i == len(chunks) - 1)
        got_r, got_c = got_r + r, got_c + t
        assert want_r.startswith(got_r) and want_c.startswith(got_c)  # nothing sent is taken back
    assert (got_r, got_c) == (want_r, want_c)


def test_every_two_chunk_split_of_a_corpus():
    texts = ["<think>a</think>b", "x</thi", "<thinker>", "</think></think>", "<think>é</think>\n\nok", "<t</think>"]
    for text in texts:
        for cut in range(len(text) + 1):
            s = ReasoningStream()
            r1, c1 = s.feed(text[:cut], final=False)
            r2, c2 = s.feed(text[cut:], final=True)
            assert (r1 + r2, c1 + c2) == split_reasoning(text), (text, cut)


@pytest.fixture(scope="module")
def base():
    eng = AsyncLLMEngine(LLMEngine(EngineArgs(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=200)))
    s = LiveServer(eng, reasoning_parser="deepseek_r1")
    yield s.base
    s.close()


def test_server_chat_carries_reasoning_content(base):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "seed": 5, "temperature": 1.0}
    whole = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()
    msg = whole["choices"][0]["message"]
    assert set(msg) >= {"role", "content", "reasoning_content"}
    # the random model never writes </think>: its whole answer is reasoning, as vLLM splits it
    assert msg["content"] is None and msg["reasoning_content"]
    r = c = ""
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        lines = [x for x in s.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for ch in json.loads(line[6:])["choices"]:
            r += ch["delta"].get("reasoning_content") or ""
            c += ch["delta"].get("content") or ""
    assert (r, c or None) == (msg["reasoning_content"], msg["content"])
    # completions are untouched by the parser
    cmpl = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60).json()
    assert "reasoning_content" not in cmpl["choices"][0]
    wait_idle(base)


def think_end(base: str) -> int:
    """The id of the one token that spells </think> (the server's tokenizer)."""
    (end,) = httpx.post(base + "/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()["tokens"]
    return end


def one_key(key: str, spec: dict) -> dict:
    return {"type": "object", "properties": {key: spec}, "required": [key], "additionalProperties": False}


def test_json_schema_applies_after_the_reasoning(base):
    """With the parser on, a response_format constrains only the content: the reasoning before
    </think> is free, the content validates, streamed equal to non-streamed. </think> is nudged
    by logit_bias so the random model writes it after a few free tokens."""
    end = think_end(base)
    schema = one_key("a", {"type": "integer"})
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    free = 0
    for seed in range(6):
        body = {
            "messages": [{"role": "user", "content": "think, then answer"}],
            "max_tokens": 40,
            "seed": seed,
            "response_format": rf,
            "logit_bias": {str(end): 5.0},
        }
        msg = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        if msg["finish_reason"] == "stop":
            jsonschema.validate(json.loads(msg["message"]["content"]), schema)
            free += bool(msg["message"]["reasoning_content"])
        r = c = ""
        with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:])["choices"]:
                        r += ch["delta"].get("reasoning_content") or ""
                        c += ch["delta"].get("content") or ""
        assert (r or None, c or None) == (msg["message"]["reasoning_content"], msg["message"]["content"])
    assert free >= 2
    wait_idle(base)


def test_forced_tool_choice_applies_after_the_reasoning(base):
    """A named tool_choice with the parser on: the call grammar starts after </think>; every
    answer that finishes is exactly one call of the named tool with schema-valid arguments, and
    its reasoning is kept apart."""
    end = think_end(base)
    params = one_key("hour", {"type": "integer", "minimum": 0, "maximum": 23})
    tool = {"type": "function", "function": {"name": "set_alarm", "parameters": params}}
    finished = 0
    for seed in range(6):
        body = {
            "messages": [{"role": "user", "content": "wake me"}],
            "max_tokens": 120,
            "seed": seed,
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "set_alarm"}},
            "logit_bias": {str(end): 3.0},
        }
        c = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        if c["finish_reason"] == "length":
            continue
        finished += 1
        assert c["finish_reason"] == "tool_calls", c
        (call,) = c["message"]["tool_calls"]
        assert call["function"]["name"] == "set_alarm"
        jsonschema.validate(json.loads(call["function"]["arguments"]), params)
        assert "</think>" not in (c["message"]["reasoning_content"] or "")
    assert finished >= 3
    wait_idle(base)
