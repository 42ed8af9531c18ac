"""DSAAttentionBackend: the whole attention of an SWA layer.

"SWA", "DSA" and "sparse MLA" name one path here: an SWA layer attends over its window through
the window indexer's slot ids and FlashMLA's sparse MLA contract over the 656-byte FP8 cache
(docs/design.md §4.3-4.5). ``forward`` (MLABackendBase) writes the step's records and runs each
token group: prefill requests the step builder put in MHA form through the MHA kernel over the
window's decompressed keys, the others absorbed through ``forward_static``, which runs the
provider on the step's indices for this window. FlashMLA gets decodes (FP8 cache kernel) apart
from prefills (bf16 gather kernel); the Triton kernel and the reference take both in one call,
since all causality lives in the indices.
"""

from __future__ import annotations

import paddle

from fastdeploy.config import SWA_GROUP, KernelConfig
from fastdeploy.model_executor.forward_meta import ForwardMeta, TokenGroup
from fastdeploy.model_executor.layers.attention.base_backend import MLABackendBase
from fastdeploy.model_executor.layers.attention.sparse_mla_providers import sparse_mla_attention
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache import (
    RECORD_BYTES,
    dequant_mla_fp8_cache,
    dequant_mla_fp8_cache_ref,
    write_mla_fp8_cache,
    write_mla_fp8_cache_ref,
)


class DSAAttentionBackend(MLABackendBase):
    def __init__(self, softmax_scale: float, sliding_window: int, kernels: KernelConfig) -> None:
        super().__init__(softmax_scale, kernels)
        self.write_records = write_mla_fp8_cache if kernels.triton else write_mla_fp8_cache_ref
        self.dequant_records = dequant_mla_fp8_cache if kernels.triton else dequant_mla_fp8_cache_ref
        self.sliding_window = sliding_window
        self.absorbed_on_reference = kernels.sparse_mla_provider == "reference"

    @property
    def window(self) -> int:
        return self.sliding_window

    def write_cache(self, kv_c: paddle.Tensor, k_pe: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta) -> None:
        self.write_records(kv_c, k_pe, meta.slot_mapping[SWA_GROUP], cache)

    def read_cache(self, cache: paddle.Tensor, slots: paddle.Tensor) -> paddle.Tensor:
        return self.dequant_records(cache.reshape([-1, RECORD_BYTES])[slots]).astype("float32")

    def absorbed(self, q: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta, group: TokenGroup) -> paddle.Tensor:
        indices = meta.swa_indices[self.sliding_window]
        idx = indices if group.tokens is None else indices[group.tokens]
        return self.forward_static(q, cache, idx, meta, group.is_prefill)

    def forward_static(
        self,
        q: paddle.Tensor,
        kv_cache: paddle.Tensor,
        indices: paddle.Tensor,
        meta: ForwardMeta,
        is_prefill: bool = False,
    ) -> paddle.Tensor:
        """q [n, H, 576], kv_cache uint8 [num_blocks, block_size, 1, 656], indices int32 [n, topk]
        -> latent float32 [n, H, 512], through the step's sparse MLA provider."""
        out, _ = sparse_mla_attention(
            q,
            kv_cache,
            indices,
            self.softmax_scale,
            self.kernels.sparse_mla_provider,
            is_prefill,
            meta.flashmla_schedule,
        )
        return out.astype("float32")
