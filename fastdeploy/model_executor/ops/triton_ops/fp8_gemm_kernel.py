"""W8A8 block-scaled GEMM (docs/design.md §4.8, DeepSeek-V3's inference recipe), Triton, paddle-free.

y [M, N] = x [M, K] @ W^T with W given as e4m3 codes uint8 [N, K] and float32 scales
ws [ceil(N/128), ceil(K/128)] (the real weight is code * scale per 128 x 128 block).
1. ``_act_quant_kernel``: per token per 128 input columns, s = max(amax, 1e-12) / 448 and the
   e4m3 code of x / s (round to nearest even, the same integer rounding as the FP8 cache writer).
2. ``_w8a8_gemm_kernel``: for each 128-wide K block, one FP8 x FP8 tensor-core dot with float32
   accumulation, scaled by the token's activation scale times the weight block's scale, summed
   over K blocks. BLOCK_N divides 128, so a tile's columns share one weight scale per K block
   (a per-column scale vector, which would allow 256-wide tiles, ran M = 64 10-20% slower and the
   wide tiles never won: h200_2026-12-03_fp8_gemm_small_sweep2.json).
   With SPLIT_K > 1 each program sums its share of the K blocks into a float32 partial
   [SPLIT_K, M, N] (small M: more programs streaming the weight than M x N tiles alone give), and
   the last program of each tile sums the partials in split order: one launch, deterministic.
3. QUANT_A (M <= 16): the GEMM takes the activations and quantizes each K block of its rows the
   way ``_act_quant_kernel`` does, in every N tile, saving a launch. On the GPU the e4m3 code
   comes from the hardware conversion (round to nearest, ties to even, as ``_e4m3_byte``); the
   software rounding there made this path ALU-bound, up to 5x slower at M = 64 (issue 22).
4. ``_w8a8_gemm_tma_kernel`` (M >= 128): the same math with both operands brought in by tensor
   descriptors (TMA) as e4m3, tiles in grouped order (GROUP_M row tiles share a weight tile in
   L2) and activation scales read M-major ([ceil(K/128), M], one coalesced row a K block). On the
   H200 this took dense gate_up at M = 4096 from 570 to 893 TFLOP/s; warp specialization and
   persistent tiles added nothing (benchmarks/results/h200_2026-12-04_fp8_large_m_sweep.json).
   Its SASS (benchmarks/results/h200_2026-12-04_fp8_tma_kernel_128x128_8w.sass) shows what
   bounds it: each K block issues four QGMMA 64x128x32 a warpgroup, waits for all of them
   (WARPGROUP.DEPBAR.LE gsb0, 0x0), passes two CTA barriers and then promotes with 64 FFMAs a
   thread, so the next block's MMAs wait for the promotion and the barriers keep a CTA's two
   warpgroups in step. Hence one warpgroup a CTA where K is short (several independent CTAs an
   SM overlap each other's promotions); a hand-pipelined loop (block k+1's dot issued before
   block k's promotion) compiled to the same wait and ran 6-20% slower (sweep_fp8_forms.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fastdeploy.model_executor.ops.fp8_numerics import FP8_BLOCK, FP8_MAX
from fastdeploy.model_executor.ops.triton_ops.launcher import interpret_mode, launch, stride
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache_kernel import _e4m3_byte

_FMAX = tl.constexpr(FP8_MAX)
SCALE_FLOOR = 1e-12  # an all-zero block gets codes 0 and a tiny scale instead of 0 / 0
_FLOOR = tl.constexpr(SCALE_FLOOR)


@triton.jit
def _act_quant_kernel(X, Codes, Scales, M, K, sx, sc, ss_m, ss_k, FP8_BLOCK_: tl.constexpr, ROWS: tl.constexpr):
    """One program: ROWS tokens' 128 columns of block kb -> codes uint8 and a float32 scale a row
    (ROWS rows a program: one row a program left the H200 launch-bound, 229k programs at 4096 x
    7168)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    kb = tl.program_id(1)
    cols = kb * FP8_BLOCK_ + tl.arange(0, FP8_BLOCK_)
    r_ok = rows < M
    ok = r_ok[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * sx + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), 1), _FLOOR) / _FMAX
    q = tl.minimum(tl.maximum(x / s[:, None], -_FMAX), _FMAX)
    tl.store(Codes + r64 * sc + cols[None, :], _e4m3_byte(q), mask=ok)
    tl.store(Scales + rows.to(tl.int64) * ss_m + kb * ss_k, s, mask=r_ok)


