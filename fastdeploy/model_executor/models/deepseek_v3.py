"""DeepSeek-V3 (MLA attention, MoE) on paddle, with sliding-window (SWA) MLA layers.

The model does the projections and the layer wiring; each attention layer hands its query parts,
its new latent and W_UK / W_UV to one backend, chosen once at construction, which writes the
cache and attends in MHA or absorbed form per its kind's step plan: a layer is SWA when
``config.is_swa_layer(layer_id)`` (``window_attn_skip_freq[layer_id] == 1``), takes the
``forward_swa_static`` branch and has a DSAAttentionBackend (FP8 record cache, the window slots
from the kernel under ``get_swa_indexer_top_k``, sparse MLA); a DSA layer
(``config.is_indexed_layer``, DeepSeek-V3.2) has a DSAAttentionBackend too, over the top
``index_topk`` keys its own lightning indexer picks; full layers have an MLAAttentionBackend
(latent cache in the model dtype, bf16 or FP8 records). The seed PR's names are this path:
``get_swa_indexer_top_k`` (exported here), ``DeepseekV3MLAAttention.forward_swa_static`` and
``DSAAttentionBackend.forward_static``.
"""

from __future__ import annotations

import re

import numpy as np
import paddle
from paddle import nn

from fastdeploy.config import CacheConfig, FDConfig, KernelConfig, ModelConfig
from fastdeploy.distributed.parallel import TPGroup
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.base_backend import IndexedCache, KVSpec, MLABackendBase
from fastdeploy.model_executor.layers.attention.dsa_attention_backend import DSAAttentionBackend
from fastdeploy.model_executor.layers.attention.mla_attention_backend import MLAAttentionBackend
from fastdeploy.model_executor.layers.embeddings import ParallelLMHead, VocabParallelEmbedding
from fastdeploy.model_executor.layers.lightning_indexer import LightningIndexer
from fastdeploy.model_executor.layers.linear import (
    ColumnParallelLinear,
    FP8Linear,
    ReplicatedLinear,
    RowParallelLinear,
)
from fastdeploy.model_executor.layers.moe import MLP, DeepseekV3MoE
from fastdeploy.model_executor.layers.moe_dispatch import AllGatherDispatch
from fastdeploy.model_executor.layers.normalization import RMSNorm
from fastdeploy.model_executor.layers.rotary_embedding import DeepseekRotaryEmbedding, deepseek_softmax_scale
from fastdeploy.model_executor.ops.triton_ops.swa_indexer import get_swa_indexer_top_k

__all__ = ["DeepseekV3ForCausalLM", "DeepseekV3MLAAttention", "get_swa_indexer_top_k", "kv_spec_for", "layer_kv_specs"]

_ROPE_ROWS = re.compile(r"model\.layers\.\d+\.self_attn\.(q_b_proj|q_proj|kv_a_proj_with_mqa)\.weight$")
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight(_scale_inv)?$")


