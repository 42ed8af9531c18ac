"""Tokenizer (Hugging Face ``tokenizer.json``) with the chat template of ``tokenizer_config.json``."""

from __future__ import annotations

import json
import os

import jinja2
from tokenizers import Tokenizer as HFTokenizer

# DeepSeek-V3's tool-call tags, as its tokenizer spells them: added tokens that are not special,
# so they stay in decoded text (where the tool-call parser finds them)
TOOL_CALLS_BEGIN, TOOL_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
TOOL_OUTPUTS_BEGIN, TOOL_OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
TOOL_OUTPUT_BEGIN, TOOL_OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
# DeepSeek-R1's reasoning tags: added tokens, not special (they stay in decoded text)
THINK_START, THINK_END = "<think>", "</think>"
TOOL_TOKENS = [
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_SEP,
    TOOL_OUTPUTS_BEGIN,
    TOOL_OUTPUTS_END,
    TOOL_OUTPUT_BEGIN,
    TOOL_OUTPUT_END,
]


class Tokenizer:
    def __init__(self, model_dir: str) -> None:
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json in model directory {model_dir!r}")
        self.tok = HFTokenizer.from_file(path)
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        self.config = json.load(open(cfg_path, encoding="utf-8")) if os.path.isfile(cfg_path) else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))
        self.bos_token_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_token_id is not None
        template = self.config.get("chat_template")
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=False, lstrip_blocks=False)
        env.globals["raise_exception"] = _raise
        self.chat_template = env.from_string(template) if template else None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids. encode_batch, unlike encode, releases the GIL while it works, so a huge prompt
        tokenized in a worker thread does not stall the server's event loop."""
        ids = self.tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and not text.startswith(self.bos_token):
            ids = [self.bos_token_id] + ids
        return ids

    def single_token(self, text: str) -> int | None:
        """The id of the one token that spells ``text`` exactly, or None."""
        ids = self.tok.encode_batch([text], add_special_tokens=False)[0].ids
        return ids[0] if len(ids) == 1 else None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        if self.chat_template is None:
            raise ValueError("this model's tokenizer_config.json has no chat_template; use /v1/completions")
        return self.chat_template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _raise(msg: str):
    raise ValueError(msg)


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``: what a stream
    holds back because the next characters may complete the tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class IncrementalDetokenizer:
    """Text of a growing token list; holds back a trailing partial UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self.whole = ""  # the last update's whole decode, a trailing partial character included

    def update(self, ids: list[int]) -> str:
        """Full text so far (stable prefix); returns the newly stable part."""
        text = self.whole = self.tokenizer.decode(ids)
        if text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        new = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text = text if text.startswith(self.text) else self.text
        return new
