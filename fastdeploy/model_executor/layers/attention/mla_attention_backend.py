"""MLAAttentionBackend: full (causal) MLA attention over a paged latent cache.

Cache per layer: [num_blocks, block_size, 1, 576] in the model dtype or bf16 (512 latent, then
64 rope), or the 656-byte FP8 record (uint8 [..., 656]) when kv_cache_dtype is "fp8".
``forward`` (MLABackendBase) runs prefill requests in MHA form (window 0: the whole context) or
absorbed; absorbed groups run the sparse MLA Triton kernel over the group's whole-context
indices (the kernel reads both cache formats), or with the flashmla provider and a bf16 cache,
decodes through FlashMLA's dense kernel; on the CPU reference path, one batched attention per
request.
"""

from __future__ import annotations

import paddle

from fastdeploy.config import FULL_GROUP, KernelConfig
from fastdeploy.model_executor.forward_meta import ForwardMeta, TokenGroup
from fastdeploy.model_executor.layers.attention.base_backend import MLABackendBase
from fastdeploy.model_executor.layers.attention.sparse_mla_providers import flashmla_dense_decode
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache import (
    RECORD_BYTES,
    dequant_mla_fp8_cache,
    dequant_mla_fp8_cache_ref,
    write_mla_fp8_cache,
    write_mla_fp8_cache_ref,
)
from fastdeploy.model_executor.ops.triton_ops.sparse_mla import sparse_mla_triton


class MLAAttentionBackend(MLABackendBase):
    """Causal attention of each request's tokens over its cached context, from ForwardMeta."""

    def __init__(self, softmax_scale: float, kernels: KernelConfig) -> None:
        super().__init__(softmax_scale, kernels)
        self.write_records = write_mla_fp8_cache if kernels.triton else write_mla_fp8_cache_ref
        self.dequant_records = dequant_mla_fp8_cache if kernels.triton else dequant_mla_fp8_cache_ref
        self.absorbed_on_reference = not kernels.triton

    def write_cache(self, kv_c: paddle.Tensor, k_pe: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta) -> None:
        """Store each token's [kv_c | k_pe] at its slot (slot -1 skips), in the cache's format."""
        slots = meta.slot_mapping[FULL_GROUP]
        if cache.dtype == paddle.uint8:
            self.write_records(kv_c, k_pe, slots, cache)
            return
        keep = paddle.nonzero(slots >= 0).flatten()
        rows = paddle.concat([kv_c, k_pe], axis=-1)[keep].astype(cache.dtype)
        cache.reshape([-1, cache.shape[-1]])[slots.astype("int64")[keep]] = rows

    def read_cache(self, cache: paddle.Tensor, slots: paddle.Tensor) -> paddle.Tensor:
        flat = cache.reshape([-1, cache.shape[-1]])[slots]
        if cache.dtype == paddle.uint8:
            return self.dequant_records(flat.reshape([-1, RECORD_BYTES])).astype("float32")
        return flat.astype("float32")

    def absorbed(self, q: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta, group: TokenGroup) -> paddle.Tensor:
        if group.dense_decode is not None and cache.dtype == paddle.bfloat16:  # FlashMLA's dense decode
            d = group.dense_decode
            return flashmla_dense_decode(
                q, cache, d.block_table, d.cache_seqlens, self.softmax_scale, meta.flashmla_dense_schedule
            )
        if group.full_indices is not None:  # the kernel path
            return sparse_mla_triton(q, cache, group.full_indices, self.softmax_scale)[0].astype("float32")
        T, H = q.shape[0], q.shape[1]
        out = paddle.zeros([T, H, 512], "float32")
        bs, tables = meta.block_size, meta.block_tables[FULL_GROUP]
        row = 0
        for b in group.requests:  # one batched attention per request, in the group's token order
            n = int(meta.seq_lens_this_time[b])
            ctx = int(meta.seq_lens_decoder[b]) + n
            pos = paddle.arange(ctx, dtype="int64")
            slots = tables[int(b)].astype("int64")[pos // bs] * bs + pos % bs
            kv = self.read_cache(cache, slots)  # [ctx, 576]
            qb = q[row : row + n].astype("float32")  # [n, H, 576]
            logits = paddle.matmul(qb.reshape([n * H, 576]), kv, transpose_y=True).reshape([n, H, ctx])
            qpos = paddle.arange(ctx - n, ctx, dtype="int64").reshape([n, 1, 1])
            logits = paddle.where(
                pos.reshape([1, 1, ctx]) <= qpos, logits * self.softmax_scale, paddle.full_like(logits, float("-inf"))
            )
            p = paddle.nn.functional.softmax(logits, axis=-1)
            out[row : row + n] = paddle.matmul(p.reshape([n * H, ctx]), kv[:, :512]).reshape([n, H, 512])
            row += n
        return out
