"""The 656-byte FP8 MLA cache record (DESIGN.md §4, FlashMLA's sparse format).

    bytes   0..511  kv_c (512 latent values) as float8_e4m3fn, tile i = values 128*i..128*i+127
    bytes 512..527  4 float32 scales, one per tile: the smallest power of two >= amax / 448
                    (2^-126 at least; an all-zero tile gets 1); byte = e4m3(x / scale)
    bytes 528..655  k_pe (64 rope values) as bf16

``write_mla_fp8_cache`` quantizes and scatters records to a uint8 cache [num_blocks, block_size,
1, 656] at slot_mapping (slots < 0 skipped); ``dequant_mla_fp8_cache`` turns uint8 [..., 656]
records back into bf16 [..., 576] (512 latent then 64 rope). Each has a paddle reference here.
"""

from __future__ import annotations

import paddle
import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops.launcher import launch

RECORD_BYTES = 656
LATENT, ROPE, TILE, N_TILES = 512, 64, 128, 4
SCALE_OFFSET, ROPE_OFFSET = 512, 528
FP8_MAX = 448.0


@triton.jit
def _pow2_ceil(s):
    """Smallest power of two >= s for s > 0 (float32), at least 2^-126, from the bits."""
    bits = s.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.maximum(e, -126)
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_byte(x):
    """float32 x with |x| <= 448 -> e4m3fn byte, round to nearest even, done in integers and
    exact float adds so the interpreter and the GPU give the same bytes (the interpreter's own
    fp8 cast does not round to nearest even nor keep subnormals)."""
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # binade; subnormals share 2^-6's quantum
    magic = ((e - 3 + 23 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3) * 2^23
    r = (a + magic) - magic  # rounds a to a multiple of 2^(e-3), ties to even
    rb = r.to(tl.int32, bitcast=True)
    re = ((rb >> 23) & 0xFF) - 127
    normal = ((re + 7) << 3) | ((rb >> 20) & 7)
    sub = (r * 512.0).to(tl.int32)  # r = k * 2^-9, k in 0..8 (8 is the smallest normal, byte 8)
    byte = tl.where(re >= -6, normal, sub)
    byte = tl.where(x < 0, byte | 0x80, byte)
    return byte.to(tl.uint8)


@triton.jit
def _write_kernel(
    kv_c_ptr, k_pe_ptr, slot_ptr, cache_ptr, T,
    stride_kv, stride_pe,
    BLOCK_T: tl.constexpr,
):  # fmt: skip
    """One program writes BLOCK_T records: [BLOCK_T, 4, 128] latent tiles, [BLOCK_T, 64] rope."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < T, other=-1).to(tl.int64)
    ok = slot >= 0
    tile = tl.arange(0, N_TILES)
    col = tl.arange(0, TILE)
    lat_off = tile[None, :, None] * TILE + col[None, None, :]  # [1, 4, 128]
    x = tl.load(kv_c_ptr + t[:, None, None].to(tl.int64) * stride_kv + lat_off, mask=ok[:, None, None], other=0.0).to(
        tl.float32
    )
    amax = tl.max(tl.abs(x), axis=2)  # [BLOCK_T, 4]
    scale = tl.where(amax > 0, _pow2_ceil(amax / FP8_MAX), 1.0)
    q = tl.minimum(tl.maximum(x / scale[:, :, None], -FP8_MAX), FP8_MAX)
    rec = cache_ptr + slot * RECORD_BYTES  # [BLOCK_T] uint8 pointers
    tl.store(rec[:, None, None] + lat_off, _e4m3_byte(q), mask=ok[:, None, None])
    scale_ptr = (rec + SCALE_OFFSET).to(tl.pointer_type(tl.float32))
    tl.store(scale_ptr[:, None] + tile[None, :], scale, mask=ok[:, None])
    r = tl.arange(0, ROPE)
    pe = tl.load(k_pe_ptr + t[:, None].to(tl.int64) * stride_pe + r[None, :], mask=ok[:, None], other=0.0)
    rope_ptr = (rec + ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope_ptr[:, None] + r[None, :], pe.to(tl.bfloat16), mask=ok[:, None])


@triton.jit
def _dequant_kernel(rec_ptr, out_ptr, N, BLOCK_N: tl.constexpr):
    """records uint8 [N, 656] -> bf16 [N, 576]; one program handles BLOCK_N records."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = n < N
    rec = rec_ptr + n.to(tl.int64) * RECORD_BYTES
    dst = out_ptr + n.to(tl.int64) * (LATENT + ROPE)
    tile = tl.arange(0, N_TILES)
    col = tl.arange(0, TILE)
    lat_off = tile[None, :, None] * TILE + col[None, None, :]
    codes = tl.load(rec[:, None, None] + lat_off, mask=ok[:, None, None], other=0)
    vals = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scale = tl.load((rec + SCALE_OFFSET).to(tl.pointer_type(tl.float32))[:, None] + tile[None, :], mask=ok[:, None])
    tl.store(dst[:, None, None] + lat_off, (vals * scale[:, :, None]).to(tl.bfloat16), mask=ok[:, None, None])
    r = tl.arange(0, ROPE)
    pe = tl.load((rec + ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16))[:, None] + r[None, :], mask=ok[:, None])
    tl.store(dst[:, None] + LATENT + r[None, :], pe, mask=ok[:, None])


