"""RMSNorm."""

from __future__ import annotations

import paddle
from paddle import nn


class RMSNorm(nn.Layer):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32, returned in x's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: str = "float32") -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter(
            [hidden_size], dtype=dtype, default_initializer=nn.initializer.Constant(1.0)
        )

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        xf = x.astype("float32")
        y = xf * paddle.rsqrt(xf.pow(2).mean(axis=-1, keepdim=True) + self.eps)
        return (y * self.weight.astype("float32")).astype(x.dtype)
