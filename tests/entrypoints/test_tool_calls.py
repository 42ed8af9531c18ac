"""DeepSeek-V3 tool calls: the whole-text parse, and streaming that does not depend on chunking.
A corpus of generated responses with tool calls (random names, JSON arguments with braces, fences,
newlines and tag fragments inside strings, content before the calls, several calls, cut-off
endings): every split into 2 chunks and 10,000 random multi-chunk splits give exactly the
whole-text calls and content."""

import json
import random
import re

import pytest

from fastdeploy.entrypoints.openai.tool_calls import CALL_CLOSE, ParsedCall, ToolCallStream, parse_tool_calls
from fastdeploy.input.tokenizer import TOOL_CALL_BEGIN as CALL_BEGIN
from fastdeploy.input.tokenizer import TOOL_CALLS_BEGIN as CALLS_BEGIN
from fastdeploy.input.tokenizer import TOOL_CALLS_END, TOOL_SEP

TRICKY = ["{", "}", "```", "\n", "<｜tool▁call▁end｜>"[:5], "```<", "\n```", "é", '\\"', "<｜tool▁sep｜>"[:4]]


def render(content: str, calls: list[tuple[str, str]], end: bool = True) -> str:
    """Text the way DeepSeek-V3 writes it (the chat template's form)."""
    if not calls:
        return content
    body = "\n".join(f"{CALL_BEGIN}function{TOOL_SEP}{n}\n```json\n{a}{CALL_CLOSE}" for n, a in calls)
    return content + CALLS_BEGIN + body + (TOOL_CALLS_END if end else "")


def corpus(n: int = 500) -> list[tuple[str, str, list[ParsedCall]]]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        content = "".join(rng.choice(["Sure", " ", "<", "<｜tool", "ok\n", "é"]) for _ in range(rng.randint(0, 4)))
        calls = []
        for _ in range(rng.randint(1, 3)):
            name = "".join(rng.choice("abcxyz_-0") for _ in range(rng.randint(1, 8)))
            args = json.dumps({"q": "".join(rng.choice(TRICKY + ["a", " "]) for _ in range(rng.randint(0, 6)))})
            calls.append((name, args))
        text = render(content, calls, end=rng.random() < 0.8)
        want = [ParsedCall(n, a) for n, a in calls]
        if rng.random() < 0.15:  # cut off inside the last call's arguments (max_tokens)
            cut = (
                len(text)
                - len(CALL_CLOSE)
                - rng.randint(1, 6)
                - (len(TOOL_CALLS_END) if text.endswith(TOOL_CALLS_END) else 0)
            )
            text = text[: max(cut, text.rfind("```json\n") + 8)]
            want[-1] = ParsedCall(want[-1].name, text[text.rfind("```json\n") + 8 :])
        out.append((text, content, want))
    return out


CORPUS = corpus()


def stream(chunks: list[str]) -> tuple[str, list[ParsedCall]]:
    s = ToolCallStream()
    content, calls = "", []
    for i, c in enumerate(chunks):
        d, deltas = s.feed(c, final=i == len(chunks) - 1)
        content += d
        for idx, name, args in deltas:
            if name is not None:
                assert idx == len(calls)  # a call starts with its name, in order
                calls.append(ParsedCall(name, ""))
            calls[idx].arguments += args
    return content, calls


def test_whole_text_parse():
    for text, content, calls in CORPUS:
        assert parse_tool_calls(text) == (content, calls), text


def test_every_two_chunk_split():
    for text, content, calls in CORPUS:
        for cut in range(len(text) + 1):
            assert stream([text[:cut], text[cut:]]) == (content, calls), (text, cut)


def test_ten_thousand_random_splits():
    rng = random.Random(1)
    for _ in range(10_000):
        text, content, calls = rng.choice(CORPUS)
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(1, min(12, len(text) + 1))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert stream(chunks) == (content, calls), (text, cuts)


