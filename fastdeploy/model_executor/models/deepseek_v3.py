"""DeepSeek-V3 (MLA attention, MoE) on paddle, with sliding-window (SWA) MLA layers.

A layer is SWA when ``config.is_swa_layer(layer_id)`` (``window_attn_skip_freq[layer_id] == 1``);
the choice is made once, at construction. Full layers go through MLAAttentionBackend (latent
cache in the model dtype, bf16 or FP8 records); SWA layers through ``forward_swa_static``: FP8
record cache, window indices from ``get_swa_indexer_top_k``, DSAAttentionBackend.
"""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy.config import ModelConfig
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.dsa_attention_backend import DSAAttentionBackend
from fastdeploy.model_executor.layers.attention.mla_attention_backend import MLAAttentionBackend
from fastdeploy.model_executor.layers.embeddings import ParallelLMHead, VocabParallelEmbedding
from fastdeploy.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from fastdeploy.model_executor.layers.moe import MLP, DeepseekV3MoE
from fastdeploy.model_executor.layers.normalization import RMSNorm
from fastdeploy.model_executor.layers.rotary_embedding import DeepseekRotaryEmbedding, deepseek_softmax_scale
from fastdeploy.model_executor.ops.triton_ops.launcher import kernels_enabled
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache import write_mla_fp8_cache, write_mla_fp8_cache_ref
from fastdeploy.model_executor.ops.triton_ops.swa_indexer import swa_indexer_ref, swa_indexer_triton


def get_swa_indexer_top_k(
    positions: paddle.Tensor,
    batch_id_per_token: paddle.Tensor,
    block_tables: paddle.Tensor,
    block_size: int,
    sliding_window: int,
    topk: int,
) -> paddle.Tensor:
    """int32 [T, topk]: each token's window slots in ascending position order, then -1
    (DESIGN.md §4). The Triton kernel where kernels run, else the paddle reference."""
    impl = swa_indexer_triton if kernels_enabled() else swa_indexer_ref
    return impl(positions, batch_id_per_token, block_tables, block_size, sliding_window, topk)


