"""Structured outputs (docs/design.md §4.12): constraints compiled by llguidance over the model's
tokenizer, one matcher per sequence, and the batch's token masks.

llguidance (over xgrammar): it builds its token trie straight from the ``tokenizers`` JSON the
server already loads (no transformers), computes a mask in tens of microseconds without a
precompilation pass per schema, supports JSON Schema, regular expressions and Lark grammars
with one API, and its matchers roll back tokens (speculative decoding needs that).

A constraint is (kind, spec): ``json`` (a JSON Schema as text), ``json_object`` (any JSON object),
``regex``, ``choice`` (a JSON list of strings), ``lark``. ``GrammarEngine.compile`` turns it into
a validated grammar, cached by (kind, spec); a bad one raises ValueError with llguidance's reason.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

from fastdeploy.input.tokenizer import Tokenizer

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)


class GrammarEngine:
    """Compiles constraints for one tokenizer and makes matchers. Thread-safe: requests are made
    in worker threads, off the server's event loop."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._lltok: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def lltok(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (built on first use: about a second for 128K tokens).
        A byte-level BPE (DeepSeek-V3's kind) is given as each token's bytes, so added tokens
        that are not special (the tool-call tags) are matched as the text they decode to, as
        the model writes them; llguidance's own reading of the tokenizer JSON would treat every
        added token as special. Other tokenizers go through that reading."""
        with self._lock:
            if self._lltok is None:
                hf, eos = self._tokenizer.tok, self._tokenizer.eos_token_id
                if _is_byte_level(hf):
                    wrapper = llguidance.TokenizerWrapper(_ByteTokens(hf, self.vocab_size, eos))
                    self._lltok = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=eos)
                else:
                    self._lltok = llguidance.LLTokenizer(hf.to_str(), n_vocab=self.vocab_size, eos_token=eos)
            return self._lltok

    def compile(self, kind: str, spec: str) -> str:
        """The validated llguidance grammar of a constraint (cached); ValueError saying why not."""
        key = (kind, spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = _grammar(kind, spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.lltok)
        if is_error:
            raise ValueError(messages[0] if messages else "invalid grammar")
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the start of ``grammar`` (from ``compile``)."""
        m = llguidance.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m


def _is_byte_level(hf) -> bool:
    return (json.loads(hf.to_str()).get("decoder") or {}).get("type") == "ByteLevel"  # "decoder": null too


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (printable stand-ins for the 256 bytes), inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class _ByteTokens:
    """What llguidance's TokenizerWrapper reads: every token's bytes (ids the tokenizer does not
    use: empty), the special ids, and tokenization of bytes."""

    def __init__(self, hf, vocab_size: int, eos: int | None) -> None:
        dec = _byte_decoder()
        added = hf.get_added_tokens_decoder()
        self.tokens: list[bytes] = [b""] * vocab_size
        self.special_token_ids: list[int] = []
        for text, i in hf.get_vocab(with_added_tokens=True).items():
            if i >= vocab_size:
                continue
            if i in added:
                self.tokens[i] = text.encode()
                if added[i].special:
                    self.special_token_ids.append(i)
            else:
                self.tokens[i] = bytes(dec[c] for c in text)
        self.eos_token_id, self.bos_token_id = eos, None
        self._hf = hf

    def __call__(self, data: bytes) -> list[int]:
        return self._hf.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False).ids


def _grammar(kind: str, spec: str) -> str:
    if kind == "json":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(schema, dict) and not isinstance(schema, bool):
            raise ValueError("a JSON Schema is an object (or true / false)")
        if schema is False:
            raise ValueError("the JSON Schema false accepts no value")
        if schema is True:
            schema = {}  # any JSON value (llguidance applies its options to object schemas only)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "regex":
        try:
            re.compile(spec)
        except re.error as e:
            raise ValueError(f"not a regular expression: {e}") from None
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choices must be a non-empty list of strings")
        alts = " | ".join(json.dumps(c) for c in choices)  # Lark string literals are JSON strings
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alts}")
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec)
    raise ValueError(f"unknown constraint kind {kind!r}")


_executor: llguidance.LLExecutor | None = None


def token_bitmask(matchers: list[tuple[llguidance.LLMatcher, list[int]]], vocab_size: int) -> np.ndarray:
    """int32 [sum(len(drafts) + 1), ceil(vocab_size / 32)]: for each (matcher, drafts) in order,
    len(drafts) + 1 consecutive rows, row j the tokens the matcher accepts after drafts[:j] (bit
    t % 32 of word t // 32 set when it accepts token t). A row after a draft the grammar refuses
    is all zero (no sampler reaches it: that draft is never accepted); a stopped or failed matcher
    accepts only EOS, as llguidance's mask says. The matchers end in the state they began
    (llguidance consumes the drafts and rolls them back). Computed in parallel by llguidance's
    thread pool, which releases the GIL (32 JSON-schema rows at 129,280 tokens: 3.4 ms on 2 cores,
    5.1 one by one; benchmarks/bench_structured.py)."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    plain, drafted, at = [], [], 0  # llguidance takes matchers without drafts in its other call
    for m, drafts in matchers:
        if drafts:
            drafted.append((m, at, list(drafts)))
        else:
            plain.append((m, at))
        at += len(drafts) + 1
    bits = np.zeros((at, (vocab_size + 31) // 32), np.int32)
    if plain:
        fill_next_token_bitmask_par(_executor, plain, bits)
    if drafted:
        fill_next_token_bitmask_par_with_draft_tokens(_executor, drafted, bits)
    return bits
