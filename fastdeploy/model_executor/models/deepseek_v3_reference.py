"""An independent float64 numpy DeepSeek-V3, written from the model's math: no paging, no
weight absorption, plain softmax(QK^T)V with a causal mask and an optional per-layer window.

The reference beside the model (tests and benchmarks/accuracy.py compare against it); it shares
no code or constant with the paddle model, only the checkpoint reader."""

from __future__ import annotations

import math

import numpy as np

from fastdeploy.model_executor.safetensors_io import SafeTensorsFile


def load_np(model_dir: str) -> dict[str, np.ndarray]:
    """float64 weights; FP8 codes times their 128 x 128 block scales."""
    f = SafeTensorsFile(f"{model_dir}/model.safetensors")
    out = {}
    for k in f.keys():
        if k.endswith("_scale_inv"):
            continue
        x = f.get(k)
        if f.dtype(k) == "F8_E4M3":
            r, c = x.shape
            s = np.repeat(np.repeat(f.get(k + "_scale_inv").astype(np.float64), 128, 0), 128, 1)[:r, :c]
            x = E4M3[x] * s
        out[k] = x.astype(np.float64)
    return out


def proj(x: np.ndarray, w: dict, name: str, act_fp8: bool) -> np.ndarray:
    """x @ W^T; with ``act_fp8`` x first goes through DeepSeek-V3's activation quantization:
    per row per 128 columns, scale amax / 448 (float32) and the nearest e4m3 value."""
    if act_fp8:
        rows, cols = x.shape
        pad = np.zeros((rows, -(-cols // 128) * 128))
        pad[:, :cols] = x
        xb = pad.reshape(rows, -1, 128)
        s = (np.maximum(np.abs(xb).max(-1, keepdims=True), 1e-12).astype(np.float32) / np.float32(448)).astype(
            np.float64
        )
        x = (e4m3_round(xb / s) * s).reshape(rows, -1)[:, :cols]
    return x @ w[name].T


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1 + np.exp(-x))


def rope_angles(positions, dim, base, rs, max_pos):
    """Angles [T, dim/2] of YaRN-scaled rotary and its cos/sin multiplier, as Hugging Face reads
    a YaRN config (original_max_position_embeddings defaults to max_pos; attention_factor, else
    the mscale ratio when mscale and mscale_all_dim are both set, else mscale(factor))."""
    inv = base ** (-np.arange(0, dim, 2) / dim)
    mult = 1.0
    if rs:
        f = rs["factor"]
        orig = rs.get("original_max_position_embeddings") or max_pos

        def corr(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = corr(rs.get("beta_fast") or 32), corr(rs.get("beta_slow") or 1)
        if rs.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        ramp = np.clip((np.arange(dim // 2) - lo) / (hi - lo + (0.001 if lo == hi else 0)), 0, 1)
        inv = inv / f * ramp + inv * (1 - ramp)

        def msc(m):
            return 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1

        if rs.get("attention_factor") is not None:
            mult = rs["attention_factor"]
        elif rs.get("mscale") and rs.get("mscale_all_dim"):
            mult = msc(rs["mscale"]) / msc(rs["mscale_all_dim"])
        else:
            mult = msc(1)
    return np.outer(positions, inv), mult


def rotate_pairs(x, ang, mult, interleaved=True):
    """Rotate pairs by ang[..., i]; x [..., T, (H,) dim]: interleaved pairs (x[2i], x[2i+1]), or
    (``interleaved`` false, NeoX) halves (x[i], x[i + dim/2])."""
    c, s = np.cos(ang) * mult, np.sin(ang) * mult
    if x.ndim == 3:
        c, s = c[:, None], s[:, None]
    half = x.shape[-1] // 2
    ev, od = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (slice(0, half), slice(half, None))
    e, o = x[..., ev], x[..., od]
    out = np.empty_like(x)
    out[..., ev] = e * c - o * s
    out[..., od] = o * c + e * s
    return out


def moe(x, w, p, cfg, act_fp8=False):
    logits = x @ w[p + "gate.weight"].T
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + w[p + "gate.e_score_correction_bias"]
    T, E = scores.shape
    g = cfg["n_group"]
    grouped = choice.reshape(T, g, E // g)
    gs = np.sort(grouped, -1)[..., -2:].sum(-1)
    out = np.zeros_like(x)
    for t in range(T):
        groups = np.argsort(-gs[t], kind="stable")[: cfg["topk_group"]]
        allowed = np.zeros(E, bool)
        for gi in groups:
            allowed[gi * (E // g) : (gi + 1) * (E // g)] = True
        masked = np.where(allowed, choice[t], -np.inf)
        ids = np.argsort(-masked, kind="stable")[: cfg["num_experts_per_tok"]]
        wt = scores[t, ids]
        if cfg["num_experts_per_tok"] > 1 and cfg["norm_topk_prob"]:
            wt = wt / (wt.sum() + 1e-20)
        wt = wt * cfg["routed_scaling_factor"]
        for e, we in zip(ids, wt, strict=True):
            out[t] += we * mlp(x[t : t + 1], w, f"{p}experts.{e}.", act_fp8)[0]
    if cfg.get("n_shared_experts"):
        out += mlp(x, w, p + "shared_experts.", act_fp8)
    return out


def mlp(x, w, p, act_fp8=False):
    gate, up = proj(x, w, p + "gate_proj.weight", act_fp8), proj(x, w, p + "up_proj.weight", act_fp8)
    return proj(silu(gate) * up, w, p + "down_proj.weight", act_fp8)


def _e4m3_value(code: int) -> float:
    """One e4m3fn code's value from its bit fields: sign, 4 exponent bits (bias 7), 3 mantissa
    bits; exponent 0 is subnormal (m / 8 * 2^-6); 0x7F and 0xFF are NaN, there is no infinity."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 15 and m == 7:
        return math.nan
    return sign * (math.ldexp(m, -9) if e == 0 else math.ldexp(8 + m, e - 10))


E4M3 = np.array([_e4m3_value(c) for c in range(256)])  # float64, indexed by code
_E4M3_POS = E4M3[:127]  # codes 0..126: the finite non-negative values, ascending


def e4m3_round(y: np.ndarray) -> np.ndarray:
    """The nearest e4m3fn value to y (|y| <= 448), ties to the even code, found by comparing
    |y| with each of the 127 non-negative values (in slices, to bound the memory)."""
    a = np.abs(np.asarray(y, np.float64)).ravel()
    out = np.empty_like(a)
    even = np.arange(127) % 2 == 0
    for i in range(0, a.size, 1 << 15):
        d = np.abs(a[i : i + (1 << 15), None] - _E4M3_POS)
        tie = d == d.min(1, keepdims=True)
        pick = np.where((tie & even).any(1), (tie & even).argmax(1), tie.argmax(1))
        out[i : i + (1 << 15)] = _E4M3_POS[pick]
    out = out.reshape(np.shape(y))
    return np.where(np.asarray(y) < 0, -out, out)


def fp8_record_roundtrip(kv_c: np.ndarray, k_pe: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the 656-byte record keeps (docs/design.md §4.4), in numpy: per 128-value tile a power-of-two
    scale >= amax / 448 and e4m3 values (nearest, ties to even); rope values rounded to bf16."""
    x = kv_c.reshape(kv_c.shape[0], 4, 128)
    amax = np.abs(x).max(-1, keepdims=True).astype(np.float32)
    s = amax / np.float32(448)
    scale = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.where(s > 0, s, 1))), 1.0)
    q = e4m3_round(x / scale) * scale
    return q.reshape(kv_c.shape), bf16_round(k_pe)


def is_indexed(cfg: dict, layer: int) -> bool:
    """A DeepSeek-V3.2 indexed (DSA) layer: ``model_type`` deepseek_v32 without ``layer_types``,
    or its ``layer_types`` entry "indexed_attention"."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        return cfg.get("model_type") == "deepseek_v32"
    return layer < len(kinds) and kinds[layer] == "indexed_attention"


def pow2_e4m3(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's act_quant with power-of-two scales, per last-axis vector: scale =
    2^ceil(log2(max(amax, 1e-4) / 448)), values e4m3(x / scale) -> (values, scale)."""
    amax = np.maximum(np.abs(x).max(-1), 1e-4)
    scale = 2.0 ** np.ceil(np.log2(amax / 448))
    return e4m3_round(x / scale[..., None]), scale


def indexer_qkw(x, q_lat, w, a, cfg, ang, mult, act_fp8=False):
    """DeepSeek-V3.2's indexer projections over one sequence: q = wq_b(q_lat) [T, H, D], k =
    LayerNorm(wk(x)) [T, D], RoPE (NeoX halves unless ``indexer_rope_interleave``, the rotated
    dims as [first, second] of each pair) on their first qk_rope_head_dim dims, and the head
    weights w = weights_proj(x) H^-0.5 D^-0.5 [T, H]; ``act_fp8``: wq_b's and wk's inputs quantized
    as W8A8 GEMMs quantize them (an FP8 checkpoint kept FP8)."""
    T = x.shape[0]
    H, D, R = cfg["index_n_heads"], cfg["index_head_dim"], cfg["qk_rope_head_dim"]
    p = a + "indexer."
    q = proj(q_lat, w, p + "wq_b.weight", act_fp8).reshape(T, H, D)
    k = proj(x, w, p + "wk.weight", act_fp8)
    mu, var = k.mean(-1, keepdims=True), k.var(-1, keepdims=True)
    k = (k - mu) / np.sqrt(var + 1e-6) * w[p + "k_norm.weight"] + w[p + "k_norm.bias"]
    inter = cfg.get("indexer_rope_interleave", False)
    q = np.concatenate([rotate_pairs(q[..., :R], ang, mult, inter), q[..., R:]], -1)
    k = np.concatenate([rotate_pairs(k[:, :R], ang, mult, inter), k[:, R:]], -1)
    return q, k, (x @ w[p + "weights_proj.weight"].T) * H**-0.5 * D**-0.5


def indexer_pick(x, q_lat, w, a, cfg, ang, mult, fp8=False, act_fp8=False):
    """DeepSeek-V3.2's lightning indexer over one sequence, unquantized (as Hugging Face's
    DeepseekV32Indexer): score[t, s] = sum_h w[t, h] relu(q[t, h] . k[s]) over s <= t
    (``indexer_qkw``); each query keeps its top min(index_topk, t + 1) keys (ties to the lower
    id). ``fp8``: q and k quantized first (``pow2_e4m3`` per head / per key), w times q's scale,
    each score times its key's scale, as the engine's FP8 indexer cache computes them.
    -> bool [T, T] kept."""
    T = x.shape[0]
    q, k, wt = indexer_qkw(x, q_lat, w, a, cfg, ang, mult, act_fp8)
    k_scale = np.ones(T)
    if fp8:
        (q, q_scale), (k, k_scale) = pow2_e4m3(q), pow2_e4m3(k)
        wt = wt * q_scale
    score = np.einsum("th,ths->ts", wt, np.maximum(np.einsum("thd,sd->ths", q, k), 0)) * k_scale
    keep = np.zeros((T, T), bool)
    for t in range(T):
        order = sorted(range(t + 1), key=lambda s: (-score[t, s], s))
        keep[t, order[: cfg["index_topk"]]] = True
    return keep


def bf16_round(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def decoder_layer(
    x: np.ndarray,
    w: dict,
    cfg: dict,
    layer: int,
    window: int | None = None,
    kv_format: str | None = None,
    act_fp8: bool = False,
    index_fp8: bool = False,
) -> np.ndarray:
    """One decoder layer (``model.layers.{layer}.*``) over a whole sequence x float64 [T, hidden]
    at positions 0..T-1: MLA attention (window W, the keys DeepSeek-V3.2's indexer picks for an
    indexed layer, or full; ``kv_format`` "fp8" / "bf16" rounds the cached kv_c / k_pe as the cache
    stores them; ``index_fp8``: the indexer's q and k quantized as an FP8 indexer cache keeps
    them), then its dense MLP or MoE."""
    T = x.shape[0]
    H, nope, rope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    eps = cfg["rms_norm_eps"]
    rs = cfg.get("rope_scaling")
    scale = (nope + rope) ** -0.5
    if rs and rs.get("mscale_all_dim"):
        m = 0.1 * rs["mscale_all_dim"] * math.log(rs["factor"]) + 1
        scale *= m * m
    ang, mult = rope_angles(np.arange(T), rope, cfg["rope_theta"], rs, cfg["max_position_embeddings"])
    inter = cfg.get("rope_interleave", True)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    h = rms(x, w[p + "input_layernorm.weight"], eps)
    if cfg.get("q_lora_rank"):
        q_lat = rms(proj(h, w, a + "q_a_proj.weight", act_fp8), w[a + "q_a_layernorm.weight"], eps)
        q = proj(q_lat, w, a + "q_b_proj.weight", act_fp8)
    else:
        q = proj(h, w, a + "q_proj.weight", act_fp8)
    q = q.reshape(T, H, nope + rope)
    kv_a = proj(h, w, a + "kv_a_proj_with_mqa.weight", act_fp8)
    kv_c = rms(kv_a[:, :512], w[a + "kv_a_layernorm.weight"], eps)
    k_pe = rotate_pairs(kv_a[:, 512:], ang, mult, inter)
    q_pe = rotate_pairs(q[:, :, nope:], ang, mult, inter)
    if kv_format == "fp8":
        kv_c, k_pe = fp8_record_roundtrip(kv_c, k_pe)
    elif kv_format == "bf16":
        kv_c, k_pe = bf16_round(kv_c), bf16_round(k_pe)
    kv = (kv_c @ w[a + "kv_b_proj.weight"].T).reshape(T, H, nope + v)
    k = np.concatenate([kv[:, :, :nope], np.broadcast_to(k_pe[:, None], (T, H, rope))], -1)
    qq = np.concatenate([q[:, :, :nope], q_pe], -1)
    s = np.einsum("thd,shd->hts", qq, k) * scale
    mask = (j <= i) & ((j > i - window) if window else True)
    if is_indexed(cfg, layer):
        mask &= indexer_pick(h, q_lat, w, a, cfg, ang, mult, index_fp8, act_fp8)
    s = np.where(mask[None], s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    o = np.einsum("hts,shv->thv", pr, kv[:, :, nope:]).reshape(T, H * v)
    x = x + proj(o, w, a + "o_proj.weight", act_fp8)
    h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
    if cfg.get("n_routed_experts") and layer >= cfg["first_k_dense_replace"]:
        return x + moe(h, w, p + "mlp.", cfg, act_fp8)
    return x + mlp(h, w, p + "mlp.", act_fp8)


def forward(
    w: dict,
    cfg: dict,
    ids: list[int],
    windows: list[int | None] | None = None,
    fp8_kv: bool = False,
    kv_formats: list[str | None] | None = None,
    act_fp8: bool = False,
    hidden: bool = False,
    index_fp8: bool = False,
) -> np.ndarray:
    """Logits float64 [T, vocab] for one sequence (``hidden``: the final-normed hidden states
    [T, hidden_size] instead); windows[l] = W of layer l (None: full).
    ``fp8_kv``: windowed layers see their kv_c / k_pe as the FP8 record stores them.
    ``kv_formats[l]`` ("fp8", "bf16" or None) says how layer l's cache stores them, for any layer.
    ``act_fp8``: the inputs of the projections a model with FP8 weights runs as W8A8 GEMMs are
    quantized first (all but kv_b_proj, whose W_UK / W_UV the attention applies in float).
    ``index_fp8``: indexed layers pick their keys from FP8 index scores (``indexer_pick``)."""
    x = w["model.embed_tokens.weight"][ids]
    for layer in range(cfg["num_hidden_layers"]):
        W = windows[layer] if windows else None
        fmt = kv_formats[layer] if kv_formats else ("fp8" if fp8_kv and W else None)
        x = decoder_layer(x, w, cfg, layer, W, fmt, act_fp8, index_fp8)
    x = rms(x, w["model.norm.weight"], cfg["rms_norm_eps"])
    return x if hidden else x @ w["lm_head.weight"].T


def mtp(
    w: dict,
    cfg: dict,
    next_ids: list[int],
    hidden: np.ndarray,
    window: int | None = None,
    kv_format: str | None = None,
    act_fp8: bool = False,
    out_hidden: bool = False,
) -> np.ndarray:
    """DeepSeek-V3's MTP module (layer L = num_hidden_layers) over one sequence: row t takes the
    embedding of next_ids[t] (the token after position t) and hidden[t] float64 [T, hidden_size]
    (the target's final-normed hidden state at t), at positions 0..T-1. Logits float64 [T, vocab]
    of the token after next (``out_hidden``: the layer's output before shared_head.norm)."""
    p = f"model.layers.{cfg['num_hidden_layers']}."
    eps = cfg["rms_norm_eps"]
    e = rms(w["model.embed_tokens.weight"][next_ids], w[p + "enorm.weight"], eps)
    x = proj(np.concatenate([e, rms(hidden, w[p + "hnorm.weight"], eps)], -1), w, p + "eh_proj.weight", act_fp8)
    x = decoder_layer(x, w, cfg, cfg["num_hidden_layers"], window, kv_format, act_fp8)
    if out_hidden:
        return x
    return rms(x, w[p + "shared_head.norm.weight"], eps) @ w["lm_head.weight"].T
