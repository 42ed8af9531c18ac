"""Structured outputs in the engine: 10 JSON Schemas x 20 seeds on the random tiny model, one
batch; every answer that finishes with "stop" validates (jsonschema), each schema has answers
that finish, and the pools are idle afterwards. The schemas are the grammar tests' (nested
objects, enums, bounded arrays, integer ranges, required and optional keys)."""

import json
import os
import sys

import jsonschema
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.sampling_params import StructuredOutput

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "input"))
from test_grammar import SCHEMAS  # noqa: E402


def test_200_seeded_answers_validate():
    llm = LLM("tiny-mla-swa", cuda_graph_batch_sizes="", max_num_seqs=256, num_gpu_blocks_override=1200)
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        for seed in range(20):
            prompts.append(f"JSON {i}:")
            so = StructuredOutput("json", json.dumps(schema), "response_format.json_schema")
            params.append(SamplingParams(max_tokens=96, temperature=1.0, seed=seed, structured=so))
    outs = llm.generate(prompts, params)
    stopped = [0] * len(SCHEMAS)
    for k, (out, p) in enumerate(zip(outs, params, strict=True)):
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length"), c.finish_reason
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), json.loads(p.structured.spec))
            stopped[k // 20] += 1
    # Every schema is exercised. Answers that run to max_tokens ("length") wander in an extra key
    # the schemas allow (additionalProperties defaults to true), as a random model does.
    assert min(stopped) >= 5 and sum(stopped) >= 120, stopped
    assert all(p.num_used == 0 for p in llm.engine.block_manager.pools.values())


def test_constraint_after_the_end_of_reasoning():
    """StructuredOutput(after="</think>"): the tokens up to </think> are free (the random model
    writes its bytes, which no JSON grammar allows), the text after it validates; a request that
    never writes </think> is never constrained. </think> is nudged by logit_bias so that most
    seeds write it after a few free tokens."""
    llm = LLM("tiny-mla-swa", cuda_graph_batch_sizes="", num_gpu_blocks_override=600)
    tok = llm.get_tokenizer()
    end = tok.single_token("</think>")
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    so = StructuredOutput("json", json.dumps(schema), "response_format.json_schema", after="</think>")
    params = [
        SamplingParams(max_tokens=80, temperature=1.0, seed=s, structured=so, logit_bias={end: 3.0}) for s in range(24)
    ]
    outs = llm.generate(["Think, then answer:"] * len(params), params)
    free_text, answered = 0, 0
    for out in outs:
        ids = out.outputs[0].token_ids
        if end not in ids:  # never constrained: EOS or max_tokens ended it
            assert out.outputs[0].finish_reason in ("stop", "length")
            continue
        at = ids.index(end)
        free_text += at > 0
        answer = tok.decode(ids[at + 1 :])
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(answer), schema)
            answered += 1
    assert free_text >= 12 and answered >= 15, (free_text, answered)
    assert all(p.num_used == 0 for p in llm.engine.block_manager.pools.values())
    with pytest.raises(ValueError, match="^response_format: 'not one token' is not one token"):
        bad = StructuredOutput("json_object", "", "response_format", after="not one token")
        llm.generate(["x"], SamplingParams(structured=bad))
