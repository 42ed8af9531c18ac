"""vLLM's tokenizer endpoints: /tokenize, /detokenize, /tokenizer_info, with the tokenizer and
the body checks the generation endpoints use."""

from __future__ import annotations

from fastdeploy.entrypoints.openai.protocol import APIError, DetokenizeRequest, TokenizeRequest
from fastdeploy.entrypoints.openai.request_mapping import RequestMapper


class TokenizationServer:
    def __init__(self, mapping: RequestMapper) -> None:
        self.mapping = mapping
        self.tokenizer = mapping.tokenizer
        self.max_model_len = mapping.max_model_len

    def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""
        self.mapping.check_body(body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            try:
                messages = self.mapping.messages(body.messages)
                text = self.tokenizer.apply_chat_template(messages, body.add_generation_prompt)
            except ValueError as e:
                raise APIError(400, f"messages: {e}", "messages") from None
            special = bool(body.add_special_tokens)  # the template spells its own by default
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        ids = self.tokenizer.encode(text, add_special_tokens=special)
        strs = [self.tokenizer.decode([t], False) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: token ids to text (special tokens kept)."""
        self.mapping.check_body(body)
        vocab = self.tokenizer.vocab_size
        for i, t in enumerate(body.tokens):
            if not 0 <= t < vocab:
                raise APIError(400, f"tokens.{i}: {t} is not a token id in 0..{vocab - 1}", f"tokens.{i}")
        return {"prompt": self.tokenizer.decode(body.tokens, False)}

    def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: what a client needs to tokenize as the server does
        (lm-evaluation-harness's remote tokenizer reads it)."""
        tok = self.tokenizer
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": tok.pad_token,
            "add_bos_token": tok.add_bos,
            "chat_template": tok.config.get("chat_template"),
            "model_max_length": self.max_model_len,
            "vocab_size": tok.vocab_size,
        }
