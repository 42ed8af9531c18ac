"""Triton kernels of the device sampler (contract in ``sampling.py``); paddle-free.

Each row is split into chunks so that small batches still fill the GPU; five launches a step:

1. ``_prepare_kernel`` (row, chunk): the raw logits' max / sum of exp and finiteness, penalties
   from the row's count tables, logit bias, temperature; writes the processed logits ``y`` and
   the chunk's partial max, sum of exp and arg-max.
2. ``_cuts_kernel`` (row, chunk): combines the row's partials (chunk 0 stores the row's stats),
   then counts tokens and sums their mass above 16 cut points below the max and above the min-p
   cut.
3. ``_compact_kernel`` (row, chunk): picks the highest cut that provably keeps every kept token
   (min-p, top-k, top-p) with at most KMAX tokens above it, and writes the chunk's tokens above
   it into the row's scratch at the chunk's offset (token order kept).
4. ``_draw_kernel`` (row): exact selections by radix select over order-preserving integer keys,
   4 bits a round (the top-k threshold, then the top-p one, ties at its edge by token id), and a
   Gumbel-max draw, over the scratch; rows where no cut qualified (flat distributions) run them
   over the whole row.
5. ``_count_kernel`` (row): the chosen token counted in the row's output-count table.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops.launcher import launch, stride

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as in vLLM)
FLT_MAX = 3.4028234663852886e38
# Cut points of the first select pass, in log-probability units below the max (ascending depth).
CUT_DEPTHS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 13.0, 16.0, 20.0, 26.0, 34.0)
# Column layout of the per-row parameter arrays.
F_TEMPERATURE, F_TOP_P, F_MIN_P, F_REPETITION, F_PRESENCE, F_FREQUENCY = range(6)
NUM_F = 8
I_TOP_K, I_SLOT, I_NUM_BIAS = range(3)
NUM_I = 4
KMAX = 4096  # scratch tokens a row may compact into
_M32 = np.uint32(0xFFFFFFFF)


def _fmix32_np(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def gumbel_noise(ids: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """float32 [B, n] Gumbel(0, 1) noise of token ids [n] (or [B, n]) under each row's key
    (seeds int32 [B, 2], low and high words): the kernels' generator, in numpy."""
    s = seeds.astype(np.int64).astype(np.uint32)
    with np.errstate(over="ignore"):
        h = _fmix32_np((np.asarray(ids).astype(np.uint32) * np.uint32(0x9E3779B1)) ^ s[:, :1])
        h = _fmix32_np(h ^ s[:, 1:2])
    u = ((h >> np.uint32(8)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 16777216.0)
    return -np.log(-np.log(u))


def row_keys(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """int32 [B, 2]: each row's draw key from its request's 64-bit seed and step (the number of
    tokens it has generated), mixed by splitmix64's finalizer."""
    with np.errstate(over="ignore"):
        x = np.asarray(seeds, np.uint64) ^ (np.asarray(steps, np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    lo = (x & np.uint64(_M32)).astype(np.uint32).view(np.int32)
    hi = (x >> np.uint64(32)).astype(np.uint32).view(np.int32)
    return np.stack([lo, hi], axis=1)


@triton.jit
def _fmix32(h):
    """murmur3's 32-bit finalizer: every input bit flips each output bit with probability ~1/2."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _gumbel(ids, seed_lo, seed_hi):
    """Gumbel(0, 1) noise of token ids under a row's 64-bit key: a counter-based hash, so a
    draw depends only on (key, token), never on the batch. u in (0, 1) strictly."""
    h = _fmix32((ids.to(tl.uint32) * 0x9E3779B1) ^ seed_lo)
    h = _fmix32(h ^ seed_hi)
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _key(y):
    """float32 -> int64 with the same order (for radix selects over values)."""
    bits = y.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits.to(tl.int64) + 2147483648, (~bits).to(tl.int64))


@triton.jit
def _online(m, s, v):
    """Running (max, sum exp(. - max)) updated with a block v (may hold -inf)."""
    nm = tl.maximum(m, tl.max(v, 0))
    ref = tl.where(nm == float("-inf"), 0.0, nm)
    return nm, s * tl.exp(m - ref) + tl.sum(tl.exp(v - ref), 0)


@triton.jit
def _prepare_kernel(
    logits_ptr,
    logits_stride,
    work_ptr,
    counts_ptr,
    seen_ptr,
    fparams_ptr,
    iparams_ptr,
    bias_ids_ptr,
    bias_vals_ptr,
    part_ptr,
    V,
    NB,
    CHUNK,
    EPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    S = tl.num_programs(1)
    temp = tl.load(fparams_ptr + b * 8 + 0)
    rep = tl.load(fparams_ptr + b * 8 + 3)
    pres = tl.load(fparams_ptr + b * 8 + 4)
    freq = tl.load(fparams_ptr + b * 8 + 5)
    slot = tl.load(iparams_ptr + b * 4 + 1).to(tl.int64)
    nbias = tl.load(iparams_ptr + b * 4 + 2)
    inv_t = tl.where(temp < EPS, 1.0, 1.0 / tl.maximum(temp, EPS))  # greedy rows: the arg-max of z
    lim = tl.where(slot >= 0, V, 0)  # no slot: nothing loaded, counts read as 0
    end = tl.minimum(V, (c + 1) * CHUNK)
    m_raw = float("-inf")
    s_raw = 0.0
    m_y = float("-inf")
    s_y = 0.0
    best = float("-inf")
    best_i = 0
    bad = 0
    for start in range(c * CHUNK, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < end
        x = tl.load(logits_ptr + b * logits_stride + offs, mask=ok, other=float("-inf")).to(tl.float32)
        bad += tl.sum((ok & ((x != x) | (tl.abs(x) == float("inf")))).to(tl.int32), 0)
        m_raw, s_raw = _online(m_raw, s_raw, x)
        # repetition over prompt and output (divide positives, multiply the rest); presence once
        # and frequency per occurrence over the output
        cnt = tl.load(counts_ptr + slot * V + offs, mask=ok & (offs < lim), other=0)
        seen = tl.load(seen_ptr + slot * V + offs, mask=ok & (offs < lim), other=0)
        z = tl.where((cnt > 0) | (seen != 0), tl.where(x > 0, x / rep, x * rep), x)
        z = z - tl.where(cnt > 0, pres + freq * cnt.to(tl.float32), 0.0)
        for j in range(nbias):  # logit_bias, and -inf for tokens banned under min_tokens
            tid = tl.load(bias_ids_ptr + b * NB + j)
            z = tl.where(offs == tid, z + tl.load(bias_vals_ptr + b * NB + j), z)
        # an accepted parameter may overflow a logit (repetition_penalty 1e-310 is 0 in float32:
        # x / 0 = inf); clamped to the largest float, such tokens tie as the arg-max, never NaN
        y = tl.minimum(z * inv_t, 3.4028234663852886e38)  # FLT_MAX; -inf stays: a banned token
        y = tl.where(ok, y, float("-inf"))
        tl.store(work_ptr + b * V + offs, y, mask=ok)
        m_y, s_y = _online(m_y, s_y, y)
        bm = tl.max(y, 0)
        bi = start + tl.argmax(y, 0)
        best_i = tl.where(bm > best, bi, best_i)
        best = tl.maximum(best, bm)
    p = part_ptr + (b * S + c) * 8
    tl.store(p + 0, m_raw)
    tl.store(p + 1, s_raw)
    tl.store(p + 2, m_y)
    tl.store(p + 3, s_y)
    tl.store(p + 4, best)
    tl.store(p + 5, bad.to(tl.float32))
    tl.store(p + 6, best_i.to(tl.float32))  # < 2^24: exact


@triton.jit
def _merge(m, s, m2, s2):
    """Two (max, sum exp(. - max)) pairs as one."""
    nm = tl.maximum(m, m2)
    ref = tl.where(nm == float("-inf"), 0.0, nm)
    return nm, s * tl.exp(m - ref) + s2 * tl.exp(m2 - ref)


@triton.jit
def _row_stats(part_ptr, b, S):
    """A row's (lse of the raw logits, max and sum of y, non-finite count, arg-max) from its
    chunks' partials; the first of equal maxima wins."""
    m_raw = float("-inf")
    s_raw = 0.0
    m_y = float("-inf")
    s_y = 0.0
    best = float("-inf")
    best_i = 0.0
    bad = 0.0
    for c in range(S):
        p = part_ptr + (b * S + c) * 8
        m_raw, s_raw = _merge(m_raw, s_raw, tl.load(p + 0), tl.load(p + 1))
        m_y, s_y = _merge(m_y, s_y, tl.load(p + 2), tl.load(p + 3))
        bv = tl.load(p + 4)
        best_i = tl.where(bv > best, tl.load(p + 6), best_i)
        best = tl.maximum(best, bv)
        bad += tl.load(p + 5)
    return m_raw + tl.log(s_raw), m_y, s_y, bad, best_i.to(tl.int32)


@triton.jit
def _cuts(m, min_p, depths_ptr):
    """The 16 cut points (raised to the min-p cut) and the min-p cut, in y units."""
    cm = tl.where(min_p > 0, m + tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))
    return tl.maximum(m - tl.load(depths_ptr + tl.arange(0, 16)), cm), cm


@triton.jit
def _cuts_kernel(
    work_ptr,
    fparams_ptr,
    depths_ptr,
    part_ptr,
    cuts_ptr,
    stats_ptr,
    argmax_ptr,
    V,
    CHUNK,
    EPS: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    S = tl.num_programs(1)
    lse, m, s_y, bad, best_i = _row_stats(part_ptr, b, S)
    if c == 0:
        tl.store(stats_ptr + b * 4 + 0, lse)
        tl.store(stats_ptr + b * 4 + 1, m)
        tl.store(stats_ptr + b * 4 + 2, s_y)
        tl.store(stats_ptr + b * 4 + 3, bad)
        tl.store(argmax_ptr + b, best_i)
    if tl.load(fparams_ptr + b * 8 + 0) >= EPS:
        cuts, cm = _cuts(m, tl.load(fparams_ptr + b * 8 + 2), depths_ptr)
        # [16, TILE] accumulators, reduced once at the end: no cross-thread sums in the loop
        acc_cnt = tl.zeros([16, TILE], tl.float32)
        acc_mass = tl.zeros([16, TILE], tl.float32)
        acc_cnt_m = tl.zeros([TILE], tl.float32)
        acc_mass_m = tl.zeros([TILE], tl.float32)
        end = tl.minimum(V, (c + 1) * CHUNK)
        for start in range(c * CHUNK, end, TILE):
            offs = start + tl.arange(0, TILE)
            y = tl.load(work_ptr + b * V + offs, mask=offs < end, other=float("-inf"))
            e = tl.exp(y - m)
            ge = y[None, :] >= cuts[:, None]
            acc_cnt += ge.to(tl.float32)
            acc_mass += tl.where(ge, e[None, :], 0.0)
            acc_cnt_m += (y >= cm).to(tl.float32)
            acc_mass_m += tl.where(y >= cm, e, 0.0)
        cnt = tl.sum(acc_cnt, 1)
        mass = tl.sum(acc_mass, 1)
        cnt_m = tl.sum(acc_cnt_m, 0)
        mass_m = tl.sum(acc_mass_m, 0)
        q = cuts_ptr + (b * S + c) * 34
        tl.store(q + tl.arange(0, 16), cnt)
        tl.store(q + 16 + tl.arange(0, 16), mass)
        tl.store(q + 32, cnt_m)
        tl.store(q + 33, mass_m)


@triton.jit
def _plan(cuts_ptr, fparams_ptr, iparams_ptr, depths_ptr, stats_ptr, b, S, KMAX):
    """A sampled row's candidate cut from its chunks' counts: (index of the cut, 16 = the min-p
    cut; the cut; tokens above it; whether they fit the scratch; whether top-k applies; the
    mass above the min-p cut)."""
    top_p = tl.load(fparams_ptr + b * 8 + 1)
    top_k = tl.load(iparams_ptr + b * 4 + 0)
    cuts, cm = _cuts(tl.load(stats_ptr + b * 4 + 1), tl.load(fparams_ptr + b * 8 + 2), depths_ptr)
    jc = tl.arange(0, 16)
    cnt = tl.zeros([16], tl.float32)
    mass = tl.zeros([16], tl.float32)
    cnt_m = 0.0
    mass_m = 0.0
    for c in range(S):
        q = cuts_ptr + (b * S + c) * 34
        cnt += tl.load(q + jc)
        mass += tl.load(q + 16 + jc)
        cnt_m += tl.load(q + 32)
        mass_m += tl.load(q + 33)
    k_on = (top_k > 0) & (top_k.to(tl.float32) < cnt_m)
    # a cut is safe when every kept token lies above it: top-k keeps >= k above it, or (no
    # top-k) the mass above it already reaches top_p of the min-p set, or it is the min-p cut
    safe = (cuts <= cm) | (k_on & (cnt >= top_k.to(tl.float32)))
    safe = safe | ((k_on == 0) & (top_p < 1.0) & (mass >= top_p * mass_m))
    jsel = tl.min(tl.where(safe, jc, 16), 0)
    cstar = tl.where(jsel < 16, tl.sum(tl.where(jc == jsel, cuts, 0.0), 0), cm)
    count = tl.where(jsel < 16, tl.sum(tl.where(jc == jsel, cnt, 0.0), 0), cnt_m)
    return jsel, cstar, count, count <= KMAX, k_on, mass_m, cm


@triton.jit
def _compact_kernel(
    work_ptr,
    fparams_ptr,
    iparams_ptr,
    depths_ptr,
    stats_ptr,
    cuts_ptr,
    scratch_y_ptr,
    scratch_id_ptr,
    V,
    KMAX,
    CHUNK,
    EPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    S = tl.num_programs(1)
    if tl.load(fparams_ptr + b * 8 + 0) >= EPS:
        jsel, cstar, count, compact, k_on, mass_m, cm = _plan(
            cuts_ptr, fparams_ptr, iparams_ptr, depths_ptr, stats_ptr, b, S, KMAX
        )
        if compact:
            base = 0.0  # tokens above the cut in the chunks before this one
            for i in range(c):
                q = cuts_ptr + (b * S + i) * 34
                base += tl.where(jsel < 16, tl.load(q + jsel.to(tl.int64) % 16), tl.load(q + 32))
            pos0 = base.to(tl.int32)
            end = tl.minimum(V, (c + 1) * CHUNK)
            for start in range(c * CHUNK, end, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                y = tl.load(work_ptr + b * V + offs, mask=offs < end, other=float("-inf"))
                sel = y >= cstar
                pos = pos0 + tl.cumsum(sel.to(tl.int32), 0) - 1
                tl.store(scratch_y_ptr + b * KMAX + pos, y, mask=sel)
                tl.store(scratch_id_ptr + b * KMAX + pos, offs, mask=sel)
                pos0 += tl.sum(sel.to(tl.int32), 0)


@triton.jit
def _radix_select(src_ptr, n, floor_key, m, target, BY_MASS: tl.constexpr, TILE: tl.constexpr):
    """The largest key K with measure(key >= max(K, floor_key)) >= target over src[0:n], where the
    measure counts tokens or sums exp(y - m) (BY_MASS); built 4 bits a round from the top."""
    j16 = tl.arange(0, 16).to(tl.int64)
    ans = tl.zeros([], tl.int64)
    for r in range(8):
        shift = 28 - 4 * r
        cand = ans + (j16 << shift)
        acc = tl.zeros([16, TILE], tl.float32)  # reduced once a round
        for start in range(0, n, TILE):
            offs = start + tl.arange(0, TILE)
            y = tl.load(src_ptr + offs, mask=offs < n, other=float("-inf"))
            kk = _key(y)
            valid = (offs < n) & (kk >= floor_key)
            if BY_MASS:
                w = tl.where(valid, tl.exp(y - m), 0.0)
            else:
                w = valid.to(tl.float32)
            acc += tl.where(kk[None, :] >= cand[:, None], w[None, :], 0.0)
        ans = ans + (tl.max(tl.where(tl.sum(acc, 1) >= target, j16, 0), 0) << shift)
    return ans


@triton.jit
def _draw_kernel(
    work_ptr,
    logits_ptr,
    logits_stride,
    fparams_ptr,
    iparams_ptr,
    seeds_ptr,
    depths_ptr,
    stats_ptr,
    argmax_ptr,
    cuts_ptr,
    scratch_y_ptr,
    scratch_id_ptr,
    tokens_ptr,
    logprobs_ptr,
    V,
    KMAX,
    S,
    EPS: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    temp = tl.load(fparams_ptr + b * 8 + 0)
    top_p = tl.load(fparams_ptr + b * 8 + 1)
    top_k = tl.load(iparams_ptr + b * 4 + 0)
    seed_lo = tl.load(seeds_ptr + b * 2).to(tl.uint32, bitcast=True)
    seed_hi = tl.load(seeds_ptr + b * 2 + 1).to(tl.uint32, bitcast=True)
    m = tl.load(stats_ptr + b * 4 + 1)
    tok = tl.load(argmax_ptr + b)
    if temp >= EPS:
        jsel, cstar, count, compact, k_on, mass_m, cm = _plan(
            cuts_ptr, fparams_ptr, iparams_ptr, depths_ptr, stats_ptr, b, S, KMAX
        )
        if compact:
            src = scratch_y_ptr + b * KMAX
            n = count.to(tl.int32)
        else:
            src = work_ptr + b * V
            n = V
        t1 = _key(cm)
        if k_on:  # the k-th largest (ties at it all kept, as z >= kth)
            t1 = tl.maximum(t1, _radix_select(src, n, t1, m, top_k.to(tl.float32), False, TILE))
        s1 = mass_m  # the mass top-p is a share of: above the min-p cut, or of the top k
        if k_on:  # every token of the top k is in src (src holds all above a cut below the k-th)
            s1 = 0.0
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                y = tl.load(src + offs, mask=offs < n, other=float("-inf"))
                s1 += tl.sum(tl.where((offs < n) & (_key(y) >= t1), tl.exp(y - m), 0.0), 0)
        fkey = t1
        n_ties = 2147483647
        if top_p < 1.0:  # smallest prefix by mass reaching top_p; ties at its edge by token id
            target = top_p * s1
            fkey = _radix_select(src, n, t1, m, target, True, TILE)
            mass_gt = 0.0
            tie_mass = 0.0
            tie_cnt = 0.0
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                y = tl.load(src + offs, mask=offs < n, other=float("-inf"))
                kk = _key(y)
                e = tl.where(offs < n, tl.exp(y - m), 0.0)
                mass_gt += tl.sum(tl.where(kk > fkey, e, 0.0), 0)
                tie_mass += tl.sum(tl.where(kk == fkey, e, 0.0), 0)
                tie_cnt += tl.sum((kk == fkey).to(tl.float32), 0)
            p_tie = tie_mass / tl.maximum(tie_cnt, 1.0)
            need = tl.ceil((target - mass_gt) / tl.maximum(p_tie, 1e-38))
            n_ties = tl.minimum(tl.maximum(need, 1.0), tl.maximum(tie_cnt, 1.0)).to(tl.int32)
        # draw: Gumbel-max over the kept tokens (first of equal scores: token order)
        best = float("-inf")
        ties = 0
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < n
            y = tl.load(src + offs, mask=ok, other=float("-inf"))
            ids = tl.load(scratch_id_ptr + b * KMAX + offs, mask=offs < tl.where(compact, n, 0), other=0)
            ids = tl.where(compact, ids, offs)
            kk = _key(y)
            tie = ok & (kk == fkey)
            rank = ties + tl.cumsum(tie.to(tl.int32), 0)
            keep = ok & ((kk > fkey) | (tie & (rank <= n_ties)))
            score = tl.where(keep, y + _gumbel(ids, seed_lo, seed_hi), float("-inf"))
            bs = tl.max(score, 0)
            bi = tl.sum(tl.where(tl.arange(0, BLOCK) == tl.argmax(score, 0), ids, 0), 0)
            tok = tl.where(bs > best, bi, tok)
            best = tl.maximum(best, bs)
            ties += tl.sum(tie.to(tl.int32), 0)
    tl.store(tokens_ptr + b, tok)
    raw = tl.load(logits_ptr + b * logits_stride + tok).to(tl.float32)
    tl.store(logprobs_ptr + b, raw - tl.load(stats_ptr + b * 4 + 0))


@triton.jit
def _count_kernel(tokens_ptr, iparams_ptr, counts_ptr, V):
    """counts[slot, token] += 1 for rows that keep counts (slot >= 0); slots are distinct."""
    b = tl.program_id(0)
    slot = tl.load(iparams_ptr + b * 4 + 1).to(tl.int64)
    if slot >= 0:
        ptr = counts_ptr + slot * V + tl.load(tokens_ptr + b)
        tl.store(ptr, tl.load(ptr) + 1)


SAMPLER_PROGRAMS = 512  # programs a pass aims for over all rows (4 per SM of an H200)


def chunk_size(B: int, V: int, block: int) -> int:
    """Tokens of a row a program takes: enough programs for SAMPLER_PROGRAMS in all, at most 64 a
    row, a whole number of blocks each."""
    want = max(1, min(64, triton.cdiv(SAMPLER_PROGRAMS, max(B, 1))))
    return triton.cdiv(triton.cdiv(V, want), block) * block


def num_chunks(B: int, V: int, block: int) -> int:
    """Chunks a row is split into (the partials' second dimension)."""
    return triton.cdiv(V, chunk_size(B, V, block))


def launch_sample(
    logits,
    work,
    counts,
    seen,
    fparams,
    iparams,
    seeds,
    bias_ids,
    bias_vals,
    depths,
    stats,
    argmax,
    scratch_y,
    scratch_id,
    tokens,
    logprobs,
    part,
    cuts,
    block: int = 2048,
    num_warps: int = 4,
) -> None:
    """Framework-neutral launch of the sampler's kernels over B = logits.shape[0] rows.

    logits [B, V] (float32 / bfloat16, rows may be strided); work float32 [B, V]; counts int32
    and seen uint8 [S, V]; fparams float32 [B, 8]; iparams int32 [B, 4]; seeds int32 [B, 2];
    bias_ids int32 / bias_vals float32 [B, NB]; depths float32 [16]; stats float32 [B, 4];
    argmax int32 [B]; scratch_y float32 / scratch_id int32 [B, KMAX]; part float32 [B, C, 8] and
    cuts float32 [B, C, 34] with C = ``num_chunks(B, V, block)`` chunks a row (the partials);
    tokens int32 [B] and logprobs float32 [B] are written."""
    B, V = int(logits.shape[0]), int(logits.shape[1])
    if B == 0:
        return
    chunk = chunk_size(B, V, block)
    C = triton.cdiv(V, chunk)
    if int(part.shape[1]) != C or int(cuts.shape[1]) != C:
        raise ValueError(f"part / cuts need num_chunks(B, V, block) = {C} chunks a row")
    ls = stride(logits, 0)
    kmax = int(scratch_y.shape[1])
    meta = {"EPS": SAMPLING_EPS, "BLOCK": block, "num_warps": num_warps}
    tiled = {**meta, "TILE": min(block, 256)}  # the 16-way passes' tile width
    launch(
        _prepare_kernel,
        (B, C),
        logits,
        ls,
        work,
        counts,
        seen,
        fparams,
        iparams,
        bias_ids,
        bias_vals,
        part,
        V,
        int(bias_ids.shape[1]),
        chunk,
        **meta,
    )
    launch(_cuts_kernel, (B, C), work, fparams, depths, part, cuts, stats, argmax, V, chunk, **tiled)
    launch(
        _compact_kernel,
        (B, C),
        work,
        fparams,
        iparams,
        depths,
        stats,
        cuts,
        scratch_y,
        scratch_id,
        V,
        kmax,
        chunk,
        **meta,
    )
    launch(
        _draw_kernel,
        (B,),
        work,
        logits,
        ls,
        fparams,
        iparams,
        seeds,
        depths,
        stats,
        argmax,
        cuts,
        scratch_y,
        scratch_id,
        tokens,
        logprobs,
        V,
        kmax,
        C,
        **tiled,
    )


def launch_count(tokens, iparams, counts) -> None:
    """counts int32 [S, V] += 1 at (slot, token) of each row with a slot."""
    B = int(tokens.shape[0])
    if B:
        launch(_count_kernel, (B,), tokens, iparams, counts, int(counts.shape[1]))