@triton.jit
def _w8a8_gemm_kernel(
    A,
    AS,
    B,
    BS,
    C,
    P,
    Counters,
    M,
    N,
    K,
    sa,
    sas,
    sb,
    sbs,
    sc,
    kb_per_split,
    n_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP8: tl.constexpr,
    QUANT_A: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok, c_ok = rows < M, cols < N
    kk = tl.arange(0, 128)
    n_kb = tl.cdiv(K, 128)
    kb_lo = split * kb_per_split
    kb_hi = tl.minimum(kb_lo + kb_per_split, n_kb)
    a_ptr = A + rows.to(tl.int64)[:, None] * sa + kk[None, :]
    b_ptr = B + cols.to(tl.int64)[:, None] * sb + kk[None, :]
    nb = (pid_n * BLOCK_N) // 128  # the tile's weight-scale row
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(kb_lo, kb_hi):
        k_ok = kb * 128 + kk < K
        a = tl.load(a_ptr + kb * 128, mask=r_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(b_ptr + kb * 128, mask=c_ok[:, None] & k_ok[None, :], other=0)
        if QUANT_A:  # A holds bf16 / float32 activations: _act_quant_kernel's math on this block
            af = a.to(tl.float32)
            a_s = tl.maximum(tl.max(tl.abs(af), 1), _FLOOR) / _FMAX
            q = tl.minimum(tl.maximum(af / a_s[:, None], -_FMAX), _FMAX)
            if DOT_FP8:  # the hardware conversion (cvt.rn.satfinite: nearest, ties to even)
                a = q.to(tl.float8e4nv)
            else:
                a = _e4m3_byte(q).to(tl.float8e4nv, bitcast=True)
        else:
            a_s = tl.load(AS + rows.to(tl.int64) * sas + kb, mask=r_ok, other=0.0)
            a = a.to(tl.float8e4nv, bitcast=True)
        b = b.to(tl.float8e4nv, bitcast=True)
        if not DOT_FP8:  # the interpreter: exact products in float32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        part = tl.dot(a, tl.trans(b))  # [BLOCK_M, BLOCK_N] float32
        b_s = tl.load(BS + nb * sbs + kb)
        acc += part * (a_s * b_s)[:, None]
    tile = pid_m * tl.num_programs(1) + pid_n
    _write_tile(acc, C, P, Counters, rows, cols, r_ok, c_ok, M, N, sc, split, n_split, tile, SPLIT)


@triton.jit
def _write_tile(acc, C, P, Counters, rows, cols, r_ok, c_ok, M, N, sc, split, n_split, tile, SPLIT: tl.constexpr):
    """Store a tile's float32 acc into C, or with SPLIT write this split's partial into P
    [n_split, M, N]; the last split of the tile to arrive (Counters[tile]) sums all partials in
    split order, so the result does not depend on arrival order, and zeroes the counter for the
    next launch."""
    ok = r_ok[:, None] & c_ok[None, :]
    dst = C + rows.to(tl.int64)[:, None] * sc + cols[None, :]
    if SPLIT:
        tile_p = P + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(tile_p + split * M * N, acc, mask=ok)
        tl.debug_barrier()  # every thread's partial is written before the count (release below)
        arrived = tl.atomic_add(Counters + tile, 1, sem="acq_rel")
        if arrived == n_split - 1:
            acc = tl.zeros(acc.shape, tl.float32)
            for s in range(n_split):  # .cg: from L2, where the other splits' partials landed
                acc += tl.load(tile_p + s * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(dst, acc.to(C.dtype.element_ty), mask=ok)
            tl.atomic_xchg(Counters + tile, 0)
    else:
        tl.store(dst, acc.to(C.dtype.element_ty), mask=ok)


@triton.jit
def grouped_tile(t, num_m, num_n, GROUP_M: tl.constexpr):
    """Tile t's (row, column) in grouped order: GROUP_M row tiles walk the columns together, so a
    weight tile is read by GROUP_M neighbours while it is in L2."""
    first = t // (GROUP_M * num_n) * GROUP_M
    size = tl.minimum(num_m - first, GROUP_M)
    return first + (t % (GROUP_M * num_n)) % size, (t % (GROUP_M * num_n)) // size


@triton.jit
def _w8a8_gemm_tma_kernel(
    a_desc,
    b_desc,
    AS,
    BS,
    C,
    P,
    Counters,
    M,
    N,
    K,
    sas_m,
    sas_k,
    sbs,
    kb_per_split,
    n_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_FP8: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """a_desc / b_desc: e4m3 [M, K] / [N, K] descriptors with [BLOCK_M, 128] / [BLOCK_N, 128]
    blocks (reads past the edge are zeros); program (t, split) takes tile t of C (BLOCK_N <= 128:
    one weight scale a K block) over its split's K blocks, as ``_w8a8_gemm_kernel``. Each K
    block's dot starts from zero and is promoted into the float32 accumulator with its scales:
    the tensor cores' FP8 accumulation keeps ~14 bits, so accumulating in place across K blocks
    (rescaling the accumulator by c_{k-1} / c_k) was 3x less accurate on the H200
    (h200_2026-12-04_fp8_tma_sweep.json, its form in commit 1493a7d)."""
    t = tl.program_id(0)
    split = tl.program_id(1)
    pid_m, pid_n = grouped_tile(t, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < M
    nb = (pid_n * BLOCK_N) // 128
    kb_lo = split * kb_per_split
    kb_hi = tl.minimum(kb_lo + kb_per_split, tl.cdiv(K, 128))
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(kb_lo, kb_hi):
        a = a_desc.load([pid_m * BLOCK_M, kb * 128])
        b = b_desc.load([pid_n * BLOCK_N, kb * 128])
        if not DOT_FP8:  # the interpreter: exact products in float32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        a_s = tl.load(AS + rows * sas_m + kb * sas_k, mask=r_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * (a_s * tl.load(BS + nb * sbs + kb))[:, None]
    _write_tile(acc, C, P, Counters, rows, cols, r_ok, cols < N, M, N, N, split, n_split, t, SPLIT)


def _splits(tiles: int, n_kb: int, programs: float, min_kb: int) -> int:
    """K splits for ``tiles`` tiles: doubled while the programs stay below ``programs`` and each
    split keeps >= min_kb of the n_kb K blocks, then trimmed so that every split gets K blocks."""
    split = 1
    while tiles * split < programs and n_kb // (2 * split) >= min_kb:
        split *= 2
    return triton.cdiv(n_kb, triton.cdiv(n_kb, split))


def tuned_config(M: int, N: int, K: int, num_sms: int = 132, captured: bool = False) -> dict:
    """Tile, split-K, kernel and where the activations are quantized, from H200 sweeps (graph
    replays over cold weights at M <= 64). M >= 128: the TMA kernel where it pays (below), else
    128 x 128 pointer tiles on 8 warps, 5 stages (h200_2026-12-03_fp8_gemm_sweep.json). M 17..64:
    the TMA kernel where captured or large, below. M <= 16, where the pointer kernel is still
    faster than the TMA kernel (h200_2026-12-04_fp8_tma_small_sweep.json;
    h200_2026-12-03_fp8_gemm_small_sweep*.json): it streams the weight once and needs enough
    programs in flight to cover HBM latency, so K is split to about two waves keeping >= 8 K
    blocks a split (expert gate_up 4096 x 7168: 4 splits 15.4 us, 1 split 28.2), and it
    quantizes its activations inside the GEMM ("fuse_quant"): one launch fewer for the eager
    engine, 3-16% more GPU time than a separate quantization launch
    (h200_2026-12-03_fp8_gemm_decode_sizes.json). ``captured``: the GEMM runs inside a CUDA
    graph (``layers.linear.captured_gemms``), where a launch costs no host time, so M <= 16 also
    quantizes by its own launch (o_proj M 1: 41.9 against 51.1 us as graph replays,
    h200_2026-12-04_fp8_gemm_tma_final) and M 17..64 always takes the TMA kernel. "tma":
    ``_w8a8_gemm_tma_kernel``, which wants M-major activation scales
    (``launch_act_quant(..., m_major=True)``)."""
    n_kb = triton.cdiv(K, FP8_BLOCK)
    # TMA where the rows are 16-byte aligned and M N K >= 2^33: below that the eager launch's host
    # cost (two descriptors) outweighs the gain (expert down at M 512: 0.167 ms against 0.118,
    # h200_2026-12-04_fp8_gemm_tma.json).
    tma = K % 16 == 0 and M * N * K >= 2**33
    one_wg = {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 3, "split_k": 1, "fuse_quant": False}
    if M >= 128:
        if not tma:
            return {**one_wg, "block_m": 128, "num_warps": 8, "num_stages": 5}
        # One warpgroup a CTA, three CTAs an SM: the CTAs' promotions overlap each other's MMAs,
        # where two warpgroups of one CTA run in lockstep (a CTA barrier every K block, see the
        # module docstring). Short K gains (q_b 746 -> 835, expert down 754 -> 862 TFLOP/s at M
        # 4096); K 7168 keeps 128 x 128 (expert gate_up 860 against 811;
        # h200_2026-12-04_fp8_forms.json).
        if K <= 2048:
            return {**one_wg, "tma": True}
        return {**one_wg, "block_m": 128, "num_warps": 8, "num_stages": 4, "tma": True}
    if M > 16 and K % 16 == 0 and (captured or tma):
        # M 17..64 through descriptors, one 64-row warpgroup a CTA, as graph replays over cold
        # weights (h200_2026-12-04_fp8_tma_small_sweep.json, M 64 against the pointer kernel):
        # a wave of 64 x 128 tiles needs no split (dense gate_up 82.6 against 107.9 us, q_b 17.4
        # against 17.7); fewer N tiles take 64 x 64 on 5 stages, K split to 1.5 waves keeping >= 12
        # K blocks a split (o_proj 47.8 against 59.9, expert gate_up 18.3 against 28.9, expert
        # down 10.7 against 12.0). Eagerly only above 2^33 M N K, as at M >= 128: the
        # descriptors' host cost made expert gate_up M 64 take 151 us against 56 eagerly
        # (h200_2026-12-04_fp8_gemm_full.json).
        if triton.cdiv(N, 128) >= num_sms:
            return {**one_wg, "tma": True}
        split = _splits(triton.cdiv(N, 64), n_kb, 1.5 * num_sms, 12)
        return {**one_wg, "block_n": 64, "num_stages": 5, "split_k": split, "tma": True}
    block_m = max(16, triton.next_power_of_2(M))
    tiles64 = triton.cdiv(M, block_m) * triton.cdiv(N, 64)
    long_k = n_kb >= 32
    if M <= 16:
        block_n, waves, min_kb = 64, 2, 8
    else:
        block_n = 128 if long_k and tiles64 < num_sms else 64
        waves, min_kb = (1, 4) if long_k else (0, n_kb)
    split = _splits(triton.cdiv(M, block_m) * triton.cdiv(N, block_n), n_kb, waves * num_sms, min_kb)
    cfg = {"block_m": block_m, "block_n": block_n, "num_warps": 4, "num_stages": 4, "split_k": split}
    return {**cfg, "fuse_quant": M <= 16 and not captured}


def launch_act_quant(x, codes, scales, m_major: bool = False) -> None:
    """x [M, K] (bf16 / float32, rows may be strided) -> codes uint8 [M, K], scales float32
    [M, ceil(K / 128)], or [ceil(K / 128), M] with ``m_major`` (the TMA GEMM's layout)."""
    M, K = int(x.shape[0]), int(x.shape[1])
    if M == 0:
        return
    rows = min(16, triton.next_power_of_2(M))
    grid = (triton.cdiv(M, rows), triton.cdiv(K, FP8_BLOCK))
    launch(
        _act_quant_kernel,
        grid,
        x,
        codes,
        scales,
        M,
        K,
        stride(x, 0),
        stride(codes, 0),
        1 if m_major else stride(scales, 0),
        stride(scales, 0) if m_major else 1,
        FP8_BLOCK,
        rows,
    )


SPLIT_COUNTERS = 8192  # the most tiles a split GEMM may have (M <= 64: 36864 / 64 = 576)


def launch_w8a8_gemm(a, a_s, b, b_s, out, cfg: dict, part=None, counters=None) -> None:
    """a uint8 [M, K] codes with a_s float32 [M, ceil(K/128)], b uint8 [N, K], b_s float32
    [ceil(N/128), ceil(K/128)] -> out [M, N] (contiguous, bf16 / float32).
    cfg["tma"]: a_s is M-major, float32 [ceil(K/128), M], and K a multiple of 16.
    a_s None: a holds the activations (bf16 / float32), quantized inside the GEMM in every N tile
    (tuned_config's "fuse_quant", for M <= 16).
    cfg["split_k"] > 1 needs part float32 [split_k, M, N] for the partials and counters int32
    [>= tiles], all zero; every launch leaves them zero, so one buffer serves every GEMM on a stream."""
    M, K, N = int(a.shape[0]), int(a.shape[1]), int(b.shape[0])
    if M == 0 or N == 0:
        return
    n_kb = triton.cdiv(K, FP8_BLOCK)
    split = cfg["split_k"]
    per = triton.cdiv(n_kb, split)
    if triton.cdiv(n_kb, per) != split or 128 % cfg["block_n"]:
        raise ValueError(
            f"w8a8 gemm: split_k {split} leaves a split empty for {n_kb} K blocks, or block_n "
            f"{cfg['block_n']} does not divide 128"
        )
    tiles = triton.cdiv(M, cfg["block_m"]) * triton.cdiv(N, cfg["block_n"])
    if split > 1:
        if split * M * N >= 2**31:
            raise ValueError(f"w8a8 gemm: split_k {split} partials of [{M}, {N}] overflow int32 offsets")
        if part is None or list(part.shape) != [split, M, N]:
            raise ValueError(f"w8a8 gemm: split_k {split} needs float32 partials [{split}, {M}, {N}]")
        if counters is None or int(counters.shape[0]) < tiles:
            raise ValueError(f"w8a8 gemm: split_k {split} needs zeroed int32 counters for {tiles} tiles")
    part = out if part is None else part  # pointer arguments a launch without split never reads
    counters = out if counters is None else counters
    if cfg.get("tma"):
        _launch_tma(a, a_s, b, b_s, out, cfg, part, counters, per)
        return
    grid = (triton.cdiv(M, cfg["block_m"]), triton.cdiv(N, cfg["block_n"]), split)
    launch(
        _w8a8_gemm_kernel,
        grid,
        a,
        a if a_s is None else a_s,
        b,
        b_s,
        out,
        part,
        counters,
        M,
        N,
        K,
        stride(a, 0),
        0 if a_s is None else stride(a_s, 0),
        stride(b, 0),
        stride(b_s, 0),
        N,
        per,
        split,
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        DOT_FP8=not interpret_mode(),
        QUANT_A=a_s is None,
        SPLIT=split > 1,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def _e4m3_view(x):
    """uint8 codes as an e4m3 tensor of the same memory (a torch view in the interpreter)."""
    if type(x).__module__.startswith("paddle"):
        if interpret_mode():
            import torch

            return torch.from_dlpack(x).view(torch.float8_e4m3fn)
        return x.view("float8_e4m3fn")  # paddle names the dtype: no paddle import here
    import torch

    return x.view(torch.float8_e4m3fn)


def e4m3_descriptor(x, block_rows: int):
    """uint8 codes [R, K] (columns contiguous, K % 16 == 0) -> a tensor descriptor of them as
    e4m3 in [block_rows, 128] blocks (reads past the edge are zeros)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    R, K = int(x.shape[0]), int(x.shape[1])
    return TensorDescriptor(_e4m3_view(x), [R, K], [stride(x, 0), 1], [block_rows, FP8_BLOCK])


def _launch_tma(a, a_s, b, b_s, out, cfg: dict, part, counters, per: int) -> None:
    M, K, N = int(a.shape[0]), int(a.shape[1]), int(b.shape[0])
    if a_s is None or K % 16 or list(a_s.shape) != [triton.cdiv(K, FP8_BLOCK), M]:
        raise ValueError(
            f"w8a8 gemm (tma): needs codes with K % 16 == 0 and M-major scales [{triton.cdiv(K, FP8_BLOCK)}, {M}]"
        )
    bm, bn, split = cfg["block_m"], cfg["block_n"], cfg["split_k"]
    launch(
        _w8a8_gemm_tma_kernel,
        (triton.cdiv(M, bm) * triton.cdiv(N, bn), split),
        e4m3_descriptor(a, bm),
        e4m3_descriptor(b, bn),
        a_s,
        b_s,
        out,
        part,
        counters,
        M,
        N,
        K,
        stride(a_s, 1),
        stride(a_s, 0),
        stride(b_s, 0),
        per,
        split,
        BLOCK_M=bm,
        BLOCK_N=bn,
        GROUP_M=8,
        DOT_FP8=not interpret_mode(),
        SPLIT=split > 1,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
