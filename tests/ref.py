"""The tests' references, one short function an op (FlashMLA's style): float64 numpy written from
each op's definition, importing none of the code they check. Tests import them as ``from ref
import ...``."""

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


GRID = None  # the non-negative finite e4m3 values, codes 0..126 (set below, from e4m3_decode)


def e4m3_round(x):
    """Nearest e4m3 value, ties to the even code (float64)."""
    a = np.abs(x)
    hi = np.clip(np.searchsorted(GRID, a), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    take_lo = (a - GRID[lo] < GRID[hi] - a) | ((a - GRID[lo] == GRID[hi] - a) & (lo % 2 == 0))
    return np.sign(x) * np.where(take_lo, GRID[lo], GRID[hi])


def w8a8_ref(x, codes, scale):
    M, K = x.shape
    N = codes.shape[0]
    xq = np.zeros_like(x, dtype=np.float64)
    for kb in range(0, K, 128):
        blk = x[:, kb : kb + 128].astype(np.float64)
        s = np.maximum(np.abs(blk).max(1, keepdims=True), 1e-12).astype(np.float32).astype(np.float64) / 448
        s = s.astype(np.float32).astype(np.float64)  # the kernels keep the scale in float32
        xq[:, kb : kb + 128] = e4m3_round(np.clip(blk / s, -448, 448)) * s
    w = e4m3_decode(codes) * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:N, :K]
    return xq @ w.T


def act_quant_ref(x):
    """Per row per 128 columns: scale amax / 448 (float32), nearest e4m3 (float64 out)."""
    out = np.zeros_like(x, dtype=np.float64)
    for c in range(0, x.shape[1], 128):
        blk = x[:, c : c + 128].astype(np.float64)
        s = (np.maximum(np.abs(blk).max(1, keepdims=True), 1e-12).astype(np.float32) / np.float32(448)).astype(
            np.float64
        )
        out[:, c : c + 128] = e4m3_round(np.clip(blk / s, -448, 448)) * s
    return out


def fused_moe_ref_np(x, ids, wts, w1, w3, w2, fp8):
    T, H = x.shape
    y = np.zeros((T, H))
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    for t in range(T):
        xt = act_quant_ref(x[t : t + 1]) if fp8 else x[t : t + 1].astype(np.float64)
        for e, wt in zip(ids[t], wts[t], strict=True):
            if not 0 <= e < w1.shape[0]:
                continue  # another rank's expert
            h = silu(xt @ w1[e].T) * (xt @ w3[e].T)
            h = act_quant_ref(h.astype(np.float32)) if fp8 else h
            y[t] += wt * (h @ w2[e].T)[0]
    return y


