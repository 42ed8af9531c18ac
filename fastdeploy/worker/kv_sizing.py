"""KV cache sizing (docs/design.md §4.2): each KV cache group's bytes a block from the layers' KV
specs, the memory the cache may take, and how many blocks each group's pool gets. The runner
allocates what this plans; ``tools/plan`` prices whole deployments with the same functions."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import paddle

from fastdeploy.config import FULL_GROUP, SWA_GROUP, FDConfig, swa_blocks_per_request
from fastdeploy.model_executor.layers.attention.base_backend import KVSpec

CPU_KV_CACHE_BYTES = 512 * 2**20  # default KV pool on CPU (override: FD_CPU_KV_CACHE_BYTES)


def on_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def group_bytes_per_block(specs: Sequence[KVSpec], block_size: int) -> dict[str, int]:
    """Bytes of one block over all layers of each KV cache group, from the layers' KV specs."""
    out: dict[str, int] = {}
    for spec in specs:
        out[spec.group] = out.get(spec.group, 0) + spec.bytes_per_token * block_size
    return out


def kv_budget_bytes(fd: FDConfig) -> float:
    """Memory the KV cache may take: the GPU's share left after the weights, or on CPU
    FD_CPU_KV_CACHE_BYTES."""
    if on_gpu():
        total = paddle.device.cuda.get_device_properties().total_memory
        return total * fd.cache_config.gpu_memory_utilization - paddle.device.cuda.memory_allocated()
    return float(os.environ.get("FD_CPU_KV_CACHE_BYTES", CPU_KV_CACHE_BYTES))


def plan_kv_blocks(fd: FDConfig, per_block: dict[str, int], budget: float) -> dict[str, int]:
    """Blocks of each group's pool (docs/design.md §4.2). One group takes the budget (or the
    override). With both, the SWA pool holds what max_num_seqs requests can need at once
    (``swa_blocks_per_request`` each; at least what one request alone can hold, its window and
    ``swa_chunk_tokens``), never more than the full pool (a request's SWA blocks are
    a subset of its logical blocks), and the full pool takes the rest; ``swa_full_tokens_ratio``
    fixes SWA blocks per full block instead; ``num_gpu_blocks_override`` sets the full pool."""
    cc, sc, mc = fd.cache_config, fd.scheduler_config, fd.model_config
    override, ratio = cc.num_gpu_blocks_override, cc.swa_full_tokens_ratio
    if len(per_block) == 1:
        ((g, nbytes),) = per_block.items()
        return {g: override or max(1, int(budget // nbytes))}
    full_b, swa_b = per_block[FULL_GROUP], per_block[SWA_GROUP]
    need = sc.max_num_seqs * swa_blocks_per_request(mc.sliding_window, sc.max_num_batched_tokens, cc.block_size)
    need = max(need, swa_blocks_per_request(mc.sliding_window, sc.swa_chunk_tokens, cc.block_size))  # one alone
    if override:
        full = override
    elif ratio:
        full = int(budget // (full_b + ratio * swa_b))
    else:
        full = int((budget - need * swa_b) // full_b)
        if full < need:  # tight memory: as many SWA blocks as full ones
            full = int(budget // (full_b + swa_b))
    swa = math.ceil(ratio * full) if ratio else min(need, full)
    return {FULL_GROUP: max(1, full), SWA_GROUP: max(1, swa)}


def pool_budget(budget: float, per_block: dict[str, int]) -> float:
    """The KV budget left for the pools: each group's null block comes off it (§4.11)."""
    return budget - sum(per_block.values())


def num_blocks_for(fd: FDConfig, specs: Sequence[KVSpec]) -> dict[str, int]:
    """Each group's pool size from the memory budget and each group's real bytes per block."""
    per_block = group_bytes_per_block(specs, fd.cache_config.block_size)
    return plan_kv_blocks(fd, per_block, pool_budget(kv_budget_bytes(fd), per_block))
