"""The 656-byte FP8 MLA cache record (docs/design.md §4.4, FlashMLA's sparse format).

    bytes   0..511  kv_c (512 latent values) as float8_e4m3fn, tile i = values 128*i..128*i+127
    bytes 512..527  4 float32 scales, one per tile: the smallest power of two >= amax / 448
                    (2^-126 at least; an all-zero tile gets 1); byte = e4m3(x / scale)
    bytes 528..655  k_pe (64 rope values) as bf16

``write_mla_fp8_cache`` quantizes and scatters records to a uint8 cache [num_blocks, block_size,
1, 656] at slot_mapping (slots < 0 skipped); ``dequant_mla_fp8_cache`` turns uint8 [..., 656]
records back into bf16 [..., 576] (512 latent then 64 rope). Each has a paddle reference here.
"""

from __future__ import annotations

from functools import lru_cache

import paddle

from fastdeploy.model_executor.ops.fp8_numerics import E4M3_TO_F32, FP8_MAX, e4m3_encode
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache_kernel import (
    LATENT,
    N_TILES,
    RECORD_BYTES,
    ROPE,
    ROPE_OFFSET,
    SCALE_OFFSET,
    TILE,
    launch_dequant_mla_fp8_cache,
    launch_write_mla_fp8_cache,
)


def _check_write_args(kv_c: paddle.Tensor, k_pe: paddle.Tensor, slot_mapping: paddle.Tensor, cache: paddle.Tensor):
    T = kv_c.shape[0]
    if list(kv_c.shape) != [T, LATENT] or list(k_pe.shape) != [T, ROPE] or list(slot_mapping.shape) != [T]:
        raise ValueError(
            f"write_mla_fp8_cache: kv_c must be [T, 512], k_pe [T, 64], slot_mapping [T]; got "
            f"{list(kv_c.shape)}, {list(k_pe.shape)}, {list(slot_mapping.shape)}"
        )
    if cache.dtype != paddle.uint8 or cache.shape[-1] != RECORD_BYTES:
        raise ValueError(f"write_mla_fp8_cache: cache must be uint8 [..., 656], got {cache.dtype} {list(cache.shape)}")


def write_mla_fp8_cache(
    kv_c: paddle.Tensor, k_pe: paddle.Tensor, slot_mapping: paddle.Tensor, cache: paddle.Tensor
) -> None:
    """Quantize kv_c [T, 512] and k_pe [T, 64] (bf16/fp32) into 656-byte records of the uint8
    cache [num_blocks, block_size, 1, 656] at slot_mapping int32 [T]; slots < 0 are skipped."""
    _check_write_args(kv_c, k_pe, slot_mapping, cache)
    launch_write_mla_fp8_cache(kv_c.contiguous(), k_pe.contiguous(), slot_mapping.astype("int32"), cache)


def dequant_mla_fp8_cache(records: paddle.Tensor) -> paddle.Tensor:
    """uint8 [..., 656] records -> bf16 [..., 576]."""
    if records.dtype != paddle.uint8 or records.shape[-1] != RECORD_BYTES:
        raise ValueError(
            f"dequant_mla_fp8_cache: records must be uint8 [..., 656], got {records.dtype} {records.shape}"
        )
    lead = list(records.shape[:-1])
    flat = records.reshape([-1, RECORD_BYTES]).contiguous()
    out = paddle.empty([flat.shape[0], LATENT + ROPE], dtype="bfloat16")
    launch_dequant_mla_fp8_cache(flat, out)
    return out.reshape(lead + [LATENT + ROPE])


# ---------------------------------------------------------------- paddle references


def e4m3_codes_ref(q: paddle.Tensor) -> paddle.Tensor:
    """float32 |q| <= 448 -> uint8 e4m3fn codes (``fp8_numerics.e4m3_encode``), as a paddle tensor."""
    return paddle.to_tensor(e4m3_encode(q.numpy()), place=q.place)


def quantize_mla_record_ref(kv_c: paddle.Tensor, k_pe: paddle.Tensor) -> paddle.Tensor:
    """kv_c [T, 512], k_pe [T, 64] -> uint8 [T, 656] records, in paddle ops."""
    T = kv_c.shape[0]
    x = kv_c.astype("float32").reshape([T, N_TILES, TILE])
    amax = x.abs().max(axis=-1)
    raw = amax / FP8_MAX  # float32, as the kernel divides
    e = paddle.ceil(paddle.log2(paddle.where(raw > 0, raw, paddle.ones_like(raw)).astype("float64"))).clip(min=-126)
    pow2 = paddle.full_like(e, 2.0).pow(e)
    scale = paddle.where(amax > 0, pow2, paddle.ones_like(pow2)).astype("float32")
    q = (x / scale.unsqueeze(-1)).clip(-FP8_MAX, FP8_MAX)
    codes = e4m3_codes_ref(q).reshape([T, LATENT])
    scale_bytes = scale.contiguous().view("uint8").reshape([T, 16])
    rope_bytes = k_pe.astype("bfloat16").contiguous().view("uint8").reshape([T, 2 * ROPE])
    return paddle.concat([codes, scale_bytes, rope_bytes], axis=1)


def write_mla_fp8_cache_ref(
    kv_c: paddle.Tensor, k_pe: paddle.Tensor, slot_mapping: paddle.Tensor, cache: paddle.Tensor
) -> None:
    """Paddle reference of ``write_mla_fp8_cache`` (writes ``cache`` in place)."""
    _check_write_args(kv_c, k_pe, slot_mapping, cache)
    keep = paddle.nonzero(slot_mapping >= 0).flatten()
    if keep.shape[0] == 0:
        return
    rec = quantize_mla_record_ref(kv_c[keep], k_pe[keep])
    cache.reshape([-1, RECORD_BYTES])[slot_mapping.astype("int64")[keep]] = rec  # reshape is a view


@lru_cache(maxsize=4)
def _e4m3_table(place: str) -> paddle.Tensor:
    """float32 [256], each e4m3 code's value, uploaded once per device (a captured step uploads
    nothing)."""
    return paddle.to_tensor(E4M3_TO_F32)


def dequant_mla_fp8_cache_ref(records: paddle.Tensor) -> paddle.Tensor:
    """Paddle reference of ``dequant_mla_fp8_cache``: uint8 [..., 656] -> bf16 [..., 576]."""
    lead = list(records.shape[:-1])
    flat = records.reshape([-1, RECORD_BYTES])
    n = flat.shape[0]
    table = _e4m3_table(str(records.place))
    vals = table[flat[:, :LATENT].astype("int64")].reshape([n, N_TILES, TILE])
    scale = flat[:, SCALE_OFFSET:ROPE_OFFSET].contiguous().view("float32").reshape([n, N_TILES, 1])
    lat = (vals * scale).reshape([n, LATENT]).astype("bfloat16")
    pe = flat[:, ROPE_OFFSET:].contiguous().view("bfloat16").reshape([n, ROPE])
    return paddle.concat([lat, pe], axis=1).reshape(lead + [LATENT + ROPE])