def rope_row_order(cfg: ModelConfig, name: str, rows: int) -> np.ndarray | None:
    """With ``rope_interleave`` false, the order of checkpoint tensor ``name``'s rows (``rows``: the
    whole heads this rank reads) that makes its rope outputs interleaved pairs, as the rotary
    reads them: pair i is (half row i, half row i + d/2), so rotating pairs rotates the halves as
    NeoX does and the output is the same. None for other tensors and interleaved checkpoints."""
    m = _ROPE_ROWS.match(name)
    if cfg.rope_interleave or m is None:
        return None
    d = cfg.qk_rope_head_dim
    pairs = np.stack([np.arange(d // 2), np.arange(d // 2) + d // 2], 1).reshape(-1)
    order = np.arange(rows)
    if m.group(1) == "kv_a_proj_with_mqa":  # [kv_lora_rank, rope]
        order[rows - d :] = rows - d + pairs
        return order
    for head in range(rows // cfg.qk_head_dim):  # [nope, rope] a head
        start = head * cfg.qk_head_dim + cfg.qk_nope_head_dim
        order[start : start + d] = start + pairs
    return order


def fp8_linears(cfg: ModelConfig, kernels: KernelConfig) -> FP8Linear | None:
    """How the decoder layers' linear layers keep an FP8 checkpoint's weights (None: de-quantized)."""
    return FP8Linear(triton=kernels.triton) if cfg.quantization == "fp8" else None


def attention_backend(
    cfg: ModelConfig, layer_id: int, dtype: str, kernels: KernelConfig, num_heads: int, kv_cache_dtype: str
) -> MLABackendBase:
    """The backend layer ``layer_id`` attends with: DSAAttentionBackend for an SWA or a DSA layer,
    else MLAAttentionBackend; ``num_heads`` this rank's heads."""
    scale = deepseek_softmax_scale(cfg.qk_head_dim, cfg.rope_scaling)
    if cfg.is_swa_layer(layer_id):
        return DSAAttentionBackend(scale, cfg.sliding_window, kernels, num_heads, dtype)
    if cfg.is_indexed_layer(layer_id):
        return DSAAttentionBackend(scale, 0, kernels, num_heads, dtype, cfg.index_topk, kv_cache_dtype)
    return MLAAttentionBackend(scale, kernels, num_heads, dtype, kv_cache_dtype)


def kv_spec_for(model_config: ModelConfig, cache_config: CacheConfig, layer_id: int) -> KVSpec:
    """What layer ``layer_id`` stores, as its backend's kind declares it (a pure function: no
    backend is built): the runner allocates it, ``tools/plan`` counts it, tests poison it."""
    if model_config.is_indexed_layer(layer_id):
        return DSAAttentionBackend.kv_spec(cache_config, model_config.dtype, model_config.index_head_dim)
    kind = DSAAttentionBackend if model_config.is_swa_layer(layer_id) else MLAAttentionBackend
    return kind.kv_spec(cache_config, model_config.dtype)


def layer_kv_specs(model_config: ModelConfig, cache_config: CacheConfig) -> list[KVSpec]:
    """``kv_spec_for`` of the decoder layers, then of the MTP layers the engine runs
    (``mtp_layers``)."""
    n = model_config.num_hidden_layers + model_config.mtp_layers
    return [kv_spec_for(model_config, cache_config, i) for i in range(n)]


class DeepseekV3MLAAttention(nn.Layer):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, dtype: str, kernels: KernelConfig, tp: TPGroup, kv_cache_dtype: str
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        lo, hi = tp.shard(cfg.num_attention_heads, "num_attention_heads")
        self.num_heads = hi - lo  # this rank's heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        if self.kv_lora_rank != 512 or self.rope != 64:
            raise ValueError(
                f"config keys 'kv_lora_rank'={self.kv_lora_rank} / 'qk_rope_head_dim'={self.rope}: the MLA cache "
                "layout needs 512 and 64"
            )
        h, qk, nh = cfg.hidden_size, cfg.qk_head_dim, cfg.num_attention_heads
        fp8, heads = fp8_linears(cfg, kernels), "num_attention_heads"
        if cfg.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(h, cfg.q_lora_rank, dtype, fp8)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype, kernels.triton)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, nh * qk, tp, heads, dtype, fp8)
        else:
            self.q_proj = ColumnParallelLinear(h, nh * qk, tp, heads, dtype, fp8)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_lora_rank + self.rope, dtype, fp8)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps, dtype, kernels.triton)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, nh * (self.nope + self.v_dim), tp, heads, dtype, fp8)
        self.o_proj = RowParallelLinear(nh * self.v_dim, h, tp, heads, dtype, fp8=fp8)
        self.w_uk = self.w_uv = None  # from kv_b_proj, by process_weights_after_loading

        self.is_swa = cfg.is_swa_layer(layer_id)
        theta = cfg.swa_rope_theta if self.is_swa and cfg.swa_rope_theta else cfg.rope_theta
        self.rotary_emb = DeepseekRotaryEmbedding(
            self.rope, theta, cfg.rope_scaling, cfg.max_position_embeddings, kernels.triton
        )
        self.attn_backend = attention_backend(cfg, layer_id, dtype, kernels, self.num_heads, kv_cache_dtype)
        self.indexer = LightningIndexer(cfg, dtype, fp8, self.rotary_emb) if cfg.is_indexed_layer(layer_id) else None

    def process_weights_after_loading(self) -> None:
        """Split kv_b_proj into W_UK [H, nope, 512] and W_UV [H, v, 512], float32, once: the loader
        calls this after the weights land (call it again after changing kv_b_proj by hand), so a
        forward does not re-cast the whole projection. Costs 4 * H * (nope + v) * 512 bytes a layer."""
        w = self.kv_b_proj.dequantized_weight().reshape([self.num_heads, self.nope + self.v_dim, self.kv_lora_rank])
        self.w_uk, self.w_uv = w[:, : self.nope].clone(), w[:, self.nope :].clone()  # contiguous copies

    def forward(self, hidden: paddle.Tensor, cache: paddle.Tensor | IndexedCache, meta: ForwardMeta) -> paddle.Tensor:
        """hidden [T, hidden] -> [T, hidden]; ``cache`` the layer's (a DSA layer's: an IndexedCache)."""
        T = hidden.shape[0]
        if hasattr(self, "q_proj"):
            q = self.q_proj(hidden)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_latent)
        q = q.reshape([T, self.num_heads, self.nope + self.rope])
        kv_a = self.kv_a_proj_with_mqa(hidden)
        kv_c = self.kv_a_layernorm(kv_a[:, : self.kv_lora_rank])
        q_pe, k_pe = self.rotary_emb(meta.positions, q, kv_a)
        if self.w_uk is None:  # a model whose weights were not set by load_weights
            self.process_weights_after_loading()
        q_nope = q[:, :, : self.nope]
        if self.is_swa:
            out = self.forward_swa_static(q_nope, q_pe, kv_c, k_pe, cache, meta)
        elif self.indexer is not None:
            index_q, index_k, index_w = self.indexer(hidden, q_latent, meta.positions)
            out = self.attn_backend.forward_indexed(
                q_nope, q_pe, kv_c, k_pe, cache, meta, self.w_uk, self.w_uv, index_q, index_k, index_w
            )
        else:
            out = self.attn_backend.forward(q_nope, q_pe, kv_c, k_pe, cache, meta, self.w_uk, self.w_uv)
        return self.o_proj(out.reshape([T, self.num_heads * self.v_dim]).astype(hidden.dtype))

    def forward_swa_static(
        self,
        q_nope: paddle.Tensor,
        q_pe: paddle.Tensor,
        kv_c: paddle.Tensor,
        k_pe: paddle.Tensor,
        cache: paddle.Tensor,
        meta: ForwardMeta,
    ) -> paddle.Tensor:
        """The seed PR's SWA branch (``window_attn_skip_freq[layer_id] == 1``): the DSA backend
        writes the step's FP8 records, then attends over the window its step plan indexed (the
        kernel under ``get_swa_indexer_top_k``): absorbed through ``DSAAttentionBackend.forward_static``, or in
        MHA form for the prefills the plan put there. q_nope [T, H, nope], q_pe [T, H, 64], kv_c
        [T, 512], k_pe [T, 64] -> float32 [T, H, v_head_dim]."""
        return self.attn_backend.forward(q_nope, q_pe, kv_c, k_pe, cache, meta, self.w_uk, self.w_uv)


