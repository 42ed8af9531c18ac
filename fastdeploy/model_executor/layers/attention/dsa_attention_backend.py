"""DSAAttentionBackend: the whole attention of an SWA layer.

"SWA", "DSA" and "sparse MLA" name one path here: an SWA layer attends over its window through
the window indexer's slot ids and FlashMLA's sparse MLA contract over the 656-byte FP8 cache
(docs/design.md §4.3-4.5). ``forward`` writes the step's records, reads the step's indices for
its window from ForwardMeta and calls ``forward_static``, which runs the provider over the token
groups the step builder made: FlashMLA splits decodes (FP8 cache kernel) from prefills (bf16
gather kernel); the Triton kernel and the reference take the whole mixed batch in one call,
since all causality lives in the indices.
"""

from __future__ import annotations

import paddle

from fastdeploy.config import SWA_GROUP, KernelConfig
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.sparse_mla_providers import sparse_mla_attention
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache import write_mla_fp8_cache, write_mla_fp8_cache_ref


class DSAAttentionBackend:
    def __init__(self, softmax_scale: float, sliding_window: int, kernels: KernelConfig) -> None:
        self.softmax_scale = softmax_scale
        self.sliding_window = sliding_window
        self.kernels = kernels
        self.write_cache = write_mla_fp8_cache if kernels.triton else write_mla_fp8_cache_ref

    def q_dtype(self, model_dtype: paddle.dtype) -> str:
        """bf16 for the GPU kernels (docs/design.md §4.5); a float32 CPU model keeps float32 on the
        reference, so SWA layers add no rounding beyond the FP8 cache."""
        if self.kernels.sparse_mla_provider == "reference" and model_dtype == paddle.float32:
            return "float32"
        return "bfloat16"

    def forward(
        self, q: paddle.Tensor, kv_c: paddle.Tensor, k_pe: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta
    ) -> paddle.Tensor:
        """q [T, H, 576] (absorbed), kv_c [T, 512] and k_pe [T, 64] in the model dtype, cache uint8
        [num_blocks, block_size, 1, 656] -> latent float32 [T, H, 512]."""
        self.write_cache(kv_c, k_pe, meta.slot_mapping[SWA_GROUP], cache)
        q = q.astype(self.q_dtype(kv_c.dtype))
        return self.forward_static(q, cache, meta.swa_indices[self.sliding_window], meta)

    def forward_static(
        self, q: paddle.Tensor, kv_cache: paddle.Tensor, indices: paddle.Tensor, meta: ForwardMeta
    ) -> paddle.Tensor:
        """q [T, H, 576], kv_cache uint8 [num_blocks, block_size, 1, 656], indices int32 [T, topk]
        -> latent float32 [T, H, 512]."""
        provider = self.kernels.sparse_mla_provider
        out = None
        for group in meta.sparse_groups:
            t = group.tokens
            qs, idx = (q, indices) if t is None else (q[t], indices[t])
            o = sparse_mla_attention(
                qs, kv_cache, idx, self.softmax_scale, provider, group.is_prefill, meta.flashmla_schedule
            )[0].astype("float32")
            if t is None:
                return o
            out = paddle.zeros([q.shape[0], q.shape[1], 512], "float32") if out is None else out
            out[t] = o
        return out
