"""DeepSeek-V3 tool calls in generated text, parsed whole or as a stream (docs/design.md §4.14):

    CONTENT <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜> ... <｜tool▁calls▁end｜>

``parse_tool_calls(text, final)`` is the one definition: content is the text before the calls'
opening tag; a call counts once its header (type, separator, name, the json fence) is complete,
its arguments being the text up to the closing fence and tag. Unfinished (``final`` False), it
holds back what could still be the start of a tag, so each result extends the previous one:
content and arguments only grow, names never change. ``ToolCallStream`` sends the difference
between successive results, so the streamed deltas concatenate to the whole text's calls however
the text is chunked. Text after the calls' opening tag that forms no call is not content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastdeploy.input.tokenizer import TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_SEP, partial_tag_len

CALL_CLOSE = "\n```" + TOOL_CALL_END
_HEADER = re.compile(r"(?P<type>[^<\n]*)" + re.escape(TOOL_SEP) + r"(?P<name>[^\n<]*)\n```json\n")


@dataclass
class ParsedCall:
    name: str
    arguments: str


def parse_tool_calls(text: str, final: bool = True) -> tuple[str, list[ParsedCall]]:
    """(content, calls) of generated text; see the module docstring."""
    b = text.find(TOOL_CALLS_BEGIN)
    if b < 0:
        return (text if final else text[: len(text) - partial_tag_len(text, TOOL_CALLS_BEGIN)]), []
    rest, pos, calls = text[b + len(TOOL_CALLS_BEGIN) :], 0, []
    while (s := rest.find(TOOL_CALL_BEGIN, pos)) >= 0:
        m = _HEADER.match(rest, s + len(TOOL_CALL_BEGIN))
        if not m:
            break  # the header is not complete (or never will be)
        e = rest.find(CALL_CLOSE, m.end())
        if e >= 0:
            calls.append(ParsedCall(m["name"], rest[m.end() : e]))
            pos = e + len(CALL_CLOSE)
            continue
        args = rest[m.end() :]
        calls.append(ParsedCall(m["name"], args if final else args[: len(args) - partial_tag_len(args, CALL_CLOSE)]))
        break
    return text[:b], calls


class ToolCallStream:
    """One sample's incremental parse: ``feed`` returns (content delta, [(index, name or None,
    arguments delta)]), the name given with a call's first delta only."""

    def __init__(self) -> None:
        self.text = ""
        self.sent_content = 0
        self.sent_args: list[int] = []

    def feed(self, delta: str, final: bool) -> tuple[str, list[tuple[int, str | None, str]]]:
        self.text += delta
        content, calls = parse_tool_calls(self.text, final)
        out_content = content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(content))
        out_calls = []
        for i, c in enumerate(calls):
            if i == len(self.sent_args):
                self.sent_args.append(0)
                out_calls.append((i, c.name, c.arguments))
            elif len(c.arguments) > self.sent_args[i]:
                out_calls.append((i, None, c.arguments[self.sent_args[i] :]))
            self.sent_args[i] = max(self.sent_args[i], len(c.arguments))
        return out_content, out_calls
