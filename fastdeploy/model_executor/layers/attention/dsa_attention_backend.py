"""DSAAttentionBackend: the whole attention of an SWA layer (the seed PR's name).

"SWA", "DSA" and "sparse MLA" name one path here: an SWA layer attends over its window through
the window indexer's slot ids and FlashMLA's sparse MLA contract over the 656-byte FP8 cache
(docs/design.md §4.3-4.5).
- ``kv_spec``: group "swa", uint8, 656 bytes a token, whatever the model dtype.
- ``plan_step``: the token groups (prefill requests the cost model puts in MHA form, the rest
  absorbed) and, when any token attends absorbed, every token's window slots (the kernel under
  ``get_swa_indexer_top_k``, on the step's device positions) padded once to the provider's
  multiple; FlashMLA's sparse decode schedule for the step.
- ``forward`` (MLABackendBase) writes the step's records and runs each group; absorbed groups go
  through ``forward_static``, the PR's entry point, which runs the provider on the window's slots.
  FlashMLA gets decodes (FP8 cache kernel) apart from prefills (bf16 gather kernel); the Triton
  kernel and the reference take both in one call, since all causality lives in the indices.
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy.config import SWA_GROUP, CacheConfig, KernelConfig
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.base_backend import KVSpec, MLABackendBase, record_writer
from fastdeploy.model_executor.layers.attention.sparse_mla_providers import provider_for, sparse_mla_attention
from fastdeploy.model_executor.layers.attention.step_plan import (
    StepPlan,
    TokenGroup,
    plan_groups,
    round_up,
    window_indices,
)


class DSAAttentionBackend(MLABackendBase):
    def __init__(
        self, softmax_scale: float, sliding_window: int, kernels: KernelConfig, num_heads: int, model_dtype: str
    ) -> None:
        super().__init__(softmax_scale, kernels, num_heads, model_dtype)
        self.sliding_window = sliding_window

    @property
    def window(self) -> int:
        return self.sliding_window

    @property
    def kind(self) -> str:
        return f"swa:{self.sliding_window}"

    @staticmethod
    def kv_spec(cache_config: CacheConfig, model_dtype: str) -> KVSpec:
        return KVSpec.records(SWA_GROUP)

    def plan_step(self, meta: ForwardMeta) -> StepPlan:
        provider = self.provider
        groups = plan_groups(
            meta, self.sliding_window, SWA_GROUP, provider, self.kernels.mla_prefill_form, self.num_heads
        )
        plan = StepPlan(groups, provider)
        if any(g.form != "mha" for g in groups):
            topk = round_up(self.sliding_window, provider.step_topk_multiple)
            plan.indices = window_indices(meta, SWA_GROUP, None, self.sliding_window, topk, self.kernels.triton)
        if any(g.form == "decode" for g in groups):
            plan.schedule = provider.decode_schedule()
        return plan

    def write_cache(self, kv_c: paddle.Tensor, k_pe: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta) -> None:
        self.write_records(kv_c, k_pe, meta.slot_mapping[SWA_GROUP], cache)

    def absorbed(
        self, q: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta, plan: StepPlan, group: TokenGroup
    ) -> paddle.Tensor:
        idx = plan.indices if group.tokens is None else plan.indices[group.tokens]
        out = self.forward_static(
            q=q,
            indexer_topk=idx,
            compressed_kv=None,
            k_pe=None,
            latent_cache=cache,
            forward_meta=meta,
            attn_softmax_scale=self.softmax_scale,
            is_prefill=group.is_prefill,
            schedule=plan.schedule,
        )
        return out.reshape([q.shape[0], q.shape[1], 512]).astype("float32")

    @staticmethod
    def forward_static(
        q: paddle.Tensor,
        indexer_topk: paddle.Tensor,
        compressed_kv: paddle.Tensor | None,
        k_pe: paddle.Tensor | None,
        latent_cache: paddle.Tensor,
        forward_meta: ForwardMeta,
        attn_softmax_scale: float,
        *,
        is_prefill: bool | None = None,
        schedule: object | None = None,
    ) -> paddle.Tensor:
        """The seed PR's sparse MLA entry: q [T, H, 576] (absorbed), indexer_topk int32 [T, 1, K]
        or [T, K] (-1 = none), latent_cache uint8 [num_blocks, block_size, 1, 656] -> latent
        [T, H * 512] in q's dtype, through ``forward_meta.kernels``' sparse MLA provider.

        With ``compressed_kv`` [T, 512] and ``k_pe`` [T, 64] it first writes their records at the
        step's SWA slots (the backend's forward has written them already and passes None).
        ``is_prefill`` None: q holds every token of the step, and a provider that splits decodes
        from prefills (``split_decode``: FlashMLA, heads padded to 64 / 128) runs the decode rows
        (requests with seq_lens_encoder 0) and the prefill rows in its two kernels; a bool: every
        row is of that kind (one of the step plan's groups).
        ``schedule``: FlashMLA's decode schedule for the step (None: made here)."""
        kernels = forward_meta.kernels
        if compressed_kv is not None:
            record_writer(kernels)(compressed_kv, k_pe, forward_meta.slot_mapping[SWA_GROUP], latent_cache)
        T, H = q.shape[0], q.shape[1]
        idx = indexer_topk.reshape([T, -1])
        provider = provider_for(kernels)

        def attend(rows_q, rows_idx, prefill):
            out, _ = sparse_mla_attention(
                rows_q, latent_cache, rows_idx, attn_softmax_scale, provider, prefill, schedule
            )
            return out

        if is_prefill is not None or not provider.split_decode:
            return attend(q, idx, bool(is_prefill)).reshape([T, H * 512])
        decode = forward_meta.seq_lens_encoder[forward_meta.host_batch_id] == 0
        out = paddle.zeros([T, H, 512], q.dtype)
        for rows, prefill in ((np.nonzero(decode)[0], False), (np.nonzero(~decode)[0], True)):
            if rows.size:
                r = paddle.to_tensor(rows)
                out[r] = attend(q[r], idx[r], prefill)
        return out.reshape([T, H * 512])
