"""DeepSeek-V3 (MLA attention, MoE) on paddle, with sliding-window (SWA) MLA layers.

The model does the projections and the layer wiring; each attention layer hands its query parts,
its new latent and W_UK / W_UV to one backend, chosen once at construction, which writes the
cache and attends in MHA or absorbed form per the step's groups: a layer is SWA when
``config.is_swa_layer(layer_id)`` (``window_attn_skip_freq[layer_id] == 1``) and then gets a
DSAAttentionBackend (FP8 record cache, the step's window indices, sparse MLA); full layers get
an MLAAttentionBackend (latent cache in the model dtype, bf16 or FP8 records).
"""

from __future__ import annotations

import re

import paddle
from paddle import nn

from fastdeploy.config import KernelConfig, ModelConfig
from fastdeploy.distributed.parallel import TPGroup
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.dsa_attention_backend import DSAAttentionBackend
from fastdeploy.model_executor.layers.attention.mla_attention_backend import MLAAttentionBackend
from fastdeploy.model_executor.layers.embeddings import ParallelLMHead, VocabParallelEmbedding
from fastdeploy.model_executor.layers.linear import (
    ColumnParallelLinear,
    FP8Linear,
    ReplicatedLinear,
    RowParallelLinear,
)
from fastdeploy.model_executor.layers.moe import MLP, DeepseekV3MoE
from fastdeploy.model_executor.layers.normalization import RMSNorm
from fastdeploy.model_executor.layers.rotary_embedding import DeepseekRotaryEmbedding, deepseek_softmax_scale

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight(_scale_inv)?$")


def fp8_linears(cfg: ModelConfig, kernels: KernelConfig) -> FP8Linear | None:
    """How the decoder layers' linear layers keep an FP8 checkpoint's weights (None: de-quantized)."""
    return FP8Linear(triton=kernels.triton) if cfg.quantization == "fp8" else None


class DeepseekV3MLAAttention(nn.Layer):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: str, kernels: KernelConfig, tp: TPGroup) -> None:
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
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, nh * qk, tp, heads, dtype, fp8)
        else:
            self.q_proj = ColumnParallelLinear(h, nh * qk, tp, heads, dtype, fp8)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_lora_rank + self.rope, dtype, fp8)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, nh * (self.nope + self.v_dim), tp, heads, dtype, fp8)
        self.o_proj = RowParallelLinear(nh * self.v_dim, h, tp, heads, dtype, fp8=fp8)
        self.w_uk = self.w_uv = None  # from kv_b_proj, by process_weights_after_loading

        self.is_swa = cfg.is_swa_layer(layer_id)
        theta = cfg.swa_rope_theta if self.is_swa and cfg.swa_rope_theta else cfg.rope_theta
        self.rotary_emb = DeepseekRotaryEmbedding(self.rope, theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.softmax_scale = deepseek_softmax_scale(qk, cfg.rope_scaling)
        if self.is_swa:
            self.attn_backend = DSAAttentionBackend(self.softmax_scale, cfg.sliding_window, kernels)
        else:
            self.attn_backend = MLAAttentionBackend(self.softmax_scale, kernels)

    def process_weights_after_loading(self) -> None:
        """Split kv_b_proj into W_UK [H, nope, 512] and W_UV [H, v, 512], float32, once: the loader
        calls this after the weights land (call it again after changing kv_b_proj by hand), so a
        forward does not re-cast the whole projection. Costs 4 * H * (nope + v) * 512 bytes a layer."""
        w = self.kv_b_proj.dequantized_weight().reshape([self.num_heads, self.nope + self.v_dim, self.kv_lora_rank])
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
        out = self.attn_backend.forward(q[:, :, : self.nope], q_pe, kv_c, k_pe, cache, meta, self.w_uk, self.w_uv)
        return self.o_proj(out.reshape([T, self.num_heads * self.v_dim]).astype(hidden.dtype))

    @property
    def sliding_window(self) -> int | None:
        """The window of an SWA layer's backend; None for a full layer."""
        return self.attn_backend.sliding_window if self.is_swa else None


class DeepseekV3DecoderLayer(nn.Layer):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: str, kernels: KernelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = DeepseekV3MLAAttention(cfg, layer_id, dtype, kernels, tp)
        moe = cfg.n_routed_experts and layer_id >= cfg.first_k_dense_replace and layer_id % cfg.moe_layer_freq == 0
        fp8 = fp8_linears(cfg, kernels)
        if moe:
            self.mlp = DeepseekV3MoE(cfg, tp, dtype, fp8, kernels.triton)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp, dtype, fp8=fp8)

    def forward(self, x: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta) -> paddle.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Layer):
    def __init__(self, cfg: ModelConfig, dtype: str, kernels: KernelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.LayerList(
            [DeepseekV3DecoderLayer(cfg, i, dtype, kernels, tp) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, meta: ForwardMeta, caches: list[paddle.Tensor]) -> paddle.Tensor:
        x = self.embed_tokens(meta.input_ids)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, cache, meta)
        return self.norm(x)


class DeepseekV3ForCausalLM(nn.Layer):
    """Hidden states for every token; ``compute_logits`` for the tokens that sample. ``kernels``
    (chosen once at start-up) says which implementations the attention backends run; ``tp`` is
    this rank's tensor-parallel group (one rank by default)."""

    def __init__(self, cfg: ModelConfig, dtype: str, kernels: KernelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup()
        self.config, self.tp = cfg, tp
        self.model = DeepseekV3Model(cfg, dtype, kernels, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)

    def owns_checkpoint_tensor(self, name: str) -> bool:
        """False for the routed experts another rank holds."""
        return self.checkpoint_target(name) is not None

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

    @property
    def sliding_windows(self) -> list[int]:
        """The distinct windows of the SWA layers (the step builder makes indices for each)."""
        return [w for w in self.attention_windows if w > 0]

    @property
    def attention_windows(self) -> list[int]:
        """The distinct windows of the attention layers, 0 for full layers (the step builder
        plans each one's token groups)."""
        return sorted({layer.self_attn.attn_backend.window for layer in self.model.layers})

    @property
    def num_local_heads(self) -> int:
        """Attention heads on this rank."""
        return self.model.layers[0].self_attn.num_heads

    def forward(self, meta: ForwardMeta, caches: list[paddle.Tensor]) -> paddle.Tensor:
        with paddle.no_grad():
            return self.model(meta, caches)

    def compute_logits(self, hidden: paddle.Tensor, token_index: paddle.Tensor | None = None) -> paddle.Tensor:
        """float32 [n, vocab] for hidden[token_index] (all tokens when None)."""
        with paddle.no_grad():
            h = hidden if token_index is None else hidden[token_index]
            return self.lm_head(h)