def launch_write_mla_fp8_cache(kv_c, k_pe, slot_mapping, cache, block_t: int = 8) -> None:
    """Framework-neutral launch (paddle or torch tensors): kv_c [T, 512], k_pe [T, 64] (row
    stride may exceed the width), slot_mapping int32 [T], cache uint8 [..., 656] contiguous."""
    T = int(kv_c.shape[0])
    if T == 0:
        return
    launch(
        _write_kernel, (triton.cdiv(T, block_t),), kv_c, k_pe, slot_mapping, cache, T,
        int(kv_c.strides[0]) if hasattr(kv_c, "strides") else kv_c.stride(0),
        int(k_pe.strides[0]) if hasattr(k_pe, "strides") else k_pe.stride(0),
        BLOCK_T=block_t,
    )  # fmt: skip


def launch_dequant_mla_fp8_cache(records, out, block_n: int = 8) -> None:
    """Framework-neutral launch: records uint8 [N, 656] -> out bf16 [N, 576]."""
    n = int(records.shape[0])
    if n:
        launch(_dequant_kernel, (triton.cdiv(n, block_n),), records, out, n, BLOCK_N=block_n)


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


def _e4m3_codes_ref(q: paddle.Tensor) -> paddle.Tensor:
    """float32 |q| <= 448 -> uint8 e4m3fn codes, ties to even, by nearest-value search."""
    import numpy as np

    from fastdeploy.model_executor.safetensors_io import E4M3_TO_F32

    pos = np.where(np.isfinite(E4M3_TO_F32[:128]), E4M3_TO_F32[:128], np.inf)[:127]  # codes 0..126
    grid = paddle.to_tensor(pos, dtype="float32")
    a = q.abs()
    hi = paddle.searchsorted(grid, a.contiguous()).clip(max=126)  # first grid value >= a
    lo = (hi - 1).clip(min=0)
    d_hi, d_lo = grid[hi] - a, a - grid[lo]
    take_lo = (d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0))
    code = paddle.where(take_lo, lo, hi)
    return paddle.where(q < 0, code + 128, code).astype("uint8")


def quantize_mla_record_ref(kv_c: paddle.Tensor, k_pe: paddle.Tensor) -> paddle.Tensor:
    """kv_c [T, 512], k_pe [T, 64] -> uint8 [T, 656] records, in paddle ops."""
    T = kv_c.shape[0]
    x = kv_c.astype("float32").reshape([T, N_TILES, TILE])
    amax = x.abs().max(axis=-1)
    raw = amax / FP8_MAX
    e = paddle.ceil(paddle.log2(paddle.where(raw > 0, raw, paddle.ones_like(raw)).astype("float64")))
    scale = paddle.where(amax > 0, paddle.pow(paddle.to_tensor(2.0, "float64"), e.clip(min=-126)), 1.0).astype(
        "float32"
    )
    q = (x / scale.unsqueeze(-1)).clip(-FP8_MAX, FP8_MAX)
    codes = _e4m3_codes_ref(q).reshape([T, LATENT])
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


def dequant_mla_fp8_cache_ref(records: paddle.Tensor) -> paddle.Tensor:
    """Paddle reference of ``dequant_mla_fp8_cache``: uint8 [..., 656] -> bf16 [..., 576]."""
    lead = list(records.shape[:-1])
    flat = records.reshape([-1, RECORD_BYTES])
    n = flat.shape[0]
    from fastdeploy.model_executor.safetensors_io import E4M3_TO_F32

    table = paddle.to_tensor(E4M3_TO_F32)
    vals = table[flat[:, :LATENT].astype("int64")].reshape([n, N_TILES, TILE])
    scale = flat[:, SCALE_OFFSET:ROPE_OFFSET].contiguous().view("float32").reshape([n, N_TILES, 1])
    lat = (vals * scale).reshape([n, LATENT]).astype("bfloat16")
    pe = flat[:, ROPE_OFFSET:].contiguous().view("bfloat16").reshape([n, ROPE])
    return paddle.concat([lat, pe], axis=1).reshape(lead + [LATENT + ROPE])
