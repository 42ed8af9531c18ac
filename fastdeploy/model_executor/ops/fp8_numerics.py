"""FP8 (float8_e4m3fn) numerics, in one place (docs/design.md §4.4, §4.8).

numpy only, so the paddle-free Triton kernel files, the paddle references, the loader, the float64
model and the tiny checkpoint writer all read the same table and the same rounding:
- ``E4M3_TO_F32``: the value of each of the 256 codes (only S.1111.111 is NaN);
- ``e4m3_encode``: float -> code, nearest value, ties to the even code;
- ``quantize_fp8_blocks`` / ``dequant_fp8_blocks``: DeepSeek-V3's FP8 weights, one float32
  scale (``weight_scale_inv``) per 128 x 128 block.
"""

from __future__ import annotations

import numpy as np

FP8_MAX = 448.0  # the largest finite e4m3fn value
FP8_BLOCK = 128  # DeepSeek-V3's weight block, and the activations' quantization group


def _e4m3_table() -> np.ndarray:
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7))
    val = np.where((exp == 15) & (man == 7), np.nan, val)
    return (sign * val).astype(np.float32)


E4M3_TO_F32 = _e4m3_table()
_GRID = E4M3_TO_F32[:127].astype(np.float64)  # the non-negative finite values, codes 0..126, ascending


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float x with |x| <= 448 -> uint8 e4m3fn codes of the nearest value, ties to the even code."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    hi = np.clip(np.searchsorted(_GRID, a), 0, 126)  # first grid value >= a
    lo = np.clip(hi - 1, 0, 126)
    d_lo, d_hi = a - _GRID[lo], _GRID[hi] - a
    codes = np.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi).astype(np.uint8)
    return np.where(np.asarray(x) < 0, codes | 0x80, codes).astype(np.uint8)


def block_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the scales of a [rows, cols] weight: one per 128 x 128 block."""
    return -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)


def dequant_fp8_blocks(codes: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """e4m3 codes uint8 [rows, cols] x scale_inv float32 [ceil(rows/128), ceil(cols/128)] ->
    float32 [rows, cols]. A ValueError when the scales do not fit the codes."""
    rows, cols = codes.shape
    if tuple(scale_inv.shape) != block_shape(rows, cols):
        raise ValueError(f"has shape {tuple(scale_inv.shape)}, expected {block_shape(rows, cols)}")
    full = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)[:rows, :cols]
    return E4M3_TO_F32[codes] * full


def quantize_fp8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [rows, cols] -> (codes uint8, scales float32 [ceil(rows/128), ceil(cols/128)]):
    per 128 x 128 block, scale = amax / 448 (1e-12 at least) and codes = e4m3_encode(w / scale)."""
    rows, cols = w.shape
    br, bc = block_shape(rows, cols)
    pad = np.zeros((br * FP8_BLOCK, bc * FP8_BLOCK), np.float32)
    pad[:rows, :cols] = w
    blocks = pad.reshape(br, FP8_BLOCK, bc, FP8_BLOCK)
    scale = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12).astype(np.float32) / np.float32(FP8_MAX)
    q = (blocks / scale[:, None, :, None]).reshape(br * FP8_BLOCK, bc * FP8_BLOCK)[:rows, :cols]
    return e4m3_encode(q), scale.astype(np.float32)
