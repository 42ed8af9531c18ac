"""RMSNorm."""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy.model_executor.ops.triton_ops.rms_norm_kernel import launch_rms_norm


class RMSNorm(nn.Layer):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32, returned in x's dtype.
    ``triton``: one Triton launch (``ops/triton_ops/rms_norm_kernel.py``) instead of paddle's
    elementwise ops."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: str = "float32", triton: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.triton = triton
        self.weight = self.create_parameter(
            [hidden_size], dtype=dtype, default_initializer=nn.initializer.Constant(1.0)
        )

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.triton:
            x2 = x.reshape([-1, x.shape[-1]]).contiguous()
            out = paddle.empty(x2.shape, x.dtype)
            launch_rms_norm(x2, self.weight.detach(), out, self.eps)
            return out.reshape(x.shape)
        xf = x.astype("float32")
        y = xf * paddle.rsqrt(xf.pow(2).mean(axis=-1, keepdim=True) + self.eps)
        return (y * self.weight.astype("float32")).astype(x.dtype)
