"""MLAAttentionBackend: full (causal) MLA attention over a paged latent cache.

- ``kv_spec``: group "full"; 576 latent values (512 kv_c, then 64 rope) in the model dtype
  (``kv_cache_dtype`` auto) or bf16, or the 656-byte FP8 record (uint8) with "fp8".
- ``plan_step``: the token groups (prefill requests in MHA form over the whole context, the rest
  absorbed); an absorbed group's whole-context slots (the window indexer with a window as long as
  the group's longest context), or, for FlashMLA's decodes over a bf16 cache, the group's
  block-table rows and cache lengths for its dense decode, with one dense schedule a step.
- ``forward`` (MLABackendBase): absorbed groups go through the same provider switch as SWA
  layers (``sparse_mla_attention``).
"""

from __future__ import annotations

import paddle

from fastdeploy.config import FULL_GROUP, CacheConfig, KernelConfig
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.base_backend import KVSpec, MLABackendBase
from fastdeploy.model_executor.layers.attention.sparse_mla_providers import DenseDecode, sparse_mla_attention
from fastdeploy.model_executor.layers.attention.step_plan import (
    StepPlan,
    TokenGroup,
    plan_groups,
    round_up,
    window_indices,
)


class MLAAttentionBackend(MLABackendBase):
    """Causal attention of each request's tokens over its cached context; ``kv_cache_dtype`` is
    the full layers' cache setting (CacheConfig.kv_cache_dtype)."""

    def __init__(
        self, softmax_scale: float, kernels: KernelConfig, num_heads: int, model_dtype: str, kv_cache_dtype: str
    ) -> None:
        super().__init__(softmax_scale, kernels, num_heads, model_dtype)
        self.cache_spec = self.kv_spec(CacheConfig(kv_cache_dtype=kv_cache_dtype), model_dtype)

    @property
    def kind(self) -> str:
        return FULL_GROUP

    @staticmethod
    def kv_spec(cache_config: CacheConfig, model_dtype: str) -> KVSpec:
        if cache_config.kv_cache_dtype == "fp8":
            return KVSpec.records(FULL_GROUP)
        return KVSpec.latent(FULL_GROUP, "bfloat16" if cache_config.kv_cache_dtype == "bf16" else model_dtype)

    def plan_step(self, meta: ForwardMeta) -> StepPlan:
        provider = self.provider
        groups = plan_groups(meta, 0, FULL_GROUP, provider, self.kernels.mla_prefill_form, self.num_heads)
        dense = provider.dense_decode(self.cache_spec.dtype)
        plan = StepPlan(groups, provider)
        for g in groups:
            if g.form == "mha":
                continue
            if dense and g.form == "decode":  # from the device tables and positions: a captured step has no others
                table, pos = meta.block_tables[FULL_GROUP], meta.positions
                if g.tokens is not None:
                    table, pos = table[meta.batch_id_per_token[g.tokens]], pos[g.tokens]
                g.dense_decode = DenseDecode(table, (pos + 1).astype("int32"))
            else:
                longest = int((meta.seq_lens_decoder[g.requests] + meta.seq_lens_this_time[g.requests]).max())
                topk = round_up(longest, provider.step_topk_multiple)
                g.indices = window_indices(meta, FULL_GROUP, g.tokens, longest, topk, self.kernels.triton)
        if any(g.form == "decode" for g in groups):
            plan.schedule = provider.decode_schedule()
        return plan

    def write_cache(self, kv_c: paddle.Tensor, k_pe: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta) -> None:
        self.write_latent(kv_c, k_pe, meta.slot_mapping[FULL_GROUP], cache)

    def absorbed(
        self,
        q: paddle.Tensor,
        cache: paddle.Tensor,
        meta: ForwardMeta,
        plan: StepPlan,
        group: TokenGroup,
        selection: paddle.Tensor | None,
    ) -> paddle.Tensor:
        out, _ = sparse_mla_attention(
            q,
            cache,
            group.indices,
            self.softmax_scale,
            plan.provider,
            group.is_prefill,
            plan.schedule,
            group.dense_decode,
        )
        return out.astype("float32")
