"""The memory planner against what the runner really allocates for the tiny model."""

import dataclasses
import json
import math

import paddle

from fastdeploy import LLM
from fastdeploy.config import KernelConfig
from fastdeploy.distributed.parallel import TPGroup
from fastdeploy.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
from fastdeploy.tools import plan as planner
from fastdeploy.worker.kv_sizing import CPU_KV_CACHE_BYTES


def nbytes(t: paddle.Tensor) -> int:
    return math.prod(t.shape) * t.element_size()


def test_planner_matches_the_runner(tiny_model_dir, capsys):
    llm = LLM(model=tiny_model_dir, block_size=16, max_model_len=256)
    runner = llm.engine.runner
    fd = runner.fd
    held = sum(nbytes(p) for p in runner.model.parameters())
    memory = (CPU_KV_CACHE_BYTES + held) / fd.cache_config.gpu_memory_utilization  # the runner's CPU budget
    res = planner.plan(fd, "float32", memory)
    assert res["weights_held_bytes"] == held
    assert res["kv_blocks_held"] == runner.num_blocks
    groups = fd.model_config.kv_cache_groups
    bs = fd.cache_config.block_size
    for g, layers in groups.items():  # bytes a token x (tokens + the null block) = the group's caches
        allocated = sum(nbytes(runner.caches[i]) for i in layers)
        assert res["kv_bytes_per_token"][g] * (res["kv_tokens_held"][g] + bs) == allocated
    # TP 2: rank 0's planned weights are those of a real rank-0 shard
    rank0 = DeepseekV3ForCausalLM(dataclasses.replace(fd, kernel_config=KernelConfig()), TPGroup(rank=0, world_size=2))
    assert planner.weight_bytes(fd, "float32", 2, False)["held"] == sum(nbytes(p) for p in rank0.parameters())
    cfg = json.load(open(f"{tiny_model_dir}/config.json"))
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    path = f"{tiny_model_dir}/../plan_config.json"
    json.dump(cfg, open(path, "w"))
    planner.main(["--config", path, "--tensor-parallel-size", "2", "--gpu-memory-gib", "1", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "weights de-quantized (float32)" in out and "kept FP8" in out and "tokens of KV per pool: full" in out


def layer_bytes(cache) -> int:
    """A layer's cache bytes: one tensor, or a DSA layer's latent and indexer keys."""
    return sum(nbytes(t) for t in cache) if isinstance(cache, tuple) else nbytes(cache)


def test_planner_counts_dsa_layers_as_the_runner_allocates(tmp_path, capsys):
    """A window + indexed + full tiny model with kv_cache_dtype fp8: a DSA layer holds 656 + 132
    bytes a token (records and e4m3 index keys) in the full group, and the planned bytes equal the
    runner's tensors; DeepSeek-V3.2's config at TP 8 plans 61 x 788 bytes a token."""
    from fastdeploy.tools.tiny_checkpoint import make_tiny_model

    d = make_tiny_model(str(tmp_path / "hyb"), seed=3, swa_layers=[0], dsa_layers=[1, 3], index_topk=16)
    llm = LLM(model=d, block_size=16, max_model_len=256, kv_cache_dtype="fp8")
    runner = llm.engine.runner
    fd = runner.fd
    held = sum(nbytes(p) for p in runner.model.parameters())
    res = planner.plan(fd, "float32", (CPU_KV_CACHE_BYTES + held) / fd.cache_config.gpu_memory_utilization)
    assert res["kv_blocks_held"] == runner.num_blocks
    assert [nbytes(t) // (runner.num_blocks["full"] + 1) // 16 for t in runner.caches[1]] == [656, 132]
    bs = fd.cache_config.block_size
    for g, layers in fd.model_config.kv_cache_groups.items():
        allocated = sum(layer_bytes(runner.caches[i]) for i in layers)
        assert res["kv_bytes_per_token"][g] * (res["kv_tokens_held"][g] + bs) == allocated
    assert res["kv_bytes_per_token"] == {"swa": 656, "full": (656 + 132) + 656 + (656 + 132)}
    config = "benchmarks/configs/deepseek_v32.json"
    planner.main(
        ["--config", config, "--tensor-parallel-size", "8", "--gpu-memory-gib", "141", "--kv-cache-dtype", "fp8"]
    )
    out = capsys.readouterr().out
    assert f"KV bytes per token: full {61 * (656 + 132)}" in out


def test_data_parallel_attention_with_expert_parallel_plan(tiny_model_dir, capsys):
    """--data-parallel-size D: each rank holds the whole attention and dense parts (TP 1 inside a
    group here) and 1/D of the routed experts, counted from a real TP-1 model's parameters; the
    deployment holds D ranks' requests; an expert count that does not divide is named."""
    import pytest

    fd = LLM(model=tiny_model_dir, block_size=16, max_model_len=256).engine.runner.fd
    model = DeepseekV3ForCausalLM(dataclasses.replace(fd, kernel_config=KernelConfig()), TPGroup())
    routed = sum(nbytes(p) for n, p in model.named_parameters() if planner.ROUTED.search(n))
    total = sum(nbytes(p) for p in model.parameters())
    assert 0 < routed < total
    one, two = (planner.plan(fd, "float32", 2**30, data_parallel_size=d, context_len=64) for d in (1, 2))
    assert one["weights_held_bytes"] == total and two["weights_held_bytes"] == total - routed // 2
    full = two["kv_tokens_held"]["full"]
    assert two["requests_at_context_held"] == 2 * min(full // 64, fd.scheduler_config.max_num_seqs)
    experts = fd.model_config.n_routed_experts
    with pytest.raises(ValueError, match=f"'n_routed_experts'={experts} does not divide over 3 expert-parallel"):
        planner.plan(fd, "float32", 2**30, data_parallel_size=3)
    path = f"{tiny_model_dir}/../plan_dp.json"
    json.dump(json.load(open(f"{tiny_model_dir}/config.json")), open(path, "w"))
    planner.main(["--config", path, "--data-parallel-size", "2", "--gpu-memory-gib", "1", "--dtype", "float32"])
    assert "data_parallel_size 2 x tensor_parallel_size 1 (experts over 2 ranks)" in capsys.readouterr().out
