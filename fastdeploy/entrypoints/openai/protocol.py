"""OpenAI request bodies (pydantic, strict) and the error body.

Strict: no string-to-number or number-to-bool coercion, no NaN / Infinity, and a field this
server does not know is an error rather than silently dropped. Ranges are OpenAI's; fields vLLM
adds (top_k, min_p, min_tokens, repetition_penalty, stop_token_ids, ignore_eos, prompt_logprobs, and the
structured-output fields guided_json / guided_regex / guided_choice / guided_grammar /
structured_outputs) are accepted too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_N = 64


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


class JsonSchemaFormat(StrictModel):
    """OpenAI's ``response_format.json_schema``."""

    name: str | None = None
    description: str | None = None
    schema_: dict | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs``: exactly one of its fields."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(StrictModel):
    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: each prompt token's logprob
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    tools: Any = None  # chat: checked by the server (tool definitions); completions: a 400
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # prefill / decode disaggregation (vLLM's field; docs/design.md §4.20): on a prefill instance,
    # {"targets": [a KV target per sequence]} from the decode instance's /v1/kv/reserve
    kv_transfer_params: dict | None = None
    # accepted only to say clearly that they are not supported (OpenAI's deprecated form)
    functions: Any = None
    function_call: Any = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt and its logprobs alone
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # assistant: earlier calls, OpenAI's shape
    tool_call_id: str | None = None  # tool: the call this result answers
    reasoning_content: str | None = None  # an earlier answer's reasoning, as vLLM accepts it


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize body: ``prompt`` or chat ``messages`` (exactly one)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error", code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class APIError(Exception):
    """An error answered with ``status`` and OpenAI's error body; ``param`` names the field."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code


def param_of(message: str) -> str | None:
    """The field a validation message starts with ("max_tokens: ...", "prompt.1: ..."), if any."""
    head = message.split(" ", 1)[0].rstrip(":")
    return head if head.replace("_", "").replace(".", "").isalnum() else None
