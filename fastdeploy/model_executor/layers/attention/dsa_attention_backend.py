"""DSAAttentionBackend: the whole attention of a sparse-MLA layer (the seed PR's name), whose keys
come from one of two index sets (docs/design.md §4.3-4.5, §4.17):

- an SWA layer (``sliding_window`` W): the window, the same slots for every SWA layer of a step
  (the kernel under ``get_swa_indexer_top_k``), over the 656-byte FP8 records of the "swa" group;
- a DSA layer (``index_topk`` K, DeepSeek-V3.2): the top K keys its own lightning indexer picks
  for each query, a layer's own slots, over the "full" group (DSA layers keep every token); its
  cache is an ``IndexedCache``: the latent in the full layers' format (``kv_cache_dtype``: FP8
  records with fp8) plus the indexer keys (e4m3 and a scale, 132 bytes a token at D 128, with
  fp8; else unquantized in the latent's dtype, the reference path held against Hugging Face).

- ``kv_spec``: the kind's cache layout.
- ``plan_step``: the token groups (prefill requests the cost model puts in MHA form, the rest
  absorbed; a DSA request goes the MHA form only while its context is no longer than K, where
  the pick keeps every key: the paper's masked MHA mode) and, when any token attends absorbed,
  the SWA kind's window slots padded once to the provider's multiple, or the DSA kind's
  ``index_rows`` (where each query's indexer keys lie); FlashMLA's sparse decode schedule.
- ``forward`` (MLABackendBase) writes the step's records and runs each group; absorbed groups go
  through ``forward_static``, the PR's entry point, which runs the provider on the slots.
  FlashMLA gets decodes (FP8 cache kernel) apart from prefills (bf16 gather kernel); the Triton
  kernel and the reference take both in one call, since all causality lives in the indices.
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy.config import FULL_GROUP, SWA_GROUP, CacheConfig, KernelConfig
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.base_backend import (
    IndexedCache,
    KVSpec,
    MLABackendBase,
    record_writer,
)
from fastdeploy.model_executor.layers.attention.sparse_mla_providers import provider_for, sparse_mla_attention
from fastdeploy.model_executor.layers.attention.step_plan import (
    StepPlan,
    TokenGroup,
    index_rows,
    plan_groups,
    round_up,
    window_indices,
)
from fastdeploy.model_executor.ops.triton_ops.lightning_indexer import (
    index_logits_ref,
    index_logits_triton,
    index_topk,
    index_topk_triton,
    quantize_pow2_e4m3,
    write_index_keys_ref,
    write_index_keys_triton,
)


class DSAAttentionBackend(MLABackendBase):
    """``sliding_window`` W > 0 (an SWA layer) or ``index_topk`` K > 0 (a DSA layer), not both;
    ``kv_cache_dtype``: the full layers' cache setting, which a DSA layer's cache follows."""

    def __init__(
        self,
        softmax_scale: float,
        sliding_window: int,
        kernels: KernelConfig,
        num_heads: int,
        model_dtype: str,
        index_topk: int = 0,
        kv_cache_dtype: str = "auto",
    ) -> None:
        super().__init__(softmax_scale, kernels, num_heads, model_dtype)
        if (sliding_window > 0) == (index_topk > 0):
            raise ValueError(
                f"DSAAttentionBackend: give a sliding_window or an index_topk, got {sliding_window}, {index_topk}"
            )
        self.sliding_window, self.index_topk = sliding_window, index_topk
        self.group = SWA_GROUP if sliding_window else FULL_GROUP
        if index_topk and self.provider.split_decode and kv_cache_dtype != "fp8":
            raise ValueError(
                "DSA (indexed) layers on FlashMLA need --kv-cache-dtype fp8: its sparse decode reads only the "
                f"656-byte FP8 cache (got kv_cache_dtype {kv_cache_dtype!r})"
            )

    @property
    def window(self) -> int:
        return self.sliding_window

    @property
    def kind(self) -> str:
        return f"swa:{self.sliding_window}" if self.sliding_window else f"dsa:{self.index_topk}"

    @staticmethod
    def kv_spec(cache_config: CacheConfig, model_dtype: str, index_head_dim: int = 0) -> KVSpec:
        """An SWA layer (``index_head_dim`` 0): the FP8 records of the swa group. A DSA layer: the
        full layers' latent format in the full group plus its indexer keys (``KVSpec.with_index``),
        FP8 with ``kv_cache_dtype`` fp8."""
        if not index_head_dim:
            return KVSpec.records(SWA_GROUP)
        kv = cache_config.kv_cache_dtype
        main = (
            KVSpec.records(FULL_GROUP)
            if kv == "fp8"
            else KVSpec.latent(FULL_GROUP, "bfloat16" if kv == "bf16" else model_dtype)
        )
        return main.with_index(index_head_dim, fp8=kv == "fp8")

    def plan_step(self, meta: ForwardMeta) -> StepPlan:
        provider = self.provider
        mha_max_end = self.index_topk or None
        groups = plan_groups(
            meta,
            self.sliding_window,
            self.group,
            provider,
            self.kernels.mla_prefill_form,
            self.num_heads,
            mha_max_end,
        )
        plan = StepPlan(groups, provider)
        if any(g.form != "mha" for g in groups):
            if self.index_topk:  # the reference's key gathers (the Triton kernel reads the tables)
                plan.index_rows = None if self.kernels.index_triton else index_rows(meta, FULL_GROUP)
            else:
                topk = round_up(self.sliding_window, provider.step_topk_multiple)
                plan.indices = window_indices(meta, SWA_GROUP, None, self.sliding_window, topk, self.kernels.triton)
        if any(g.form == "decode" for g in groups):
            plan.schedule = provider.decode_schedule()
        return plan

    def write_cache(self, kv_c: paddle.Tensor, k_pe: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta) -> None:
        self.write_latent(kv_c, k_pe, meta.slot_mapping[self.group], cache)

    def forward_indexed(
        self,
        q_nope: paddle.Tensor,
        q_pe: paddle.Tensor,
        kv_c: paddle.Tensor,
        k_pe: paddle.Tensor,
        cache: IndexedCache,
        meta: ForwardMeta,
        w_uk: paddle.Tensor,
        w_uv: paddle.Tensor,
        index_q: paddle.Tensor,
        index_k: paddle.Tensor,
        index_w: paddle.Tensor,
    ) -> paddle.Tensor:
        """A DSA layer: store its indexer keys index_k [T, D], pick each token's top K slots from
        index_q [T, Hi, D] and the head weights index_w [T, Hi] (rope applied, float32), then attend
        as ``forward`` does over those slots."""
        write = write_index_keys_triton if self.kernels.index_triton else write_index_keys_ref
        write(index_k, meta.slot_mapping[FULL_GROUP], cache.index)
        plan = meta.attn[self.kind]
        selection = None
        if any(g.form != "mha" for g in plan.groups):
            selection = self.select(index_q, index_w, cache.index, meta, plan)
        return self.forward(q_nope, q_pe, kv_c, k_pe, cache.kv, meta, w_uk, w_uv, selection)

    def select(
        self, q: paddle.Tensor, w: paddle.Tensor, index_cache: paddle.Tensor, meta: ForwardMeta, plan: StepPlan
    ) -> paddle.Tensor:
        """int32 [T, K'] (K rounded up to the provider's multiple): each token's top K slots by
        its index score (ties to the lower position), then -1. With an FP8 indexer cache q is
        quantized per head as the keys are, its scale folded into w. The logits of every token at
        every position of its block-table row and their pick come from the Triton kernels or the
        references (one key gather per ``plan.index_rows`` entry, a stable sort); the
        position-to-slot map is shared."""
        if index_cache.dtype == paddle.uint8:
            q, q_scale = quantize_pow2_e4m3(q)
            w = w * q_scale
        table, bs = meta.block_tables[FULL_GROUP], meta.block_size
        krow, ends = meta.batch_id_per_token, meta.positions.astype("int64") + 1
        width = table.shape[1] * bs
        if self.kernels.index_triton:
            logits = index_logits_triton(q, w, index_cache, table, krow, ends, width)
            picked = index_topk_triton(logits, ends, self.index_topk)
        else:
            logits = index_logits_ref(q, w, index_cache, plan.index_rows, width)
            picked = index_topk(logits, ends, self.index_topk)
        picked = picked.astype("int64")  # positions, -1 past the pick
        at = picked.clip(min=0)
        blk = paddle.take_along_axis(table.astype("int64")[krow], at // bs, 1)
        sel = paddle.where(picked >= 0, blk * bs + at % bs, picked).astype("int32")
        pad = round_up(self.index_topk, plan.provider.step_topk_multiple) - self.index_topk
        return paddle.concat([sel, paddle.full([sel.shape[0], pad], -1, "int32")], 1) if pad else sel

    def absorbed(
        self,
        q: paddle.Tensor,
        cache: paddle.Tensor,
        meta: ForwardMeta,
        plan: StepPlan,
        group: TokenGroup,
        selection: paddle.Tensor | None,
    ) -> paddle.Tensor:
        slots = plan.indices if selection is None else selection
        idx = slots if group.tokens is None else slots[group.tokens]
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
        """The seed PR's sparse MLA entry, for SWA and DSA layers alike: q [T, H, 576] (absorbed),
        indexer_topk int32 [T, 1, K] or [T, K] (-1 = none: the window's slots or the lightning
        indexer's pick), latent_cache uint8 [num_blocks, block_size, 1, 656] (or, for a DSA
        layer off FlashMLA, its [..., 576] latent) -> latent [T, H * 512] in q's dtype, through
        ``forward_meta.kernels``' sparse MLA provider.

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