@pytest.mark.parametrize(
    "text, want",
    [
        ("no calls here", ("no calls here", [])),
        (CALLS_BEGIN + "garbage", ("", [])),  # an opening tag that forms no call: no content either
        (CALLS_BEGIN + CALL_BEGIN + "function" + TOOL_SEP + "f\n```json\n", ("", [ParsedCall("f", "")])),
    ],
)
def test_edges(text, want):
    assert parse_tool_calls(text) == want


# ---------------------------------------------------------------- through the server

import httpx  # noqa: E402
import openai  # noqa: E402
from live_server import LiveServer, wait_idle  # noqa: E402

from fastdeploy.engine.args import EngineArgs  # noqa: E402
from fastdeploy.engine.async_engine import AsyncLLMEngine  # noqa: E402
from fastdeploy.engine.engine import LLMEngine  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# The random model never writes a call by itself: a regex constraint makes it write one (or two)
# in DeepSeek-V3's format, with a city drawn by the sampler.
ONE_CALL = (
    re.escape(CALLS_BEGIN + CALL_BEGIN + "function" + TOOL_SEP + "get_weather\n```json\n")
    + r'\{"city": "(Paris|Rome|Oslo)"\}'
    + re.escape(CALL_CLOSE)
)
TWO_CALLS = "Let me check\\. " + ONE_CALL + "\n" + ONE_CALL[len(re.escape(CALLS_BEGIN)) :] + re.escape(TOOL_CALLS_END)


@pytest.fixture(scope="module")
def base():
    eng = AsyncLLMEngine(LLMEngine(EngineArgs(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=300)))
    s = LiveServer(eng)
    yield s.base
    s.close()


def chat(base: str, **kw) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 120, "tools": [WEATHER]}
    return httpx.post(base + "/v1/chat/completions", json={**body, **kw}, timeout=120)


