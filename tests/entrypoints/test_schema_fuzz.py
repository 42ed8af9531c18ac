"""Schemathesis fuzzing from the server's own /openapi.json against the ASGI app (issue 25):
every operation gets schema-valid and schema-breaking requests (Hypothesis, derandomized so CI
sees the same cases); no 5xx, every 4xx is OpenAI's error shape with ``param`` naming a field of
the body (or ``body`` itself); afterwards the pools are idle and a fixed greedy request gives
the tokens it gave before the run. The engine is small (max_model_len 48, 4 sequences a request)
so that any accepted request is quick and most large values are refusals."""

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from starlette.testclient import TestClient

from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.entrypoints.openai import api_server

ENGINE = dict(
    model="tiny-mla-swa",
    block_size=16,
    num_gpu_blocks_override=64,
    max_model_len=48,
    max_num_seqs=8,
    enable_prefix_caching=True,
)
GREEDY = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0}

engine = AsyncLLMEngine(LLMEngine(EngineArgs(**ENGINE)))
app = api_server.build_app(engine, "tiny-mla-swa", max_request_bytes=64 * 1024, max_seqs_per_request=4)
schema = schemathesis.openapi.from_asgi("/openapi.json", app)
BEFORE = {}


def greedy_tokens() -> list:
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={**GREEDY, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def openai_error_shape(ctx, response, case):
    """A 4xx is OpenAI's error body; a 400 / 404 names the field (its first part a body field)."""
    if not 400 <= response.status_code < 500:
        return None
    err = response.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    if response.status_code in (400, 404):
        param = err["param"]
        assert isinstance(param, str) and param, err
        props = (case.operation.definition.raw.get("requestBody") or {}).get("content", {})
        fields = set()
        for media in props.values():
            ref = media.get("schema", {}).get("$ref", "")
            body = schema.raw_schema["components"]["schemas"].get(ref.rsplit("/", 1)[-1], {})
            fields |= set(body.get("properties", {}))
        unknown = err["message"] == f"{param}: unknown field (not supported by this server)"
        assert unknown or param.split(".")[0] in fields | {"body"}, (param, sorted(fields))
    return None


@pytest.fixture(scope="module", autouse=True)
def before_and_after():
    BEFORE["tokens"] = greedy_tokens()
    yield
    deadline = time.time() + 30
    while time.time() < deadline and engine.engine.has_unfinished_requests():
        time.sleep(0.05)
    for pool in engine.engine.block_manager.pools.values():
        assert pool.num_used == 0
    assert greedy_tokens() == BEFORE["tokens"]


@schema.parametrize()
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)
def test_no_server_error_and_openai_shaped_refusals(case):
    response = case.call()
    case.validate_response(response, checks=[not_a_server_error, openai_error_shape])
