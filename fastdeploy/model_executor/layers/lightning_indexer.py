"""DeepSeek-V3.2's lightning indexer, the model side (``../shared/DESIGN.md`` §T): the index
queries, keys and head weights of a DSA layer, from its hidden state and its q latent.

    q = wq_b(q_latent)             [T, Hi, D]
    k = LayerNorm(wk(x))           [T, D]       (weight and bias, eps 1e-6, float32)
    w = weights_proj(x) * Hi^-0.5 * D^-0.5       [T, Hi]

RoPE rotates the first qk_rope_head_dim dims of q and k at each token's position with the
layer's own cos / sin: NeoX halves, or interleaved pairs with ``indexer_rope_interleave`` (the
rotated dims leave in the same order for q and k, so their dot products are the model's). The
weights are replicated on every tensor-parallel rank (all index heads everywhere: the pick is the
same on every rank, as one rank would make it); ``wq_b`` and ``wk`` stay FP8 where the model keeps
an FP8 checkpoint's projections, ``weights_proj`` is kept in the model dtype.
"""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy.config import ModelConfig
from fastdeploy.model_executor.layers.linear import FP8Linear, ReplicatedLinear
from fastdeploy.model_executor.layers.rotary_embedding import DeepseekRotaryEmbedding

K_NORM_EPS = 1e-6


def rotate(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, interleaved: bool) -> paddle.Tensor:
    """x [..., R] float32 rotated by cos / sin [..., R/2]: halves (x[:R/2], x[R/2:]) or, when
    ``interleaved``, pairs (x[2i], x[2i+1]), both returned as [rotated first, rotated second]."""
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    return paddle.concat([a * cos - b * sin, b * cos + a * sin], axis=-1)


class LightningIndexer(nn.Layer):
    def __init__(self, cfg: ModelConfig, dtype: str, fp8: FP8Linear | None, rotary: DeepseekRotaryEmbedding) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.interleaved = cfg.indexer_rope_interleave
        self.wq_b = ReplicatedLinear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype, fp8)
        self.wk = ReplicatedLinear(cfg.hidden_size, self.head_dim, dtype, fp8)
        self.k_norm = nn.LayerNorm(self.head_dim, epsilon=K_NORM_EPS)  # float32 weight and bias
        self.weights_proj = ReplicatedLinear(cfg.hidden_size, self.n_heads, dtype)
        self.cos, self.sin, self.max_position = rotary.cos, rotary.sin, rotary.max_position

    def forward(
        self, x: paddle.Tensor, q_latent: paddle.Tensor, positions: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """x [T, hidden], q_latent [T, q_lora_rank] (after q_a_layernorm), positions int64 [T] ->
        (q float32 [T, Hi, D], k float32 [T, D], w float32 [T, Hi]), rope applied."""
        T, R = x.shape[0], self.rope
        q = self.wq_b(q_latent).astype("float32").reshape([T, self.n_heads, self.head_dim])
        k = self.k_norm(self.wk(x).astype("float32"))
        pos = positions.astype("int64").clip(min=0, max=self.max_position - 1)
        cos, sin = self.cos[pos], self.sin[pos]  # [T, R/2]
        q = paddle.concat([rotate(q[..., :R], cos.unsqueeze(1), sin.unsqueeze(1), self.interleaved), q[..., R:]], -1)
        k = paddle.concat([rotate(k[:, :R], cos, sin, self.interleaved), k[:, R:]], -1)
        w = self.weights_proj(x).astype("float32") * (self.n_heads**-0.5 * self.head_dim**-0.5)
        return q, k, w
