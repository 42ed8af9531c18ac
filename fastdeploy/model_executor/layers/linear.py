"""Linear layers shaped for tensor parallelism. Weights keep Hugging Face's [out, in] layout so
checkpoints load without transposes. With TP = 1 (all that is supported now) column and row
parallel layers hold the whole matrix; the split dimension is recorded for when TP arrives."""

from __future__ import annotations

import paddle
from paddle import nn


class LinearBase(nn.Layer):
    """y = x @ W^T (+ b); W [out, in]."""

    #: the weight dimension a TP split would cut: 0 (column / output), 1 (row / input), None (replicated)
    tp_split_dim: int | None = None

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype: str = "float32", tp_size: int = 1
    ) -> None:
        super().__init__()
        if tp_size != 1:
            raise ValueError(f"tensor_parallel_size={tp_size} is not supported yet; use 1")
        self.in_features, self.out_features = in_features, out_features
        self.weight = self.create_parameter([out_features, in_features], dtype=dtype)
        self.bias = self.create_parameter([out_features], dtype=dtype, is_bias=True) if bias else None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        y = paddle.matmul(x, self.weight, transpose_y=True)
        return y + self.bias if self.bias is not None else y


class ReplicatedLinear(LinearBase):
    tp_split_dim = None


class ColumnParallelLinear(LinearBase):
    tp_split_dim = 0


class RowParallelLinear(LinearBase):
    tp_split_dim = 1
