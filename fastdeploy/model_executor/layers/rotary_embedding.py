"""DeepSeek-V3 rotary embedding with YaRN scaling, on the qk_rope_head_dim part.

Hugging Face's DeepSeek-V3 checkpoints rotate interleaved pairs (x[2i], x[2i+1]): the input is
de-interleaved to [x0, x2, ..., x1, x3, ...] and then rotated half against half. q_pe and k_pe
leave in that de-interleaved order; their dot product is the same either way.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
from paddle import nn

from fastdeploy.model_executor.ops.triton_ops.rotary_kernel import launch_rope


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_attention_factor(rope_scaling: dict) -> float:
    """The cos/sin multiplier, as Hugging Face reads a YaRN config: ``attention_factor`` when
    given; else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (and
    non-zero); else mscale(factor)."""
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor, m, m_all = float(rope_scaling["factor"]), rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if m and m_all:
        return yarn_get_mscale(factor, m) / yarn_get_mscale(factor, m_all)
    return yarn_get_mscale(factor)


def yarn_inv_freq(dim: int, base: float, rope_scaling: dict | None, max_position: int = 0) -> tuple[np.ndarray, float]:
    """float64 inverse frequencies [dim // 2] and the cos/sin multiplier (``yarn_attention_factor``).
    ``original_max_position_embeddings`` defaults to ``max_position`` (the config's
    max_position_embeddings), beta_fast / beta_slow to 32 / 1; ``truncate`` (default true)
    rounds the correction range out to whole dimensions."""
    freq_extra = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if not rope_scaling:
        return freq_extra, 1.0
    kind = rope_scaling.get("type", rope_scaling.get("rope_type"))
    if kind != "yarn":
        raise ValueError(f"config key 'rope_scaling' type {kind!r} is not supported (only 'yarn')")
    factor = float(rope_scaling["factor"])
    orig = int(rope_scaling.get("original_max_position_embeddings") or max_position)
    beta_fast, beta_slow = float(rope_scaling.get("beta_fast") or 32), float(rope_scaling.get("beta_slow") or 1)
    freq_inter = freq_extra / factor
    low, high = _correction_dim(beta_fast, dim, base, orig), _correction_dim(beta_slow, dim, base, orig)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extra_mask = 1.0 - ramp
    inv_freq = freq_inter * (1 - extra_mask) + freq_extra * extra_mask
    return inv_freq, yarn_attention_factor(rope_scaling)


def deepseek_softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """qk_head_dim^-0.5 * mscale^2 with YaRN's mscale (docs/design.md §4.6)."""
    scale = qk_head_dim**-0.5
    if rope_scaling and rope_scaling.get("mscale_all_dim"):
        m = yarn_get_mscale(float(rope_scaling["factor"]), rope_scaling["mscale_all_dim"])
        scale *= m * m
    return scale


class DeepseekRotaryEmbedding(nn.Layer):
    """Applies rotary to the last d columns of q [T, H, *] and k [T, *] at absolute positions
    [T]; ``triton``: as one Triton launch (``ops/triton_ops/rotary_kernel.py``)."""

    def __init__(
        self, dim: int, base: float, rope_scaling: dict | None, max_position: int, triton: bool = False
    ) -> None:
        super().__init__()
        self.dim, self.triton = dim, triton
        inv_freq, mscale = yarn_inv_freq(dim, base, rope_scaling, max_position)
        freqs = np.outer(np.arange(max_position, dtype=np.float64), inv_freq)
        self.max_position = max_position
        self.cos = paddle.to_tensor(np.cos(freqs) * mscale, dtype="float32")  # [P, d/2]
        self.sin = paddle.to_tensor(np.sin(freqs) * mscale, dtype="float32")

    def _rotate(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        xf = x.astype("float32")
        even, odd = xf[..., 0::2], xf[..., 1::2]  # de-interleave the pairs
        return paddle.concat([even * cos - odd * sin, odd * cos + even * sin], axis=-1).astype(x.dtype)

    def forward(self, positions: paddle.Tensor, q: paddle.Tensor, k: paddle.Tensor):
        """-> q_pe [T, H, d], k_pe [T, d], rotated, in q's dtype."""
        if self.triton:
            q_pe = paddle.empty([q.shape[0], q.shape[1], self.dim], q.dtype)
            k_pe = paddle.empty([k.shape[0], self.dim], q.dtype)
            launch_rope(positions, q, k, self.cos, self.sin, q_pe, k_pe)
            return q_pe, k_pe
        q_pe, k_pe = q[:, :, -self.dim :], k[:, -self.dim :]
        # no host check here (a decode step never syncs): the engine keeps positions below
        # max_model_len <= max_position_embeddings (config check); padding rows sit at -1 or 0
        pos = positions.astype("int64").clip(min=0, max=self.max_position - 1)
        cos, sin = self.cos[pos], self.sin[pos]  # [T, d/2]
        return self._rotate(q_pe, cos.unsqueeze(1), sin.unsqueeze(1)), self._rotate(k_pe, cos, sin)