def expert_sort_ref(ids, E, bm):
    """sorted_ids / block_expert by the definition: experts in order, each expert's entries in
    entry order, runs padded to bm with N, blocks past the runs -1."""
    flat = ids.reshape(-1)
    N = flat.size
    P = -(-(N + E * (bm - 1)) // bm) * bm
    sorted_ids, block_expert, at = np.full(P, N), np.full(P // bm, -1), 0
    for e in range(E):
        mine = np.flatnonzero(flat == e)
        sorted_ids[at : at + mine.size] = mine
        run = -(-mine.size // bm) * bm
        block_expert[at // bm : (at + run) // bm] = e
        at += run
    return sorted_ids, block_expert


def bf16_round(a: np.ndarray, nearest: bool = True) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even; or toward zero), back as float64."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    if nearest:
        u = u + 0x7FFF + ((u >> 16) & 1)
    return ((u >> 16) << 16).astype(np.uint32).view(np.float32).astype(np.float64)


def mla_prefill_ref_np(q, k, kr, v, cu_q, cu_k, q_start, k_start, W, scale):
    out = np.zeros((q.shape[0], q.shape[1], 128))
    for b in range(len(cu_q) - 1):
        for i in range(cu_q[b], cu_q[b + 1]):
            p = q_start[b] + i - cu_q[b]
            lo = p - W + 1 if W > 0 else -(10**9)
            js = [j for j in range(cu_k[b], cu_k[b + 1]) if lo <= k_start[b] + j - cu_k[b] <= p]
            s = (np.einsum("hd,jhd->hj", q[i, :, :128], k[js]) + np.einsum("hd,jd->hj", q[i, :, 128:], kr[js])) * scale
            e = np.exp(s - s.max(-1, keepdims=True))
            out[i] = np.einsum("hj,jhd->hd", e / e.sum(-1, keepdims=True), v[js])
    return out


def moe_route_ref(z, bias, n_group, topk_group, top_k, norm, scale):
    """ids [T, top_k] and weights float64 by the definition (ties: the lower index)."""
    s = 1.0 / (1.0 + np.exp(-z.astype(np.float64)))
    c = s + bias.astype(np.float64)
    T, E = z.shape
    G = E // n_group
    ids, ws = np.zeros((T, top_k), np.int64), np.zeros((T, top_k))
    for t in range(T):
        groups = c[t].reshape(n_group, G)
        score = np.sort(groups, 1)[:, ::-1][:, : min(2, G)].sum(1)
        keep = np.argsort(-score, kind="stable")[:topk_group]
        allowed = np.isin(np.arange(E) // G, keep)
        cand = np.where(allowed, c[t], -np.inf)
        ids[t] = np.argsort(-cand, kind="stable")[:top_k]
        ws[t] = s[t, ids[t]]
        if norm and top_k > 1:
            ws[t] /= ws[t].sum() + 1e-20
    return ids, ws * scale


def rms_norm_ref(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w.astype(np.float64)


def rope_ref(x, cos, sin):
    """x [..., 2h] float64: pairs (x[2i], x[2i+1]) rotated, the results de-interleaved."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return np.concatenate([even * cos - odd * sin, odd * cos + even * sin], -1)


def swa_indexer_ref_py(positions, bids, block_tables, bs, W, topk):
    out = []
    for p, b in zip(positions, bids, strict=True):
        row = [-1] * topk
        if p >= 0 and b >= 0:
            n = min(W, p + 1)
            for k, q in enumerate(range(p - n + 1, p + 1)):
                blk = block_tables[b][q // bs]
                row[k] = blk * bs + q % bs if blk >= 0 else -1
        out.append(row)
    return np.array(out, dtype=np.int32).reshape(len(positions), topk)


def token_mask_ref(logits: np.ndarray, words: np.ndarray, rows: list[int], masked: float) -> np.ndarray:
    out = logits.copy()
    V = logits.shape[1]
    for i, r in enumerate(rows):
        for t in range(V):
            if not (int(words[i, t // 32]) >> (t % 32)) & 1:
                out[r, t] = masked
    return out


M32 = 0xFFFFFFFF


def fmix32(h: np.ndarray) -> np.ndarray:
    """murmur3's finalizer on uint64 lanes holding 32-bit values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def gumbel_noise_ref(key: np.ndarray, vocab: int) -> np.ndarray:
    """float64 Gumbel noise of tokens 0..vocab-1 for one row key (int32 lo, hi)."""
    lo, hi = (int(k) & M32 for k in key)
    ids = np.arange(vocab, dtype=np.uint64)
    h = fmix32(((ids * 0x9E3779B1) & M32) ^ np.uint64(lo))
    h = fmix32(h ^ np.uint64(hi))
    u = ((h >> 8).astype(np.float64) + 0.5) / 2**24
    return -np.log(-np.log(u))


GRID = e4m3_decode(np.arange(127))


def pow2_e4m3_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., D] -> (e4m3 values [..., D], scale [...]) per D-vector: scale = 2^ceil(log2(amax / 448)),
    amax floored at 1e-4 (DeepSeek-V3.2's act_quant with power-of-two scales)."""
    amax = np.maximum(np.abs(x).max(-1), 1e-4)
    scale = 2.0 ** np.ceil(np.log2(amax / 448.0))
    return e4m3_round(np.clip(x / scale[..., None], -448, 448)), scale


def lightning_index_ref(q, w, k, ends, topk, k_scale=None) -> tuple[np.ndarray, np.ndarray]:
    """DSA's index score in float64: score[t, s] = k_scale[s] * sum_h w[t, h] relu(q[t, h] . k[s])
    for s < ends[t]; the top min(topk, ends[t]) keys by score (ties to the lower id) in ascending
    id order, -1 after.
    -> (scores [T, S] with -inf past the ends, ids int [T, topk])."""
    q, w, k = (np.asarray(a, np.float64) for a in (q, w, k))
    T, S = q.shape[0], k.shape[0]
    scores = np.full((T, S), -np.inf)
    ids = np.full((T, topk), -1)
    for t in range(T):
        n = int(ends[t])
        s = (w[t][:, None] * np.maximum(q[t] @ k[:n].T, 0)).sum(0)
        if k_scale is not None:
            s = s * np.asarray(k_scale, np.float64)[:n]
        scores[t, :n] = s
        pick = sorted(sorted(range(n), key=lambda j: (-s[j], j))[:topk])
        ids[t, : len(pick)] = pick
    return scores, ids
