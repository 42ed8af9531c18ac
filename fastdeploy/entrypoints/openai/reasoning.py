"""Reasoning content (``--reasoning-parser deepseek_r1``, vLLM's name and split): DeepSeek-R1 style
output ``<think> reasoning </think> answer``, the opening tag optional (R1's chat template opens
the block in the prompt). Text before ``</think>`` is ``reasoning_content``, text after it
``content``; with no ``</think>`` at all, everything is reasoning (the model was cut off while
thinking), as vLLM does.

``ReasoningStream`` splits the same way incrementally and is split-invariant: whatever chunks the
text arrives in, the concatenated deltas equal ``split_reasoning`` of the whole text. It holds
back only text that could still turn out to be part of a tag (a prefix of ``<think>`` at the very
start, a trailing prefix of ``</think>``), and releases it when the stream ends.
"""

from __future__ import annotations

from fastdeploy.input.tokenizer import THINK_END as END
from fastdeploy.input.tokenizer import THINK_START as START
from fastdeploy.input.tokenizer import partial_tag_len

PARSERS = ("deepseek_r1",)


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    body = text[len(START) :] if text.startswith(START) else text
    at = body.find(END)
    if at < 0:
        return body, ""
    return body[:at], body[at + len(END) :]


class ReasoningStream:
    """One sample's incremental split; ``feed`` returns the new (reasoning, content) text."""

    def __init__(self) -> None:
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        reasoning, content = split_reasoning(self.text)
        if not final:
            if len(self.text) < len(START) and START.startswith(self.text):
                reasoning = ""  # may still become the opening tag
            elif END not in self.text[len(START) if self.text.startswith(START) else 0 :]:
                reasoning = reasoning[: len(reasoning) - partial_tag_len(reasoning, END)]
        out = reasoning[self.sent_reasoning :], content[self.sent_content :]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_content = max(self.sent_content, len(content))
        return out
