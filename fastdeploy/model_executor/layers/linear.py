"""Linear layers split for tensor parallelism (docs/design.md §4.9). Weights keep Hugging Face's
[out, in] layout so checkpoints load without transposes; each weight records the slice of the
checkpoint tensor this rank holds (``tp_shard`` = (dim, start, end, full size)) for the loader.

With ``fp8`` (an FP8 checkpoint kept FP8, docs/design.md §4.8) the weight is its e4m3 codes
(uint8 [out, in]) and ``weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)], loaded as the
checkpoint stores them; the forward is the W8A8 block GEMM (Triton) or its reference (CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import paddle
from paddle import nn

from fastdeploy.distributed.parallel import TPGroup
from fastdeploy.model_executor.ops.triton_ops.fp8_gemm import (
    FP8_BLOCK,
    dequant_fp8_weight,
    w8a8_block_linear,
    w8a8_block_linear_ref,
)


@dataclass(frozen=True)
class FP8Linear:
    """Linear layers keep FP8 block weights; ``triton``: the GEMM runs as Triton kernels."""

    triton: bool = False


class LinearBase(nn.Layer):
    """y = x @ W^T; W [out, in] (this rank's part), in ``dtype`` or FP8 codes with ``fp8``.
    ``captured_step``: True while a captured decode step runs (``captured_gemms``), when the FP8
    GEMM takes its captured configuration."""

    captured_step = False

    def __init__(
        self, in_features: int, out_features: int, dtype: str = "float32", fp8: FP8Linear | None = None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fp8 = fp8
        zero = nn.initializer.Constant(0)
        if fp8 is None:
            self.weight = self.create_parameter([out_features, in_features], dtype=dtype)
        else:
            self.weight = self.create_parameter([out_features, in_features], dtype="uint8", default_initializer=zero)
            blocks = [-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK)]
            self.weight_scale_inv = self.create_parameter(blocks, dtype="float32", default_initializer=zero)
            self.weight.stop_gradient = self.weight_scale_inv.stop_gradient = True  # the kernels take them by DLPack
        self.weight.tp_shard = None

    def dequantized_weight(self) -> paddle.Tensor:
        """float32 [out, in]: the weight as the model computes with it."""
        if self.fp8 is None:
            return self.weight.astype("float32")
        return dequant_fp8_weight(self.weight, self.weight_scale_inv)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.fp8 is None:
            return paddle.matmul(x, self.weight, transpose_y=True)
        x2 = x.reshape([-1, self.in_features])
        if self.fp8.triton:
            y = w8a8_block_linear(x2, self.weight, self.weight_scale_inv, captured=self.captured_step)
        else:
            y = w8a8_block_linear_ref(x2, self.weight, self.weight_scale_inv)
        return y.reshape(list(x.shape[:-1]) + [self.out_features])


class ReplicatedLinear(LinearBase):
    """Whole on every rank."""


class ColumnParallelLinear(LinearBase):
    """Split by output features: this rank computes outputs [start, end); ``what`` names the
    split for errors."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPGroup,
        what: str,
        dtype: str = "float32",
        fp8: FP8Linear | None = None,
    ) -> None:
        start, end = tp.shard(out_features, what)
        super().__init__(in_features, end - start, dtype, fp8)
        self.weight.tp_shard = (0, start, end, out_features)


class RowParallelLinear(LinearBase):
    """Split by input features: partial sums, all-reduced over ranks unless ``reduce`` is False
    (the caller then reduces once for several of them)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPGroup,
        what: str,
        dtype: str = "float32",
        reduce: bool = True,
        fp8: FP8Linear | None = None,
    ) -> None:
        start, end = tp.shard(in_features, what)
        super().__init__(end - start, out_features, dtype, fp8)
        self.weight.tp_shard = (1, start, end, in_features)
        self.tp, self.reduce = tp, reduce

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        y = super().forward(x)
        return self.tp.all_reduce(y) if self.reduce else y


@contextmanager
def captured_gemms(model: nn.Layer) -> Iterator[None]:
    """Inside, every linear of ``model`` runs as part of a captured decode step: the FP8 GEMMs
    take ``tuned_config(..., captured=True)`` (a graph's launches cost no host time; docs/design.md
    §4.8). The step's warm-up runs inside too, so the kernels of those configs compile before the
    capture, which refuses module loads."""
    layers = [layer for layer in model.sublayers(include_self=True) if isinstance(layer, LinearBase)]
    for layer in layers:
        layer.captured_step = True
    try:
        yield
    finally:
        for layer in layers:
            layer.captured_step = False
