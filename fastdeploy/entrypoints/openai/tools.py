"""Checks of the tool-calling fields of a chat request (OpenAI's shapes); each failure is a 400
naming the field. Only function tools exist; ``tool_choice`` "auto" (the default with tools)
parses calls from the text, "none" leaves the text as content; "required" and a named function
need the call constrained by a grammar, which is not built yet (a 400 says so)."""

from __future__ import annotations

import json
import re

from fastdeploy.entrypoints.openai.protocol import APIError

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


def check_tool_choice(choice, tools: list[dict]) -> None:
    if choice is None or choice == "auto" or choice == "none":
        if choice is not None and not tools and choice != "none":
            raise _bad("tool_choice", '"auto" needs tools')
        return
    if choice == "required" or isinstance(choice, dict):
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if name not in [t["function"]["name"] for t in tools]:
                raise _bad("tool_choice", "must name one of the request's tools")
        raise _bad("tool_choice", '"required" and a named function are not supported yet; use "auto"')
    raise _bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name"}}')


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
