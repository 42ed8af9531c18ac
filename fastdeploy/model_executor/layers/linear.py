"""Linear layers split for tensor parallelism (docs/design.md §4.9). Weights keep Hugging Face's
[out, in] layout so checkpoints load without transposes; each weight records the slice of the
checkpoint tensor this rank holds (``tp_shard`` = (dim, start, end, full size)) for the loader."""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy.distributed.parallel import TPGroup


class LinearBase(nn.Layer):
    """y = x @ W^T; W [out, in] (this rank's part)."""

    def __init__(self, in_features: int, out_features: int, dtype: str = "float32") -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = self.create_parameter([out_features, in_features], dtype=dtype)
        self.weight.tp_shard = None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(x, self.weight, transpose_y=True)


class ReplicatedLinear(LinearBase):
    """Whole on every rank."""


class ColumnParallelLinear(LinearBase):
    """Split by output features: this rank computes outputs [start, end); ``what`` names the
    split for errors."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, what: str, dtype: str = "float32") -> None:
        start, end = tp.shard(out_features, what)
        super().__init__(in_features, end - start, dtype)
        self.weight.tp_shard = (0, start, end, out_features)


class RowParallelLinear(LinearBase):
    """Split by input features: partial sums, all-reduced over ranks unless ``reduce`` is False
    (the caller then reduces once for several of them)."""

    def __init__(
        self, in_features: int, out_features: int, tp: TPGroup, what: str, dtype: str = "float32", reduce: bool = True
    ) -> None:
        start, end = tp.shard(in_features, what)
        super().__init__(end - start, out_features, dtype)
        self.weight.tp_shard = (1, start, end, in_features)
        self.tp, self.reduce = tp, reduce

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        y = super().forward(x)
        return self.tp.all_reduce(y) if self.reduce else y