def test_server_returns_calls_streamed_equal_to_whole(base):
    for seed in range(4):
        for regex in (ONE_CALL, TWO_CALLS):
            whole = chat(base, seed=seed, guided_regex=regex).json()["choices"][0]
            calls = whole["message"]["tool_calls"]
            assert whole["finish_reason"] == "tool_calls" and len(calls) == (1 if regex is ONE_CALL else 2)
            for c in calls:
                assert (
                    c["type"] == "function" and c["id"].startswith("call_") and c["function"]["name"] == "get_weather"
                )
                assert json.loads(c["function"]["arguments"])["city"] in ("Paris", "Rome", "Oslo")
            assert whole["message"]["content"] == (None if regex is ONE_CALL else "Let me check. ")
            # streamed: deltas with index, id and name first, then argument fragments
            got, content, finish = {}, "", None
            with httpx.stream(
                "POST",
                base + "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Weather in Paris?"}],
                    "max_tokens": 120,
                    "tools": [WEATHER],
                    "seed": seed,
                    "guided_regex": regex,
                    "stream": True,
                },
                timeout=120,
            ) as r:
                lines = [x for x in r.iter_lines() if x.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            for line in lines[:-1]:
                ch = json.loads(line[6:])["choices"][0]
                content += ch["delta"].get("content") or ""
                finish = ch["finish_reason"] or finish
                for d in ch["delta"].get("tool_calls", []):
                    if "id" in d:
                        got[d["index"]] = {"id": d["id"], "type": "function", "function": dict(d["function"])}
                    else:
                        got[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
            assert finish == "tool_calls" and (content or None) == whole["message"]["content"]
            assert [got[i]["function"] for i in sorted(got)] == [c["function"] for c in calls]
    wait_idle(base)


def test_tool_choice_none_and_plain_answers(base):
    r = chat(base, seed=1, guided_regex=ONE_CALL, tool_choice="none").json()["choices"][0]
    assert r["finish_reason"] == "stop" and "tool_calls" not in r["message"]
    assert CALLS_BEGIN in r["message"]["content"]  # "none": the text stays content
    r = chat(base, seed=1, max_tokens=8).json()["choices"][0]
    assert r["message"]["tool_calls"] == [] and r["finish_reason"] in ("stop", "length")


def test_history_renders_as_the_template_specifies(base):
    """An assistant call and its tool result in the history: the prompt's tokens are those of the
    DeepSeek-V3 rendering written out here by hand (prompt_tokens counts them)."""
    from fastdeploy.input.tokenizer import Tokenizer
    from fastdeploy.tools.tiny_checkpoint import resolve_model

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    params = json.dumps(WEATHER["function"]["parameters"], sort_keys=True)
    want = (
        "<｜begin▁of▁sentence｜>## Tools\nYou have access to the following tools:\n\n### get_weather\n"
        f"Description: Weather in a city\n\nParameters: {params}\n"
        "<｜User｜>Weather?<｜Assistant｜>" + CALLS_BEGIN + CALL_BEGIN + "function" + TOOL_SEP + "get_weather\n"
        '```json\n{"city": "Oslo"}' + CALL_CLOSE + TOOL_CALLS_END + "<｜end▁of▁sentence｜>"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    )
    tok = Tokenizer(resolve_model("tiny-mla-swa"))
    r = httpx.post(
        base + "/v1/chat/completions",
        json={"messages": messages, "tools": [WEATHER], "max_tokens": 2},
        timeout=60,
    ).json()
    assert r["usage"]["prompt_tokens"] == len(tok.encode(want, add_special_tokens=False))


@pytest.mark.parametrize(
    "tools, param",
    [
        ([{"type": "function", "function": {"description": "no name"}}], "tools.0.function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            "tools.0.function.parameters",
        ),
        ([{"type": "retrieval"}], "tools.0.type"),
        ([{"type": "function", "function": {"name": "bad name"}}], "tools.0.function.name"),
        ([WEATHER, WEATHER], "tools"),
        ("f", "tools"),
    ],
)
def test_bad_tool_definitions_are_400s(base, tools, param):
    r = httpx.post(
        base + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "tools": tools},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_openai_client_tools(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    kw = dict(
        model="tiny-mla-swa",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="auto",
        max_tokens=120,
        seed=3,
        extra_body={"guided_regex": ONE_CALL},
    )
    r = client.chat.completions.create(**kw)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    args = ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            args += d.function.arguments or ""
    assert args == call.function.arguments
    wait_idle(base)


CLOCK = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "label": {"type": "string", "maxLength": 4},
            },
            "required": ["hour"],
            "additionalProperties": False,
        },
    },
}
STRICT_WEATHER = {
    "type": "function",
    "function": {
        **WEATHER["function"],
        "parameters": {
            **WEATHER["function"]["parameters"],
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "additionalProperties": False,
        },
    },
}


def test_named_and_required_tool_choice_always_call_with_valid_arguments(base):
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (CLOCK, STRICT_WEATHER)}
    multi_done = 0
    for seed in range(4):
        named = {"type": "function", "function": {"name": "set_alarm"}}
        for choice, parallel, count in ((named, None, {1}), ("required", False, {1}), ("required", None, None)):
            extra = {} if parallel is None else {"parallel_tool_calls": parallel}
            r = chat(base, seed=seed, tools=[STRICT_WEATHER, CLOCK], tool_choice=choice, max_tokens=200, **extra)
            c = r.json()["choices"][0]
            calls = c["message"]["tool_calls"]
            if count is None and c["finish_reason"] == "length":
                continue  # any number of calls: the random model may keep adding them
            multi_done += count is None
            assert c["finish_reason"] == "tool_calls" and calls and (count is None or len(calls) in count), c
            for call in calls:
                name = call["function"]["name"]
                assert name == "set_alarm" or choice == "required"
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
            assert c["message"]["content"] is None
    assert multi_done >= 2
    bad = chat(base, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice.function.name"
    both = chat(base, tool_choice="required", response_format={"type": "json_object"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "response_format"
    wait_idle(base)
