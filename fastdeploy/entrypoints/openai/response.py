"""OpenAI response formatting: choices, streamed deltas, server-sent events, usage.

Nothing here talks to the engine: ``serving.py`` turns engine outputs into ``Delta``s and hands
them over; this module shapes them into completion or chat-completion bodies and SSE chunks,
ending a stream with ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastdeploy.entrypoints.openai.protocol import APIError, error_body
from fastdeploy.entrypoints.openai.reasoning import ReasoningStream, split_reasoning
from fastdeploy.entrypoints.openai.tool_calls import ToolCallStream, parse_tool_calls
from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.request import RequestOutput


@dataclass
class Delta:
    """What one sample produced since its last delta: text (stop-string hold-back applied),
    token ids and their logprobs, the finish reason once finished, and the engine's output."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # None: an echoed prompt's first token
    finish_reason: str | None
    out: RequestOutput

    def __add__(self, later: Delta) -> Delta:
        return Delta(
            self.text + later.text,
            self.token_ids + later.token_ids,
            self.logprobs + later.logprobs,
            later.finish_reason,
            later.out,
        )


def usage(finals: list[list[RequestOutput]]) -> dict:
    """Each prompt counted once however many samples it has; every sample's tokens."""
    p = sum(len(row[0].prompt_token_ids) for row in finals)
    c = sum(len(o.outputs[0].token_ids) for row in finals for o in row)
    cached = sum(max(o.num_cached_tokens for o in row) for row in finals)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class ResponseFormatter:
    """Shapes one API call's samples: ``chat`` picks the chat-completion format, ``logprobs``
    whether choices carry logprobs (``top_n`` alternatives each for chat), ``n`` samples a prompt."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        rid: str,
        model: str,
        chat: bool,
        logprobs: bool,
        top_n: int,
        n: int,
        reasoning: bool = False,
        tools: bool = False,
        prompt_logprobs: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_logprobs = prompt_logprobs is not None  # vLLM's field: completions per choice, chat once
        self.chat, self.logprobs, self.top_n, self.n = chat, logprobs, top_n, n
        self.reasoning = reasoning and chat  # chat messages carry reasoning_content
        self.tools = tools and chat  # chat messages carry tool_calls parsed from the content
        self.streams: dict[int, ReasoningStream] = {}
        self.tool_streams: dict[int, ToolCallStream] = {}
        self.call_ids: dict[tuple[int, int], str] = {}
        self.has_calls: set[int] = set()
        self.obj = "chat.completion" if chat else "text_completion"
        self.base = {"id": rid, "created": int(time.time()), "model": model}

    def _token_str(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def _completion_logprobs(self, d: Delta, offset: int) -> dict:
        toks = [self._token_str(t) for t in d.token_ids]
        offsets, o = [], offset
        for s in toks:
            offsets.append(o)
            o += len(s)
        return {
            "tokens": toks,
            "token_logprobs": [None if lp is None else lp[t] for t, lp in zip(d.token_ids, d.logprobs, strict=True)],
            "top_logprobs": [
                None if lp is None else {self._token_str(k): v for k, v in lp.items()} for lp in d.logprobs
            ],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, d: Delta) -> dict:
        def entry(t, v):
            s = self._token_str(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        content = []
        for t, lp in zip(d.token_ids, d.logprobs, strict=True):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[: self.top_n]
            content.append({**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in top]})
        return {"content": content}

    def _prompt_logprobs(self, out: RequestOutput) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob,
        rank, decoded_token}} for the token and its top alternatives (ranked by position)."""
        res: list[dict | None] = [None]
        for p in range(1, len(out.prompt_token_ids)):
            tok, entry = out.prompt_token_ids[p], out.prompt_logprobs[p]
            res.append(
                {
                    str(t): {
                        "logprob": v,
                        "rank": out.prompt_ranks[p] if t == tok else i + 1,
                        "decoded_token": self._token_str(t),
                    }
                    for i, (t, v) in enumerate(entry.items())
                }
            )
        return res

    def choice(self, index: int, d: Delta, stream: bool, text_offset: int = 0, first: bool = True) -> dict:
        ch: dict = {"index": index, "finish_reason": d.finish_reason}
        if self.chat:
            msg = self._message(index, d, stream)
            if first:
                msg["role"] = "assistant"
            ch["delta" if stream else "message"] = msg
            ch["logprobs"] = self._chat_logprobs(d) if self.logprobs else None
            if d.finish_reason == "stop" and index in self.has_calls:
                ch["finish_reason"] = "tool_calls"
        else:
            ch["text"] = d.text
            ch["logprobs"] = self._completion_logprobs(d, text_offset) if self.logprobs else None
            if self.prompt_logprobs:  # never streamed (a 400)
                ch["prompt_logprobs"] = self._prompt_logprobs(d.out)
        return ch

    def _call_id(self, index: int, i: int) -> str:
        return self.call_ids.setdefault((index, i), f"call_{uuid.uuid4().hex[:24]}")

    def _message(self, index: int, d: Delta, stream: bool) -> dict:
        """A chat message (stream: its delta) from a sample's text: reasoning split off first,
        then tool calls parsed from the content (both whole, or incrementally when streaming)."""
        final = d.finish_reason is not None
        if self.reasoning:
            if stream:
                reasoning, content = self.streams.setdefault(index, ReasoningStream()).feed(d.text, final)
            else:
                reasoning, content = split_reasoning(d.text)
        else:
            reasoning, content = None, d.text
        msg: dict = {}
        if self.tools and stream:
            content, deltas = self.tool_streams.setdefault(index, ToolCallStream()).feed(content, final)
            if deltas:
                self.has_calls.add(index)
                calls = []
                for i, name, args in deltas:
                    c: dict = {"index": i, "function": {"arguments": args}}
                    if name is not None:
                        c.update(id=self._call_id(index, i), type="function")
                        c["function"] = {"name": name, "arguments": args}
                    calls.append(c)
                msg["tool_calls"] = calls
        elif self.tools:
            content, calls = parse_tool_calls(content)
            if calls:
                self.has_calls.add(index)
                msg["tool_calls"] = [
                    {
                        "id": self._call_id(index, i),
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for i, c in enumerate(calls)
                ]
        if stream:
            if content or not (reasoning or msg):
                msg["content"] = content
            if reasoning:
                msg["reasoning_content"] = reasoning
        else:
            msg["content"] = content if content or not (self.reasoning or self.tools) else None
            if self.reasoning:
                msg["reasoning_content"] = reasoning or None
            if self.tools:
                msg.setdefault("tool_calls", [])
        return msg

    def _rows(self, finals: list) -> list[list[RequestOutput]]:
        return [finals[i : i + self.n] for i in range(0, len(finals), self.n)]

    def body(self, fulls: list[Delta]) -> dict:
        """The non-streamed response over every sample's whole Delta (prompt-major order)."""
        choices = [self.choice(i, d, False) for i, d in enumerate(fulls)]
        body = {**self.base, "object": self.obj, "choices": choices, "usage": usage(self._rows([d.out for d in fulls]))}
        if self.chat and self.prompt_logprobs:  # one prompt, its samples share it
            body["prompt_logprobs"] = self._prompt_logprobs(fulls[0].out)
        return body

    async def sse(
        self, events: AsyncIterator[tuple[int, Delta | BaseException | None]], samples: int, include_usage: bool
    ) -> AsyncIterator[str]:
        """Server-sent events from (sample index, Delta | error | None at its end) events of
        ``samples`` samples: a chunk per delta that carries something, an error event on the first
        error, the usage chunk when asked, always ``data: [DONE]`` last."""
        offsets, first, finals, live = [0] * samples, [True] * samples, [None] * samples, samples
        while live:
            index, d = await anext(events)
            if d is None:
                live -= 1
                continue
            if isinstance(d, BaseException):
                err = d if isinstance(d, APIError) else APIError(500, str(d), None, "internal_server_error")
                yield f"data: {json.dumps(error_body(err.message, err.param, err.kind, err.code))}\n\n"
                break
            if d.text or d.finish_reason or (d.token_ids and self.logprobs):
                chunk = {
                    **self.base,
                    "object": self.obj + ".chunk",
                    "choices": [self.choice(index, d, True, offsets[index], first[index])],
                }
                yield f"data: {json.dumps(chunk)}\n\n"
                first[index] = False
            offsets[index] += len(d.text)
            finals[index] = d.out
        else:
            if include_usage:
                last = {**self.base, "object": self.obj + ".chunk", "choices": [], "usage": usage(self._rows(finals))}
                yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"
