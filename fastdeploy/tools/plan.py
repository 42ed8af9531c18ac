"""Memory per tensor-parallel rank for a config: weights, KV bytes per token per group, and the
tokens of KV that fit.

    python -m fastdeploy.tools.plan --config config.json --tensor-parallel-size N --gpu-memory-gib 141
        [--kv-cache-dtype auto|bf16|fp8] [--gpu-memory-utilization 0.9] [--dtype bfloat16] [--block-size 64]
        [--max-num-seqs 64] [--max-num-batched-tokens 2048] [--data-parallel-size D] [--context-len 4096]

The shapes come from the model itself, built for rank 0 without memory (paddle.LazyGuard), so
the figures follow the same sharding as the runner. Weights are given de-quantized to the model
dtype (``--quantization none``) and, for an FP8 checkpoint, as the runner keeps them with
``--quantization fp8`` (e4m3 projections and experts plus one float32 scale per 128 x 128 block).
The KV pools are sized as the runner sizes them (``plan_kv_blocks``) from the memory left after
the weights.

``--data-parallel-size D`` prices attention data parallelism with expert parallelism (the
engine's ``--data-parallel-size D --enable-expert-parallel``, docs/design.md §4.19): D groups of
``--tensor-parallel-size`` ranks, each group with its own requests and KV cache, the routed
experts split over all D x TP ranks (EP), everything else as TP splits it inside a group. Under
TP alone every rank holds every request's MLA latent (it is not split by heads), so the
deployment holds one rank's tokens; under DP it holds D times them.
``--context-len`` turns tokens into requests: how many of that length fit at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

import paddle

from fastdeploy.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    FDConfig,
    KernelConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from fastdeploy.distributed.parallel import TPGroup
from fastdeploy.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM, layer_kv_specs
from fastdeploy.worker.kv_sizing import group_bytes_per_block, plan_kv_blocks, pool_budget

ROUTED = re.compile(r"\.mlp\.w[123](_scale_inv)?$")  # the stacked routed experts (layers/moe.py)


def held_bytes(fd: FDConfig, dtype: str, tp_size: int, quantization: str, ep_size: int | None = None) -> int:
    """Rank 0's parameter bytes with the weights kept as ``quantization`` says ("fp8": e4m3 codes
    plus float32 block scales), built from the model code without memory. ``ep_size``: the
    routed experts split over that many ranks instead of the TP group's."""
    cfg = dataclasses.replace(fd.model_config, quantization=quantization, dtype=dtype)
    with paddle.LazyGuard():
        model = DeepseekV3ForCausalLM(
            dataclasses.replace(fd, model_config=cfg, kernel_config=KernelConfig()), TPGroup(rank=0, world_size=tp_size)
        )
    size = {paddle.float32: 4, paddle.uint8: 1}
    routed = other = 0
    for name, p in model.named_parameters():
        n = math.prod(p.shape) * size.get(p.dtype, 2)
        if ROUTED.search(name):
            routed += n
        else:
            other += n
    if ep_size is not None:
        experts = fd.model_config.n_routed_experts or 0
        if experts % ep_size:
            raise ValueError(f"'n_routed_experts'={experts} does not divide over {ep_size} expert-parallel ranks")
        routed = routed * tp_size // ep_size  # the group's share of all experts, then one rank's
    return routed + other


def weight_bytes(fd: FDConfig, dtype: str, tp_size: int, fp8_checkpoint: bool, ep_size: int | None = None) -> dict:
    """Rank 0's parameter bytes: de-quantized to ``dtype`` and, for an FP8 checkpoint, kept FP8."""
    held = held_bytes(fd, dtype, tp_size, "none", ep_size)
    return {"held": held, "stored": held_bytes(fd, dtype, tp_size, "fp8", ep_size) if fp8_checkpoint else held}


