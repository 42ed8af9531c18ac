"""MLA prefill in MHA form (docs/design.md §4.7) as a Triton flash-attention kernel (paddle-free).

Per request b of a varlen batch: queries q [n_b, H, 192] (128 nope + 64 rope) at absolute
positions qstart_b .. qstart_b + n_b - 1; keys k [m_b, H, 128] with one rope part k_rope [m_b, 64]
shared by the heads, values v [m_b, H, 128], at positions kstart_b .. kstart_b + m_b - 1 (the
request's keys in view: the cached context, or only the window, then the chunk's own tokens).
Query p sees key positions [p - W + 1, p] (W <= 0: [0, p]). out [T, H, 128]:
softmax((q_nope . k + q_rope . k_rope) * scale) . v, online over 2-D tiles of BLOCK_M queries and
BLOCK_N keys, float32 accumulation.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops.launcher import interpret_mode, launch, stride

D_NOPE, D_ROPE, D_V = 128, 64, 128


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    qn,
    qr,
    qpos,
    start,
    kp0,
    k_lo,
    j_lo,
    j_hi,
    window,
    qk_scale,
    K,
    KR,
    V,
    sk_s,
    sk_h,
    skr_s,
    sv_s,
    sv_h,
    h,
    dn,
    dr,
    dv,
    BLOCK_N: tl.constexpr,
    DOT_BF16: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One tile of BLOCK_N keys from key index ``start`` into the online softmax (exp2 domain).
    MASKED: apply causality, the window and the request's key range; else every query sees every key."""
    cols = start + tl.arange(0, BLOCK_N)
    if MASKED:
        in_tile = (cols >= j_lo) & (cols < j_hi)  # seen by some query of the tile; others may hold NaN
    else:
        in_tile = cols >= 0
    kn = tl.load(K + (k_lo + cols)[:, None] * sk_s + h * sk_h + dn[None, :], mask=in_tile[:, None], other=0.0)
    kr = tl.load(KR + (k_lo + cols)[:, None] * skr_s + dr[None, :], mask=in_tile[:, None], other=0.0)
    v = tl.load(V + (k_lo + cols)[:, None] * sv_s + h * sv_h + dv[None, :], mask=in_tile[:, None], other=0.0)
    if not DOT_BF16:  # the interpreter gets bf16 arithmetic wrong
        kn = kn.to(tl.float32)
        kr = kr.to(tl.float32)
        v = v.to(tl.float32)
    s = (tl.dot(qn, tl.trans(kn)) + tl.dot(qr, tl.trans(kr))) * qk_scale
    if MASKED:
        kpos = kp0 + cols
        seen = (kpos[None, :] <= qpos[:, None]) & in_tile[None, :]
        seen = seen & ((window <= 0) | (kpos[None, :] > qpos[:, None] - window))
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = p.to(v.dtype) if DOT_BF16 else p
    acc = acc * alpha[:, None] + tl.dot(pv, v)
    return acc, m_new, l_i


