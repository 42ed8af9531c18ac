"""Independent float64 numpy references shared by tests."""

import numpy as np


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """e4m3fn codes -> float64."""
    c = codes.astype(np.int64)
    s = np.where(c & 0x80, -1.0, 1.0)
    e, f = (c >> 3) & 15, c & 7
    v = np.where(e == 0, f * 2.0**-9, (8 + f) * 2.0 ** (e - 10))
    return s * np.where((e == 15) & (f == 7), np.nan, v)


def bf16_to_f64(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def decode_records(rec: np.ndarray):
    """uint8 [N, 656] -> latent float64 [N, 512], scales float32 [N, 4], rope float64 [N, 64]."""
    scales = rec[:, 512:528].copy().view("<f4")
    lat = e4m3_decode(rec[:, :512]).reshape(-1, 4, 128) * scales[:, :, None]
    rope = bf16_to_f64(rec[:, 528:].copy().view("<u2"))
    return lat.reshape(-1, 512), scales, rope


def dequant_records(rec: np.ndarray) -> np.ndarray:
    """uint8 [N, 656] -> float64 [N, 576]."""
    lat, _, rope = decode_records(rec)
    return np.concatenate([lat, rope], axis=1)


def sparse_mla_np(q: np.ndarray, kv: np.ndarray, indices: np.ndarray, scale: float):
    """q [T, H, 576], kv float64 [S, 576] (de-quantized cache), indices [T, topk] -> out [T, H, 512],
    lse [T, H]; a row with no valid index gives 0 and +inf."""
    T, H, _ = q.shape
    out = np.zeros((T, H, 512))
    lse = np.full((T, H), np.inf)
    for t in range(T):
        sel = indices[t][indices[t] >= 0]
        if sel.size == 0:
            continue
        k = kv[sel]
        logits = q[t].astype(np.float64) @ k.T * scale
        m = logits.max(-1, keepdims=True)
        e = np.exp(logits - m)
        lse[t] = m[:, 0] + np.log(e.sum(-1))
        out[t] = (e / e.sum(-1, keepdims=True)) @ k[:, :512]
    return out, lse
