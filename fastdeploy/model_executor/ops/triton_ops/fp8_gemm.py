"""W8A8 block-scaled linear (docs/design.md §4.8): the paddle wrapper of ``fp8_gemm_kernel.py``
and the paddle reference beside it, which quantizes activations the same way and multiplies the
de-quantized operands in float32, so CPU and GPU models share their numerics.

x [M, K] (bf16 / float32), weight codes uint8 [N, K] (e4m3), weight_scale_inv float32
[ceil(N/128), ceil(K/128)] -> y [M, N] in x's dtype.
"""

from __future__ import annotations

import paddle

from fastdeploy.model_executor.ops.fp8_numerics import E4M3_TO_F32, FP8_BLOCK, FP8_MAX, dequant_fp8_blocks
from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import (
    SCALE_FLOOR,
    SPLIT_COUNTERS,
    launch_act_quant,
    launch_w8a8_gemm,
    tuned_config,
)
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache import e4m3_codes_ref


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def check_fp8_weight(weight: paddle.Tensor, scale: paddle.Tensor, name: str = "weight") -> None:
    """A ValueError naming the tensor when the codes or their scales do not fit."""
    if weight.dtype != paddle.uint8 or weight.ndim != 2:
        raise ValueError(f"{name}: FP8 weight codes must be uint8 [out, in], got {weight.dtype} {list(weight.shape)}")
    want = [_blocks(weight.shape[0]), _blocks(weight.shape[1])]
    if scale.dtype != paddle.float32 or list(scale.shape) != want:
        raise ValueError(
            f"{name}_scale_inv: must be float32 {want} for a {list(weight.shape)} weight, "
            f"got {scale.dtype} {list(scale.shape)}"
        )


_split_counters: dict[str, paddle.Tensor] = {}


def split_counters(place: paddle.CPUPlace | paddle.CUDAPlace) -> paddle.Tensor:
    """The split-K GEMM's per-tile arrival counters on a device: int32 [SPLIT_COUNTERS], zeroed
    once; every launch leaves them zero, so the GEMMs of one stream share them."""
    key = str(place)
    if key not in _split_counters:
        _split_counters[key] = paddle.zeros([SPLIT_COUNTERS], "int32").to(place)
    return _split_counters[key]


def w8a8_block_linear(
    x: paddle.Tensor, weight: paddle.Tensor, scale: paddle.Tensor, captured: bool = False
) -> paddle.Tensor:
    """The Triton kernels: quantize x (inside the GEMM at M <= 16 unless ``captured``), then the
    block-scaled FP8 GEMM (split K summed in the same launch), configured by ``tuned_config``;
    ``captured``: the call is part of a captured decode step."""
    check_fp8_weight(weight, scale)
    M, K, N = x.shape[0], x.shape[1], weight.shape[0]
    if K != weight.shape[1]:
        raise ValueError(f"w8a8_block_linear: x has {K} columns, the weight {weight.shape[1]}")
    cfg = tuned_config(M, N, K, captured=captured)
    if cfg["fuse_quant"]:
        a, a_s = x.contiguous(), None
    else:
        tma = bool(cfg.get("tma"))
        a = paddle.empty([M, K], "uint8")
        a_s = paddle.empty([_blocks(K), M] if tma else [M, _blocks(K)], "float32")
        launch_act_quant(x, a, a_s, m_major=tma)
    out = paddle.empty([M, N], x.dtype)
    part = paddle.empty([cfg["split_k"], M, N], "float32") if cfg["split_k"] > 1 else None
    launch_w8a8_gemm(a, a_s, weight, scale, out, cfg, part, split_counters(x.place) if part is not None else None)
    return out


def quantize_activations_ref(x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
    """x [M, K] -> (codes uint8 [M, K], scales float32 [M, ceil(K/128)]), in paddle ops."""
    M, K = x.shape
    kb = _blocks(K)
    xf = (
        paddle.nn.functional.pad(x.astype("float32"), [0, kb * FP8_BLOCK - K]) if K % FP8_BLOCK else x.astype("float32")
    )
    xb = xf.reshape([M, kb, FP8_BLOCK])
    s = paddle.clip(xb.abs().max(axis=-1), min=SCALE_FLOOR) / FP8_MAX
    codes = e4m3_codes_ref(paddle.clip(xb / s.unsqueeze(-1), -FP8_MAX, FP8_MAX)).reshape([M, kb * FP8_BLOCK])
    return codes[:, :K].contiguous(), s


def dequant_fp8_weight(weight: paddle.Tensor, scale: paddle.Tensor) -> paddle.Tensor:
    """codes uint8 [N, K] x scales -> float32 [N, K] (``fp8_numerics.dequant_fp8_blocks``)."""
    return paddle.to_tensor(dequant_fp8_blocks(weight.numpy(), scale.numpy()), place=weight.place)


def w8a8_block_linear_ref(x: paddle.Tensor, weight: paddle.Tensor, scale: paddle.Tensor) -> paddle.Tensor:
    """The same math in float32 paddle ops: quantized activations times de-quantized weights."""
    check_fp8_weight(weight, scale)
    codes, s = quantize_activations_ref(x)
    K = x.shape[1]
    xq = paddle.to_tensor(E4M3_TO_F32)[codes.astype("int64")] * s.repeat_interleave(FP8_BLOCK, 1)[:, :K]
    return paddle.matmul(xq, dequant_fp8_weight(weight, scale), transpose_y=True).astype(x.dtype)
