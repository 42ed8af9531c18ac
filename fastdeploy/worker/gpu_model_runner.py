"""Model runner: KV cache allocation, the step's ForwardMeta, the model run, sampling.

On a machine without a GPU it runs on paddle's CPU place; the name stays for parity with
FastDeploy. Caches, one per layer (docs/design.md §4.2): SWA layers uint8 [num_blocks, block_size, 1,
656] (FP8 records); full layers [num_blocks, block_size, 1, 576] in the model dtype, bf16
("bf16") or the same FP8 record ("fp8"), as kv_cache_dtype says.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import paddle

from fastdeploy.config import FDConfig
from fastdeploy.model_executor.forward_meta import ForwardMeta, ForwardMetaBuilder
from fastdeploy.model_executor.layers.sampler import SampleResult, sample
from fastdeploy.model_executor.load_weight_utils import load_weights
from fastdeploy.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache import RECORD_BYTES
from fastdeploy.request import Request

logger = logging.getLogger("fastdeploy")

CPU_KV_CACHE_BYTES = 512 * 2**20  # default KV pool on CPU (override: FD_CPU_KV_CACHE_BYTES)


def on_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def resolve_dtype(dtype: str) -> str:
    if dtype == "auto":
        return "bfloat16" if on_gpu() else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return dtype


def cache_spec(fd: FDConfig, layer_id: int, model_dtype: str) -> tuple[str, int]:
    """(dtype, bytes per token entry) of one layer's cache."""
    if fd.model_config.is_swa_layer(layer_id) or fd.cache_config.kv_cache_dtype == "fp8":
        return "uint8", RECORD_BYTES
    dtype = "bfloat16" if fd.cache_config.kv_cache_dtype == "bf16" else model_dtype
    return dtype, 576 * paddle.to_tensor([], dtype=dtype).element_size()


def bytes_per_block(fd: FDConfig, model_dtype: str) -> int:
    bs = fd.cache_config.block_size
    return sum(cache_spec(fd, i, model_dtype)[1] * bs for i in range(fd.model_config.num_hidden_layers))


def num_blocks_for(fd: FDConfig, model_dtype: str) -> int:
    """The pool size: the override, else the memory budget over the real bytes per block."""
    if fd.cache_config.num_gpu_blocks_override:
        return fd.cache_config.num_gpu_blocks_override
    per_block = bytes_per_block(fd, model_dtype)
    if on_gpu():
        total = paddle.device.cuda.get_device_properties().total_memory
        budget = total * fd.cache_config.gpu_memory_utilization - paddle.device.cuda.memory_allocated()
    else:
        budget = int(os.environ.get("FD_CPU_KV_CACHE_BYTES", CPU_KV_CACHE_BYTES))
    return max(1, int(budget // per_block))


class GPUModelRunner:
    def __init__(self, fd_config: FDConfig, dtype: str = "auto") -> None:
        self.fd = fd_config
        self.dtype = resolve_dtype(dtype)
        mc = fd_config.model_config
        self.model = DeepseekV3ForCausalLM(mc, self.dtype, fd_config.kernel_config)
        self.model.eval()
        load_weights(self.model, mc.model_dir, mc.num_hidden_layers, show_progress=True)
        self.block_size = fd_config.cache_config.block_size
        self.meta_builder = ForwardMetaBuilder(self.block_size, self.model.sliding_windows, fd_config.kernel_config)
        self.num_blocks = num_blocks_for(fd_config, self.dtype)
        self.caches = self.allocate_caches(self.num_blocks)

    def allocate_caches(self, num_blocks: int) -> list[paddle.Tensor]:
        mc, bs = self.fd.model_config, self.block_size
        caches, per_kind = [], {}
        for i in range(mc.num_hidden_layers):
            dtype, width = cache_spec(self.fd, i, self.dtype)
            last = RECORD_BYTES if dtype == "uint8" else 576
            caches.append(paddle.zeros([num_blocks, bs, 1, last], dtype=dtype))
            kind = "swa" if mc.is_swa_layer(i) else "full"
            per_kind[kind] = (dtype, width * bs)
        for kind, (dtype, nbytes) in sorted(per_kind.items()):
            logger.info("KV cache %s layers: %s, %d bytes per block per layer", kind, dtype, nbytes)
        logger.info(
            "KV cache: %d blocks of %d tokens, %d bytes per block over all layers",
            num_blocks,
            bs,
            bytes_per_block(self.fd, self.dtype),
        )
        return caches

    def build_meta(self, scheduled: list[tuple[Request, int]]) -> ForwardMeta:
        ids, enc, dec, tables = [], [], [], []
        for req, n in scheduled:
            start = req.num_computed_tokens
            ids.extend(req.all_token_ids[start : start + n])
            is_decode = n == 1 and req.output_token_ids and start == req.num_tokens - 1
            enc.append(0 if is_decode else n)
            dec.append(start)
            tables.append(req.block_table)
        return self.meta_builder.build(ids, enc, dec, tables)

    def execute(self, scheduled: list[tuple[Request, int]]) -> list[SampleResult | None]:
        """Run one step; a sample for each request whose tokens are now all computed, else None."""
        if not scheduled:
            return []
        meta = self.build_meta(scheduled)
        hidden = self.model(meta, self.caches)
        samples_at = [i for i, (req, n) in enumerate(scheduled) if req.num_computed_tokens + n == req.num_tokens]
        results: list[SampleResult | None] = [None] * len(scheduled)
        if not samples_at:
            return results
        last_tok = meta.cu_seqlens_q[1:] - 1
        logits = self.model.compute_logits(hidden, paddle.to_tensor(last_tok[samples_at])).numpy()
        states = [scheduled[i][0].sampling_state for i in samples_at]
        for i, r in zip(samples_at, sample(np.asarray(logits), states), strict=True):
            results[i] = r
        return results
