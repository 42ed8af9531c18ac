"""DSAAttentionBackend: sparse MLA attention of SWA layers over the FP8 record cache.

One entry point for prefill-only, decode-only and mixed batches. The provider decides whether
the batch is split: FlashMLA has a decode kernel (FP8 cache) and a prefill kernel (bf16 gather),
so its tokens go in two groups; the Triton kernel and the reference take the whole mixed batch
in one call, since all causality lives in the indices. Index rows are padded with -1 to the
provider's topk multiple.
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.sparse_mla import select_provider, sparse_mla_attention, topk_multiple


def pad_topk(indices: paddle.Tensor, multiple: int) -> paddle.Tensor:
    extra = -indices.shape[1] % multiple
    if extra == 0:
        return indices
    return paddle.concat([indices, paddle.full([indices.shape[0], extra], -1, dtype=indices.dtype)], axis=1)


class DSAAttentionBackend:
    def __init__(self, softmax_scale: float, provider: str | None = None) -> None:
        self.softmax_scale = softmax_scale
        self.provider = provider

    def q_dtype(self, model_dtype) -> str:
        """bf16 for the GPU kernels (DESIGN.md section 4); a float32 CPU model keeps float32 on the
        reference, so SWA layers add no rounding beyond the FP8 cache."""
        if select_provider(self.provider) == "reference" and model_dtype == paddle.float32:
            return "float32"
        return "bfloat16"

    def token_groups(self, provider: str, meta: ForwardMeta) -> list[tuple[np.ndarray | None, bool]]:
        """(token ids or None for all, is_prefill) per call the provider needs."""
        if provider != "flashmla":
            return [(None, False)]
        h = meta.host
        prefill_tok = np.repeat(h["seq_lens_encoder"] > 0, h["seq_lens_this_time"])
        groups = [(np.nonzero(~prefill_tok)[0], False), (np.nonzero(prefill_tok)[0], True)]
        return [(tok, is_prefill) for tok, is_prefill in groups if tok.size]

    def forward_static(
        self, q: paddle.Tensor, kv_cache: paddle.Tensor, indices: paddle.Tensor, meta: ForwardMeta
    ) -> paddle.Tensor:
        """q bf16 [T, H, 576] (absorbed), kv_cache uint8 [num_blocks, block_size, 1, 656],
        indices int32 [T, topk] -> latent float32 [T, H, 512]."""
        provider = select_provider(self.provider)
        out = None
        for tok, is_prefill in self.token_groups(provider, meta):
            t = None if tok is None else paddle.to_tensor(tok)
            qs, idx = (q, indices) if t is None else (q[t], indices[t])
            idx = pad_topk(idx, topk_multiple(provider, is_prefill))
            o = sparse_mla_attention(qs, kv_cache, idx, self.softmax_scale, provider, is_prefill)[0].astype("float32")
            if t is None:
                return o
            out = paddle.zeros([q.shape[0], q.shape[1], 512], "float32") if out is None else out
            out[t] = o
        return out