@triton.jit
def _mla_prefill_kernel(
    Q,
    K,
    KR,
    V,
    Out,
    CuQ,
    CuK,
    QStart,
    KStart,
    scale,
    window,
    sq_t,
    sq_h,
    sk_s,
    sk_h,
    skr_s,
    sv_s,
    sv_h,
    so_t,
    so_h,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_BF16: tl.constexpr,
    D_NOPE: tl.constexpr,
    D_ROPE: tl.constexpr,
    D_V: tl.constexpr,
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    q_lo = tl.load(CuQ + b)
    n = tl.load(CuQ + b + 1) - q_lo
    if tile * BLOCK_M >= n:
        return
    k_lo = tl.load(CuK + b)
    m = tl.load(CuK + b + 1) - k_lo
    p0 = tl.load(QStart + b)
    kp0 = tl.load(KStart + b)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    qpos = p0 + rows
    dn = tl.arange(0, D_NOPE)
    dr = tl.arange(0, D_ROPE)
    dv = tl.arange(0, D_V)
    q_ptr = Q + (q_lo + rows)[:, None] * sq_t + h * sq_h
    qn = tl.load(q_ptr + dn[None, :], mask=row_ok[:, None], other=0.0)
    qr = tl.load(q_ptr + D_NOPE + dr[None, :], mask=row_ok[:, None], other=0.0)
    if not DOT_BF16:  # the interpreter gets bf16 arithmetic wrong
        qn = qn.to(tl.float32)
        qr = qr.to(tl.float32)

    # keys any query of this tile can see: positions [first - W + 1, last]
    first = p0 + tile * BLOCK_M
    last = p0 + tl.minimum(tile * BLOCK_M + BLOCK_M, n) - 1
    lo_pos = tl.where(window > 0, first - window + 1, kp0)
    j_lo = tl.maximum(lo_pos - kp0, 0)
    j_hi = tl.minimum(last - kp0 + 1, m)
    j_start = (j_lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 domain
    # Tiles every query of the tile sees whole (no mask): keys at or before the first query and
    # after the last query's window start. Masked tiles before (window edge) and after (diagonal).
    u_lo = j_lo
    if window > 0:
        u_lo = tl.maximum(u_lo, last - window + 1 - kp0)
    u_lo = j_start + tl.cdiv(tl.maximum(u_lo - j_start, 0), BLOCK_N) * BLOCK_N
    u_hi = tl.minimum(first - kp0 + 1, j_hi)
    u_hi = j_start + tl.maximum(u_hi - j_start, 0) // BLOCK_N * BLOCK_N
    lo_end = tl.minimum(u_lo, j_hi)
    mid_end = tl.maximum(u_hi, lo_end)
    for phase in tl.static_range(3):  # masked window edge, unmasked interior, masked diagonal
        lo = j_start if phase == 0 else (lo_end if phase == 1 else mid_end)
        hi = lo_end if phase == 0 else (mid_end if phase == 1 else j_hi)
        for start in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                qn,
                qr,
                qpos,
                start,
                kp0,
                k_lo,
                j_lo,
                j_hi,
                window,
                qk_scale,
                K,
                KR,
                V,
                sk_s,
                sk_h,
                skr_s,
                sv_s,
                sv_h,
                h,
                dn,
                dr,
                dv,
                BLOCK_N,
                DOT_BF16,
                phase != 1,
            )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + (q_lo + rows)[:, None] * so_t + h * so_h + dv[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None]
    )


def tuned_config(window: int) -> dict:
    """H200 (2026-12-02, C = 4096): windows of 2048 and more (or none) take 128 queries x 64 keys on
    8 warps with 3 stages (W 4096, 128 heads: 4.67 ms vs 4.88 for the small tile); smaller windows
    take 64 x 64 on 4 warps with 2 stages, where the big tile wastes work on masked keys
    (W 128: 0.32 ms vs 0.43)."""
    if 0 < window < 2048:
        return {"block_m": 64, "num_warps": 4, "num_stages": 2}
    return {"block_m": 128, "num_warps": 8, "num_stages": 3}


def launch_mla_prefill(
    q,
    k,
    k_rope,
    v,
    out,
    cu_q,
    cu_k,
    q_start,
    k_start,
    softmax_scale: float,
    window: int,
    max_q: int,
    block_m: int | None = None,
    block_n: int = 64,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """q [T, H, 192], k [S, H, 128], k_rope [S, 64], v [S, H, 128] -> out [T, H, 128] (written;
    DeepSeek-V3's widths, any powers of two >= 16 work: the tiny test models use 32 + 64 and 32);
    cu_q / cu_k int32 [B + 1], q_start / k_start int32 [B] (positions of each request's first query
    / key); window <= 0 for full causal attention; max_q the longest request's query count.
    Default tile by window (``tuned_config``)."""
    tuned = tuned_config(window)
    block_m = block_m or tuned["block_m"]
    num_warps = num_warps or tuned["num_warps"]
    num_stages = num_stages or tuned["num_stages"]
    B, H = cu_q.shape[0] - 1, q.shape[1]
    grid = (B, triton.cdiv(max(max_q, 1), block_m), H)
    launch(
        _mla_prefill_kernel,
        grid,
        q,
        k,
        k_rope,
        v,
        out,
        cu_q,
        cu_k,
        q_start,
        k_start,
        softmax_scale,
        window,
        stride(q, 0),
        stride(q, 1),
        stride(k, 0),
        stride(k, 1),
        stride(k_rope, 0),
        stride(v, 0),
        stride(v, 1),
        stride(out, 0),
        stride(out, 1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_BF16=not interpret_mode(),
        D_NOPE=int(k.shape[2]),
        D_ROPE=int(k_rope.shape[1]),
        D_V=int(v.shape[2]),
        num_warps=num_warps,
        num_stages=num_stages,
    )
