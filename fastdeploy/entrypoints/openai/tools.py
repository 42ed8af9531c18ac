"""Checks of the tool-calling fields of a chat request (OpenAI's shapes); each failure is a 400
naming the field. Only function tools exist; ``tool_choice`` "auto" (the default with tools)
parses calls from the text, "none" leaves the text as content, "required" and a named function
constrain the answer to calls in DeepSeek-V3's format by a Lark grammar whose arguments follow
each function's parameter schema (``tool_call_grammar``)."""

from __future__ import annotations

import json
import re

from fastdeploy.entrypoints.openai.protocol import APIError
from fastdeploy.entrypoints.openai.tool_calls import CALL_CLOSE
from fastdeploy.input.tokenizer import TOOL_CALL_BEGIN, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_SEP

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _bad(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param)


def check_tools(tools) -> list[dict]:
    """The request's tools as the chat template takes them: [{"type": "function", "function":
    {"name", "description"?, "parameters"?}}]."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _bad(f"{where}.type", 'only "function" tools are supported')
        extra = sorted(set(t) - {"type", "function"})
        if extra:
            raise _bad(f"{where}.{extra[0]}", "unknown field")
        f = t.get("function")
        if not isinstance(f, dict):
            raise _bad(f"{where}.function", "must be an object")
        extra = sorted(set(f) - {"name", "description", "parameters", "strict"})
        if extra:
            raise _bad(f"{where}.function.{extra[0]}", "unknown field")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(f"{where}.function.name", "required: 1 to 64 letters, digits, '_' or '-'")
        if "description" in f and not isinstance(f["description"], str):
            raise _bad(f"{where}.function.description", "must be a string")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise _bad(f"{where}.function.parameters", "must be a JSON Schema of an object")
        if "strict" in f and not isinstance(f["strict"], bool):
            raise _bad(f"{where}.function.strict", "must be a boolean")
        out.append({"type": "function", "function": {**f, "parameters": params}})
    names = [t["function"]["name"] for t in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise _bad("tools", f"function name {dup!r} is defined twice")
    return out


def check_tool_choice(choice, tools: list[dict], parallel: bool | None = None) -> str | None:
    """None for "none" / "auto" / absent; for "required" or a named function, the Lark grammar
    its answer must follow (one call of the named function; one or more calls of any tool for
    "required", one only when parallel_tool_calls is false)."""
    if choice is None or choice == "none":
        return None
    if not tools:
        raise _bad("tool_choice", "needs tools")
    if choice == "auto":
        return None
    if choice == "required":
        return tool_call_grammar(tools, multiple=parallel is not False)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise _bad("tool_choice.function.name", "must name one of the request's tools")
        return tool_call_grammar(named, multiple=False)
    raise _bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name"}}')


def tool_call_grammar(tools: list[dict], multiple: bool) -> str:
    """Lark (llguidance's dialect): the calls' tags, a listed function's name, its arguments as
    compact JSON of its parameter schema (``%json``)."""
    fns, rules = [], []
    for i, t in enumerate(tools):
        f = t["function"]
        schema = {**f["parameters"], "x-guidance": {"whitespace_flexible": False}}
        fns.append(f"fn{i}")
        rules.append(f"fn{i}: {json.dumps(f['name'] + chr(10) + '```json' + chr(10))} args{i} {json.dumps(CALL_CLOSE)}")
        rules.append(f"args{i}: %json {json.dumps(schema)}")
    more = f" ({json.dumps(chr(10))} call)*" if multiple else ""
    head = [
        f"start: {json.dumps(TOOL_CALLS_BEGIN)} call{more} {json.dumps(TOOL_CALLS_END)}",
        f"call: {json.dumps(TOOL_CALL_BEGIN + 'function' + TOOL_SEP)} ({' | '.join(fns)})",
    ]
    return "\n".join(head + rules)


def check_history_call(call, param: str) -> dict:
    """An assistant message's earlier tool call -> the template's form (arguments a JSON string)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise _bad(param, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
    f = call["function"]
    if not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
        raise _bad(f"{param}.function", "needs a name and arguments (a JSON string)")
    try:
        json.loads(f["arguments"])
    except json.JSONDecodeError:
        raise _bad(f"{param}.function.arguments", "must be a JSON string") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": f["name"], "arguments": f["arguments"]}}
