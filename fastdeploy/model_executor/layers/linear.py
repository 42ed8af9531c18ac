"""Linear layers named for their tensor-parallel role (column: split by output, row: split by
input, replicated). Weights keep Hugging Face's [out, in] layout so checkpoints load without
transposes. With TP = 1 (all that is supported now) every layer holds the whole matrix."""

from __future__ import annotations

import paddle
from paddle import nn


class LinearBase(nn.Layer):
    """y = x @ W^T (+ b); W [out, in]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: str = "float32") -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = self.create_parameter([out_features, in_features], dtype=dtype)
        self.bias = self.create_parameter([out_features], dtype=dtype, is_bias=True) if bias else None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        y = paddle.matmul(x, self.weight, transpose_y=True)
        return y + self.bias if self.bias is not None else y


class ReplicatedLinear(LinearBase):
    """Whole on every rank."""


class ColumnParallelLinear(LinearBase):
    """Split by output features under TP."""


class RowParallelLinear(LinearBase):
    """Split by input features under TP (partial sums all-reduced)."""