def plan(
    fd: FDConfig,
    dtype: str,
    memory_bytes: float,
    fp8_checkpoint: bool = False,
    data_parallel_size: int = 1,
    context_len: int = 4096,
) -> dict:
    """The figures for rank 0 (every rank holds the same amount) and for the deployment of
    ``data_parallel_size`` x TP ranks (with D > 1: attention data-parallel, experts over D x TP)."""
    tp = fd.parallel_config.tensor_parallel_size
    dp = data_parallel_size
    w = weight_bytes(fd, dtype, tp, fp8_checkpoint, dp * tp if dp > 1 else None)
    bs = fd.cache_config.block_size
    per_block = group_bytes_per_block(
        layer_kv_specs(dataclasses.replace(fd.model_config, dtype=dtype), fd.cache_config), bs
    )
    out = {
        "tensor_parallel_size": tp,
        "data_parallel_size": dp,
        "weights_held_bytes": w["held"],
        "weights_fp8_bytes": w["stored"] if fp8_checkpoint else None,
        "kv_bytes_per_token": {g: b // bs for g, b in per_block.items()},
    }
    max_seqs = fd.scheduler_config.max_num_seqs
    for key, weights in (("held", w["held"]), ("fp8", w["stored"] if fp8_checkpoint else None)):
        if weights is None:
            continue
        budget = memory_bytes * fd.cache_config.gpu_memory_utilization - weights
        pools = pool_budget(budget, per_block)
        blocks = plan_kv_blocks(fd, per_block, pools) if pools > 0 else {g: 0 for g in per_block}
        out[f"kv_budget_bytes_{key}"] = budget
        out[f"kv_blocks_{key}"] = blocks
        out[f"kv_tokens_{key}"] = {g: n * bs for g, n in blocks.items()}
        full = blocks.get("full", 0) * bs  # a request's whole context lives in the full group
        # a group (or, under TP alone, the deployment) holds one rank's tokens; DP groups hold their own
        out[f"requests_at_context_{key}"] = dp * min(full // context_len, max_seqs) if full else 0
    out["context_len"] = context_len
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fastdeploy.tools.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="a DeepSeek-V3-architecture config.json")
    # the engine's defaults, from the config dataclasses (one default per setting)
    ap.add_argument("--tensor-parallel-size", type=int, default=ParallelConfig.tensor_parallel_size)
    ap.add_argument("--gpu-memory-gib", type=float, required=True)
    ap.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig.gpu_memory_utilization)
    ap.add_argument("--kv-cache-dtype", default=CacheConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])  # a GPU's auto
    ap.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    ap.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    ap.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    ap.add_argument("--data-parallel-size", type=int, default=1, help="attention DP groups, experts over DP x TP")
    ap.add_argument("--context-len", type=int, default=4096, help="request length for the concurrency figure")
    a = ap.parse_args(argv)
    with open(a.config, encoding="utf-8") as f:
        raw = json.load(f)
    try:
        fd = FDConfig(
            ModelConfig.from_dict(raw),
            CacheConfig(
                block_size=a.block_size,
                gpu_memory_utilization=a.gpu_memory_utilization,
                kv_cache_dtype=a.kv_cache_dtype,
            ),
            SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens),
            ParallelConfig(tensor_parallel_size=a.tensor_parallel_size),
        )
    except ValueError as e:
        ap.error(str(e))
    fp8 = (raw.get("quantization_config") or {}).get("quant_method") == "fp8"
    if a.data_parallel_size < 1 or a.context_len < 1:
        ap.error("--data-parallel-size and --context-len must be positive")
    try:
        res = plan(fd, a.dtype, a.gpu_memory_gib * 2**30, fp8, a.data_parallel_size, a.context_len)
    except ValueError as e:
        ap.error(str(e))
    gb = lambda x: f"{x / 2**30:.1f} GiB"  # noqa: E731
    dp = res["data_parallel_size"]
    layout = f"data_parallel_size {dp} x " if dp > 1 else ""
    print(
        f"{layout}tensor_parallel_size {res['tensor_parallel_size']}"
        + (f" (experts over {dp * res['tensor_parallel_size']} ranks)" if dp > 1 else "")
        + f", per rank, {a.gpu_memory_gib:g} GiB x {a.gpu_memory_utilization:g}:"
    )
    print(f"  weights de-quantized ({a.dtype}): {gb(res['weights_held_bytes'])}")
    if fp8:
        print(f"  weights kept FP8 (--quantization fp8: e4m3 + block scales): {gb(res['weights_fp8_bytes'])}")
    print("  KV bytes per token: " + ", ".join(f"{g} {b}" for g, b in res["kv_bytes_per_token"].items()))
    for key, label in (("held", f"{a.dtype} weights"), ("fp8", "FP8 weights")):
        if f"kv_budget_bytes_{key}" not in res:
            continue
        budget = res[f"kv_budget_bytes_{key}"]
        if budget <= 0:
            print(f"  with {label}: does not fit ({gb(-budget)} short before any KV cache)")
            continue
        toks = ", ".join(f"{g} {n}" for g, n in res[f"kv_tokens_{key}"].items())
        print(f"  with {label}: KV budget {gb(budget)}, tokens of KV per pool: {toks}")
        fits = res[f"requests_at_context_{key}"]
        print(f"    requests of {res['context_len']} tokens at once, whole deployment: {fits}")


if __name__ == "__main__":
    main()
