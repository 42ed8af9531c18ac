"""Structured outputs in the engine: 10 JSON Schemas x 20 seeds on the random tiny model, one
batch; every answer that finishes with "stop" validates (jsonschema), most finish, and the pools
are idle afterwards. The schemas are the grammar tests' (nested objects, enums, bounded arrays,
integer ranges, required and optional keys)."""

import json
import os
import sys

import jsonschema

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
    stopped = 0
    for out, p in zip(outs, params, strict=True):
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length"), c.finish_reason
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), json.loads(p.structured.spec))
            stopped += 1
    assert stopped >= 180, stopped
    assert all(p.num_used == 0 for p in llm.engine.block_manager.pools.values())