class DeepseekV3MLAAttention(nn.Layer):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: str) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        if self.kv_lora_rank != 512 or self.rope != 64:
            raise ValueError(
                f"config keys 'kv_lora_rank'={self.kv_lora_rank} / 'qk_rope_head_dim'={self.rope}: the MLA cache "
                "layout needs 512 and 64"
            )
        h, qk = cfg.hidden_size, cfg.qk_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(h, cfg.q_lora_rank, dtype=dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, self.num_heads * qk, dtype=dtype)
        else:
            self.q_proj = ColumnParallelLinear(h, self.num_heads * qk, dtype=dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_lora_rank + self.rope, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), dtype=dtype)
        self.o_proj = RowParallelLinear(self.num_heads * self.v_dim, h, dtype=dtype)
        self.w_uk = self.w_uv = None  # from kv_b_proj, by process_weights_after_loading

        self.is_swa = cfg.is_swa_layer(layer_id)
        theta = cfg.swa_rope_theta if self.is_swa and cfg.swa_rope_theta else cfg.rope_theta
        self.rotary_emb = DeepseekRotaryEmbedding(self.rope, theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.softmax_scale = deepseek_softmax_scale(qk, cfg.rope_scaling)
        self.sliding_window = cfg.sliding_window if self.is_swa else None
        if self.is_swa:
            self.dsa_backend = DSAAttentionBackend(self.softmax_scale)
        else:
            self.mla_backend = MLAAttentionBackend(self.softmax_scale)

    def process_weights_after_loading(self) -> None:
        """Split kv_b_proj into W_UK [H, nope, 512] and W_UV [H, v, 512], float32, once: the loader
        calls this after the weights land (call it again after changing kv_b_proj by hand), so a
        forward does not re-cast the whole projection. Costs 4 * H * (nope + v) * 512 bytes a layer."""
        w = self.kv_b_proj.weight.astype("float32").reshape([self.num_heads, self.nope + self.v_dim, self.kv_lora_rank])
        self.w_uk, self.w_uv = w[:, : self.nope].clone(), w[:, self.nope :].clone()  # contiguous copies

    def forward(self, hidden: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta) -> paddle.Tensor:
        """hidden [T, hidden] -> [T, hidden]."""
        T = hidden.shape[0]
        if hasattr(self, "q_proj"):
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.reshape([T, self.num_heads, self.nope + self.rope])
        kv_a = self.kv_a_proj_with_mqa(hidden)
        kv_c = self.kv_a_layernorm(kv_a[:, : self.kv_lora_rank])
        q_pe, k_pe = self.rotary_emb(meta.positions, q[:, :, self.nope :], kv_a[:, self.kv_lora_rank :])
        if self.w_uk is None:  # a model whose weights were not set by load_weights
            self.process_weights_after_loading()
        # absorbed query: q_nope through W_UK (per head), then the rotated rope part
        q_lat = paddle.einsum("thn,hnc->thc", q[:, :, : self.nope].astype("float32"), self.w_uk)
        q_abs = paddle.concat([q_lat, q_pe.astype("float32")], axis=-1)
        if self.is_swa:
            latent = self.forward_swa_static(q_abs, kv_c, k_pe, cache, meta)
        else:
            latent = self.mla_backend.forward(q_abs, kv_c, k_pe, cache, meta)
        out = paddle.einsum("thc,hvc->thv", latent.astype("float32"), self.w_uv)
        return self.o_proj(out.reshape([T, self.num_heads * self.v_dim]).astype(hidden.dtype))

    def forward_swa_static(
        self, q_abs: paddle.Tensor, kv_c: paddle.Tensor, k_pe: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta
    ) -> paddle.Tensor:
        """SWA attention: FP8 cache write, window indices, sparse MLA. -> latent float32 [T, H, 512]."""
        writer = write_mla_fp8_cache if kernels_enabled() else write_mla_fp8_cache_ref
        writer(kv_c, k_pe, meta.slot_mapping, cache)
        W = self.sliding_window
        key = ("swa_indices", W)
        if key not in meta.cache:  # the same for every SWA layer of the step
            meta.cache[key] = get_swa_indexer_top_k(
                meta.positions, meta.batch_id_per_token, meta.block_tables, meta.block_size, W, W
            )
        q = q_abs.astype(self.dsa_backend.q_dtype(kv_c.dtype))
        return self.dsa_backend.forward_static(q, cache, meta.cache[key], meta)


class DeepseekV3DecoderLayer(nn.Layer):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = DeepseekV3MLAAttention(cfg, layer_id, dtype)
        moe = cfg.n_routed_experts and layer_id >= cfg.first_k_dense_replace and layer_id % cfg.moe_layer_freq == 0
        self.mlp = DeepseekV3MoE(cfg, dtype) if moe else MLP(cfg.hidden_size, cfg.intermediate_size, dtype)

    def forward(self, x: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta) -> paddle.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Layer):
    def __init__(self, cfg: ModelConfig, dtype: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.LayerList([DeepseekV3DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, meta: ForwardMeta, caches: list[paddle.Tensor]) -> paddle.Tensor:
        x = self.embed_tokens(meta.input_ids)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, cache, meta)
        return self.norm(x)


class DeepseekV3ForCausalLM(nn.Layer):
    """Hidden states for every token; ``compute_logits`` for the tokens that sample."""

    def __init__(self, cfg: ModelConfig, dtype: str = "float32") -> None:
        super().__init__()
        self.config = cfg
        self.dtype_name = dtype
        self.model = DeepseekV3Model(cfg, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype)

    def forward(self, meta: ForwardMeta, caches: list[paddle.Tensor]) -> paddle.Tensor:
        with paddle.no_grad():
            return self.model(meta, caches)

    def compute_logits(self, hidden: paddle.Tensor, token_index: paddle.Tensor | None = None) -> paddle.Tensor:
        """float32 [n, vocab] for hidden[token_index] (all tokens when None)."""
        with paddle.no_grad():
            h = hidden if token_index is None else hidden[token_index]
            return self.lm_head(h)
