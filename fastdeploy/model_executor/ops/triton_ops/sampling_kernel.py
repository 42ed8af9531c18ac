"""Triton kernels of the device sampler (contract in ``sampling.py``); paddle-free.

One program a row, three launches a step:

1. ``_prepare_kernel`` (one pass over the vocabulary): the raw row's log-sum-exp and finiteness,
   penalties from the row's count tables, logit bias, temperature; writes the processed logits
   ``y`` and their max, sum of exp and arg-max.
2. ``_select_kernel``: the kept set (min-p, then top-k, then top-p, ties by token id) and a
   Gumbel-max draw over it. A first pass measures count and mass above 16 cut points below the
   max; the highest cut that provably keeps every kept token and leaves at most KMAX tokens above
   it lets a second pass compact those tokens into a scratch row, and the exact selections (radix
   selects over order-preserving integer keys, 4 bits a round) then run over the scratch instead
   of the vocabulary. Rows where no cut qualifies (flat distributions) run the same selections
   over the whole row.
3. ``_count_kernel``: the chosen token counted in the row's output-count table.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops.launcher import launch, stride

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as in vLLM)
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
    stats_ptr,
    argmax_ptr,
    V,
    NB,
    EPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    temp = tl.load(fparams_ptr + b * 8 + 0)
    rep = tl.load(fparams_ptr + b * 8 + 3)
    pres = tl.load(fparams_ptr + b * 8 + 4)
    freq = tl.load(fparams_ptr + b * 8 + 5)
    slot = tl.load(iparams_ptr + b * 4 + 1).to(tl.int64)
    nbias = tl.load(iparams_ptr + b * 4 + 2)
    inv_t = tl.where(temp < EPS, 1.0, 1.0 / tl.maximum(temp, EPS))  # greedy rows: the arg-max of z
    lim = tl.where(slot >= 0, V, 0)  # no slot: nothing loaded, counts read as 0
    m_raw = float("-inf")
    s_raw = 0.0
    m_y = float("-inf")
    s_y = 0.0
    best = float("-inf")
    best_i = 0
    bad = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < V
        x = tl.load(logits_ptr + b * logits_stride + offs, mask=ok, other=float("-inf")).to(tl.float32)
        bad += tl.sum((ok & ((x != x) | (tl.abs(x) == float("inf")))).to(tl.int32), 0)
        m_raw, s_raw = _online(m_raw, s_raw, x)
        # repetition over prompt and output (divide positives, multiply the rest); presence once
        # and frequency per occurrence over the output
        cnt = tl.load(counts_ptr + slot * V + offs, mask=offs < lim, other=0)
        seen = tl.load(seen_ptr + slot * V + offs, mask=offs < lim, other=0)
        z = tl.where((cnt > 0) | (seen != 0), tl.where(x > 0, x / rep, x * rep), x)
        z = z - tl.where(cnt > 0, pres + freq * cnt.to(tl.float32), 0.0)
        for j in range(nbias):  # logit_bias, and -inf for tokens banned under min_tokens
            tid = tl.load(bias_ids_ptr + b * NB + j)
            z = tl.where(offs == tid, z + tl.load(bias_vals_ptr + b * NB + j), z)
        y = tl.where(ok, z * inv_t, float("-inf"))
        tl.store(work_ptr + b * V + offs, y, mask=ok)
        m_y, s_y = _online(m_y, s_y, y)
        bm = tl.max(y, 0)
        bi = start + tl.argmax(y, 0)
        best_i = tl.where(bm > best, bi, best_i)
        best = tl.maximum(best, bm)
    tl.store(stats_ptr + b * 4 + 0, m_raw + tl.log(s_raw))
    tl.store(stats_ptr + b * 4 + 1, m_y)
    tl.store(stats_ptr + b * 4 + 2, s_y)
    tl.store(stats_ptr + b * 4 + 3, bad.to(tl.float32))
    tl.store(argmax_ptr + b, best_i.to(tl.int32))


@triton.jit
def _radix_select(src_ptr, n, floor_key, m, target, BY_MASS: tl.constexpr, BLOCK: tl.constexpr):
    """The largest key K with measure(key >= max(K, floor_key)) >= target over src[0:n], where the
    measure counts tokens or sums exp(y - m) (BY_MASS); built 4 bits a round from the top."""
    j16 = tl.arange(0, 16).to(tl.int64)
    ans = tl.zeros([], tl.int64)
    for r in range(8):
        shift = 28 - 4 * r
        cand = ans + (j16 << shift)
        acc = tl.zeros([16], tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            y = tl.load(src_ptr + offs, mask=offs < n, other=float("-inf"))
            kk = _key(y)
            valid = (offs < n) & (kk >= floor_key)
            if BY_MASS:
                w = tl.where(valid, tl.exp(y - m), 0.0)
            else:
                w = valid.to(tl.float32)
            acc += tl.sum(tl.where(kk[None, :] >= cand[:, None], w[None, :], 0.0), 1)
        ans = ans + (tl.max(tl.where(acc >= target, j16, 0), 0) << shift)
    return ans


@triton.jit
def _select_kernel(
    work_ptr,
    logits_ptr,
    logits_stride,
    fparams_ptr,
    iparams_ptr,
    seeds_ptr,
    depths_ptr,
    stats_ptr,
    argmax_ptr,
    scratch_y_ptr,
    scratch_id_ptr,
    tokens_ptr,
    logprobs_ptr,
    V,
    KMAX,
    EPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    temp = tl.load(fparams_ptr + b * 8 + 0)
    top_p = tl.load(fparams_ptr + b * 8 + 1)
    min_p = tl.load(fparams_ptr + b * 8 + 2)
    top_k = tl.load(iparams_ptr + b * 4 + 0)
    seed_lo = tl.load(seeds_ptr + b * 2).to(tl.uint32, bitcast=True)
    seed_hi = tl.load(seeds_ptr + b * 2 + 1).to(tl.uint32, bitcast=True)
    m = tl.load(stats_ptr + b * 4 + 1)
    tok = tl.load(argmax_ptr + b)
    if temp >= EPS:
        wrow = work_ptr + b * V
        cm = tl.where(min_p > 0, m + tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))
        # pass 1: count and mass above each cut (raised to the min-p cut) and above the min-p cut
        jc = tl.arange(0, 16)
        cuts = tl.maximum(m - tl.load(depths_ptr + jc), cm)
        cnt = tl.zeros([16], tl.float32)
        mass = tl.zeros([16], tl.float32)
        cnt_m = 0.0
        mass_m = 0.0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            y = tl.load(wrow + offs, mask=offs < V, other=float("-inf"))
            e = tl.exp(y - m)
            ge = y[None, :] >= cuts[:, None]
            cnt += tl.sum(ge.to(tl.float32), 1)
            mass += tl.sum(tl.where(ge, e[None, :], 0.0), 1)
            cnt_m += tl.sum((y >= cm).to(tl.float32), 0)
            mass_m += tl.sum(tl.where(y >= cm, e, 0.0), 0)
        k_on = (top_k > 0) & (top_k.to(tl.float32) < cnt_m)
        # a cut is safe when every kept token lies above it: top-k keeps >= k above it, or (no
        # top-k) the mass above it already reaches top_p of the min-p set, or it is the min-p cut
        safe = (cuts <= cm) | (k_on & (cnt >= top_k.to(tl.float32)))
        safe = safe | ((k_on == 0) & (top_p < 1.0) & (mass >= top_p * mass_m))
        jsel = tl.min(tl.where(safe, jc, 16), 0)
        cstar = tl.where(jsel < 16, tl.sum(tl.where(jc == jsel, cuts, 0.0), 0), cm)
        count = tl.where(jsel < 16, tl.sum(tl.where(jc == jsel, cnt, 0.0), 0), cnt_m)
        compact = count <= KMAX
        if compact:  # pass 2: the tokens above the cut, in token order, into the scratch row
            base = 0
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                y = tl.load(wrow + offs, mask=offs < V, other=float("-inf"))
                sel = y >= cstar
                pos = base + tl.cumsum(sel.to(tl.int32), 0) - 1
                tl.store(scratch_y_ptr + b * KMAX + pos, y, mask=sel)
                tl.store(scratch_id_ptr + b * KMAX + pos, offs, mask=sel)
                base += tl.sum(sel.to(tl.int32), 0)
            src = scratch_y_ptr + b * KMAX
            n = base
        else:
            src = wrow
            n = V
        t1 = _key(cm)
        if k_on:  # the k-th largest (ties at it all kept, as z >= kth)
            t1 = tl.maximum(t1, _radix_select(src, n, t1, m, top_k.to(tl.float32), False, BLOCK))
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
            fkey = _radix_select(src, n, t1, m, target, True, BLOCK)
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
        tok = tl.load(argmax_ptr + b)
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
    block: int = 2048,
    num_warps: int = 4,
) -> None:
    """Framework-neutral launch of the prepare and select kernels over B = logits.shape[0] rows.
    Default tile (2048 tokens, 4 warps): the fastest of blocks 512-4096 x warps 4-16 on the H200
    at B = 1 and 256 (benchmarks/README.md).

    logits [B, V] (float32 / bfloat16, rows may be strided); work float32 [B, V]; counts int32
    and seen uint8 [S, V]; fparams float32 [B, 8]; iparams int32 [B, 4]; seeds int32 [B, 2];
    bias_ids int32 / bias_vals float32 [B, NB]; depths float32 [16]; stats float32 [B, 4];
    argmax int32 [B]; scratch_y float32 / scratch_id int32 [B, KMAX]; tokens int32 [B] and
    logprobs float32 [B] are written."""
    B, V = int(logits.shape[0]), int(logits.shape[1])
    if B == 0:
        return
    ls = stride(logits, 0)
    nb = int(bias_ids.shape[1])
    kmax = int(scratch_y.shape[1])
    launch(
        _prepare_kernel,
        (B,),
        logits,
        ls,
        work,
        counts,
        seen,
        fparams,
        iparams,
        bias_ids,
        bias_vals,
        stats,
        argmax,
        V,
        nb,
        EPS=SAMPLING_EPS,
        BLOCK=block,
        num_warps=num_warps,
    )
    launch(
        _select_kernel,
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
        scratch_y,
        scratch_id,
        tokens,
        logprobs,
        V,
        kmax,
        EPS=SAMPLING_EPS,
        BLOCK=block,
        num_warps=num_warps,
    )


def launch_count(tokens, iparams, counts) -> None:
    """counts int32 [S, V] += 1 at (slot, token) of each row with a slot."""
    B = int(tokens.shape[0])
    if B:
        launch(_count_kernel, (B,), tokens, iparams, counts, int(counts.shape[1]))