class DeepseekV3DecoderLayer(nn.Layer):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        dtype: str,
        kernels: KernelConfig,
        tp: TPGroup,
        kv_cache_dtype: str,
        ep: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels.triton)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels.triton)
        self.self_attn = DeepseekV3MLAAttention(cfg, layer_id, dtype, kernels, tp, kv_cache_dtype)
        moe = cfg.n_routed_experts and layer_id >= cfg.first_k_dense_replace and layer_id % cfg.moe_layer_freq == 0
        fp8 = fp8_linears(cfg, kernels)
        if moe:
            dispatch = AllGatherDispatch(ep) if ep is not None else None
            self.mlp = DeepseekV3MoE(cfg, tp, dtype, fp8, kernels.triton, dispatch)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp, dtype, fp8=fp8)

    def forward(self, x: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta) -> paddle.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Layer):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: str,
        kernels: KernelConfig,
        tp: TPGroup,
        kv_cache_dtype: str,
        ep: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.LayerList(
            [
                DeepseekV3DecoderLayer(cfg, i, dtype, kernels, tp, kv_cache_dtype, ep)
                for i in range(cfg.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels.triton)

    def forward(self, meta: ForwardMeta, caches: list[paddle.Tensor]) -> paddle.Tensor:
        x = self.embed_tokens(meta.input_ids)
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            x = layer(x, cache, meta)
            if meta.layer_done is not None:
                meta.layer_done(i)
        return self.norm(x)


class DeepseekV3ForCausalLM(nn.Layer):
    """Hidden states for every token; ``compute_logits`` for the tokens that sample. Built from
    one ``fd_config``: its model config (with the model's ``dtype``), its kernel config (chosen
    once at start-up: which implementations the attention backends run) and its cache config
    (the full layers' ``kv_cache_dtype``); ``tp`` is this rank's tensor-parallel group (one rank
    by default), ``ep`` its expert-parallel group (None: the routed experts split over ``tp``)."""

    def __init__(self, fd_config: FDConfig, tp: TPGroup | None = None, ep: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup()
        cfg = fd_config.model_config
        self.config, self.tp = cfg, tp
        kv_cache_dtype = fd_config.cache_config.kv_cache_dtype
        self.model = DeepseekV3Model(cfg, cfg.dtype, fd_config.kernel_config, tp, kv_cache_dtype, ep)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, cfg.dtype)

    def checkpoint_row_order(self, name: str, rows: int) -> np.ndarray | None:
        return rope_row_order(self.config, name, rows)

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        """Where checkpoint tensor ``name`` loads: (parameter name, None) for a tensor of its own
        name, (stacked parameter, slice) for a routed expert's projection, None for another
        rank's expert."""
        m = _EXPERT.match(name)
        if m is None:
            return name, None
        layer = int(m.group(1))
        if not 0 <= layer < len(self.model.layers) or not hasattr(self.model.layers[layer].mlp, "checkpoint_target"):
            return name, None  # MTP layers, or a layer without routed experts: the loader reports it
        t = self.model.layers[layer].mlp.checkpoint_target(int(m.group(2)), m.group(3), m.group(4) or "")
        return None if t is None else (f"model.layers.{layer}.mlp.{t[0]}", t[1])

    def attention_backends(self) -> list[MLABackendBase]:
        """One backend of each attention kind the model has (full, or SWA of a window), in layer
        order: the step builder asks each for its kind's plan."""
        kinds: dict[str, MLABackendBase] = {}
        for layer in self.model.layers:
            kinds.setdefault(layer.self_attn.attn_backend.kind, layer.self_attn.attn_backend)
        return list(kinds.values())

    def forward(self, meta: ForwardMeta, caches: list[paddle.Tensor]) -> paddle.Tensor:
        with paddle.no_grad():
            return self.model(meta, caches)

    def compute_logits(self, hidden: paddle.Tensor, token_index: paddle.Tensor | None = None) -> paddle.Tensor:
        """float32 [n, vocab] for hidden[token_index] (all tokens when None)."""
        with paddle.no_grad():
            h = hidden if token_index is None else hidden[token_index]
            return self.lm_head(h)
