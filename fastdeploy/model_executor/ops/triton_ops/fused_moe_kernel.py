"""Fused MoE (docs/design.md §4.8) as Triton kernels, paddle-free: one grouped-GEMM launch over all
experts for gate / up with SiLU-and-mul, one for down with the routing weight applied.

The routed (token, k) entries, N = T x top_k of them, are sorted by expert once
(``expert_sort_kernel.py``), each expert's run padded to BLOCK_M (``sorted_ids``: entry ids, N for
padding; ``block_expert``: the expert of each BLOCK_M block, -1 past the end), so a program
multiplies BLOCK_M rows that share one expert's weights. ``_moe_gemm_kernel`` serves both GEMMs:
- GATED (gate / up): rows are the entries' tokens of x [T, K_dim]; out[entry] =
  silu(x W1^T) * (x W3^T) [N, I];
- not GATED (down): rows are the entries of the intermediate [N, I]; out[entry] =
  weight[entry] * (h W2^T) [N, H], summed over k by the caller.
Weights are bf16 [E, n, k] or, with FP8, e4m3 codes with float32 block scales [E, ceil(n/128),
ceil(k/128)] against activations quantized per row per 128 columns (codes and scales from the
W8A8 GEMM's ``_act_quant_kernel``), both scales applied per 128-wide K block.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import e4m3_descriptor
from fastdeploy.model_executor.ops.triton_ops.launcher import interpret_mode, launch, stride


@triton.jit
def _tile_dot(
    acc,
    a_ptr,
    w_ptr,
    a_s_ptr,
    w_s_ptr,
    r_ok,
    c_ok,
    k0,
    Kdim,
    w_row,
    FP8: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_LOW: tl.constexpr,
    W_TMA: tl.constexpr,
):
    """acc + A[:, k0:k0+BLOCK_K] . W[:, k0:k0+BLOCK_K]^T (FP8: scaled by the row's and the weight
    block's scales); a_ptr / w_ptr point at column 0 of each row. W_TMA: w_ptr is an e4m3
    descriptor of all experts' rows [E * n, K] and the tile starts at its row w_row."""
    kk = k0 + tl.arange(0, BLOCK_K)
    k_ok = kk < Kdim
    a = tl.load(a_ptr[:, None] + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0)
    if FP8:
        a = a.to(tl.float8e4nv, bitcast=True)
        if W_TMA:  # rows past this expert's n belong to the next one: their columns are not stored
            w = w_ptr.load([w_row, k0])
        else:
            w = tl.load(w_ptr[:, None] + kk[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0)
            w = w.to(tl.float8e4nv, bitcast=True)
        if not DOT_LOW:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        part = tl.dot(a, tl.trans(w))
        a_s = tl.load(a_s_ptr + k0 // 128, mask=r_ok, other=0.0)
        w_s = tl.load(w_s_ptr + k0 // 128)
        acc += part * (a_s * w_s)[:, None]
    else:
        w = tl.load(w_ptr[:, None] + kk[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0)
        if DOT_LOW:
            a = a.to(tl.bfloat16)
            w = w.to(tl.bfloat16)
        else:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _moe_gemm_kernel(
    A,
    AS,
    W1,
    W3,
    WS1,
    WS3,
    Out,
    TopW,
    SortedIds,
    BlockExpert,
    N,
    top_k,
    Kdim,
    Ndim,
    sa,
    sas,
    sw_e,
    sw_n,
    sws_e,
    sws_n,
    so,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    FP8: tl.constexpr,
    DOT_LOW: tl.constexpr,
    W_TMA: tl.constexpr = False,
):
    b = tl.program_id(0)
    nt = tl.program_id(1)
    e = tl.load(BlockExpert + b)
    if e < 0:
        return
    rows = tl.load(SortedIds + b * BLOCK_M + tl.arange(0, BLOCK_M))  # routed entries; N = padding
    r_ok = rows < N
    src = tl.where(r_ok, rows // top_k if GATED else rows, 0).to(tl.int64)  # the row of A
    cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < Ndim
    e64 = e.to(tl.int64)
    a_ptr = A + src * sa
    a_s_ptr = AS + src * sas
    if W_TMA:
        w1_ptr, w3_ptr = W1, W3
    else:
        w1_ptr = W1 + e64 * sw_e + cols.to(tl.int64) * sw_n
        w3_ptr = W3 + e64 * sw_e + cols.to(tl.int64) * sw_n
    w_row = e * Ndim + nt * BLOCK_N
    ws_row = e64 * sws_e + (nt * BLOCK_N // 128) * sws_n  # BLOCK_N divides 128 with FP8
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, Kdim, BLOCK_K):
        acc1 = _tile_dot(
            acc1, a_ptr, w1_ptr, a_s_ptr, WS1 + ws_row, r_ok, c_ok, k0, Kdim, w_row, FP8, BLOCK_K, DOT_LOW, W_TMA
        )
        if GATED:
            acc3 = _tile_dot(
                acc3, a_ptr, w3_ptr, a_s_ptr, WS3 + ws_row, r_ok, c_ok, k0, Kdim, w_row, FP8, BLOCK_K, DOT_LOW, W_TMA
            )
    if GATED:
        y = acc1 / (1.0 + tl.exp(-acc1)) * acc3  # silu(gate) * up
    else:
        y = acc1 * tl.load(TopW + rows, mask=r_ok, other=0.0)[:, None]
    dst = Out + rows.to(tl.int64)[:, None] * so + cols[None, :]
    tl.store(dst, y.to(Out.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])


def block_m_for(num_entries: int, num_experts: int) -> int:
    """Rows a program takes: about the mean entries an expert gets, 16 .. 64."""
    mean = num_entries / max(num_experts, 1)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


def aligned_rows(num_entries: int, num_experts: int, block_m: int) -> int:
    """P, the rows of the expert-sorted layout: N + E * (block_m - 1) rounded up to block_m, the
    most any routing needs, so shapes depend on the batch only."""
    return triton.cdiv(num_entries + num_experts * (block_m - 1), block_m) * block_m


def moe_tile_config(
    num_entries: int, num_experts: int, fp8: bool, dims: tuple[int, ...] = (), down: bool = False
) -> dict:
    """launch_moe_gemm's tile arguments (block_m from ``block_m_for``) for the gate / up GEMM, or
    with ``down`` for the down GEMM. With FP8 weights at prefill sizes (block_m 64: >= 32 entries
    an expert) the weights come in through tensor descriptors on 128-wide tiles, 8 warps, 4
    stages: 256 experts top-8 at 4096 tokens took 7.2 ms against 9.7 (H200,
    results/h200_2026-12-04_moe_tma_sweep.json; equal at 64 tokens). The down GEMM (one
    accumulator) runs its 64 x 128 tile as one warpgroup a CTA, 4 warps: 2.35 against 2.48 ms
    there (h200_2026-12-04_moe_parts_1wg.json; gate / up, two accumulators, slowed to 8.3 ms that
    way). dims: the GEMMs' K (hidden and intermediate sizes), which descriptors need as multiples
    of 16."""
    if fp8 and block_m_for(num_entries, num_experts) == 64 and all(d % 16 == 0 for d in dims):
        return {"block_n": 128, "num_warps": 4 if down else 8, "num_stages": 4, "w_tma": True}
    return {}


def launch_moe_gemm(
    a,
    w1,
    out,
    sorted_ids,
    block_expert,
    num_entries: int,
    top_k: int,
    block_m: int,
    *,
    a_s=None,
    ws1=None,
    w3=None,
    ws3=None,
    top_w=None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    w_tma: bool = False,
) -> None:
    """One grouped GEMM (see the module docstring); gated when ``w3`` is given. a [rows, K]: bf16 /
    float32, or uint8 codes with a_s float32 [rows, ceil(K/128)]; w1 / w3 [E, n, K]: bf16, or uint8
    codes with ws1 / ws3 float32 [E, ceil(n/128), ceil(K/128)]; out [N, n]; top_w float32 [N]
    (down only). w_tma (FP8, contiguous weights, K % 16 == 0): the weights come in through tensor
    descriptors (TMA)."""
    fp8 = a_s is not None
    gated = w3 is not None
    Kdim, Ndim = int(a.shape[1]), int(w1.shape[1])
    unused = a  # pointer arguments a variant never reads
    sw_e, sw_n = stride(w1, 0), stride(w1, 1)
    if w_tma:
        if not fp8 or Kdim % 16:
            raise ValueError(f"moe gemm: w_tma needs FP8 weights with K % 16 == 0, got K {Kdim}")
        w1 = _weight_desc(w1, block_n)
        w3 = _weight_desc(w3, block_n) if gated else None
    launch(
        _moe_gemm_kernel,
        (int(block_expert.shape[0]), triton.cdiv(Ndim, block_n)),
        a,
        a_s if fp8 else unused,
        w1,
        w3 if gated else w1,
        ws1 if fp8 else unused,
        (ws3 if gated else ws1) if fp8 else unused,
        out,
        top_w if top_w is not None else unused,
        sorted_ids,
        block_expert,
        num_entries,
        top_k,
        Kdim,
        Ndim,
        stride(a, 0),
        stride(a_s, 0) if fp8 else 0,
        sw_e,
        sw_n,
        stride(ws1, 0) if fp8 else 0,
        stride(ws1, 1) if fp8 else 0,
        stride(out, 0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=128 if fp8 else 64,
        GATED=gated,
        FP8=fp8,
        DOT_LOW=not interpret_mode(),
        W_TMA=w_tma,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def _weight_desc(w, block_n: int):
    """uint8 codes [E, n, K] (contiguous) -> an e4m3 descriptor of [E * n, K] in [block_n, 128]
    blocks."""
    E, n, K = (int(d) for d in w.shape)
    return e4m3_descriptor(w.reshape([E * n, K]), block_n)


@triton.jit
def _moe_sum_kernel(Y, Ids, Out, H, E, sy, so, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """Out[t, cols] (float32) = the sum over k of Y[t * TOP_K + k, cols] for the entries routed to
    this rank's experts (Ids int64 [T * TOP_K] in 0..E-1); other entries' rows, never written by
    the down GEMM, are not read."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in tl.static_range(TOP_K):
        e = tl.load(Ids + t * TOP_K + k)
        width = tl.where((e >= 0) & (e < E), H, 0)  # no column of another rank's entry
        acc += tl.load(Y + (t * TOP_K + k) * sy + cols, mask=cols < width, other=0.0).to(tl.float32)
    tl.store(Out + t * so + cols, acc, mask=cols < H)


def launch_moe_sum(y, ids, num_experts: int, out) -> None:
    """y [T * top_k, H] (the down GEMM's weighted rows, any float dtype), ids int64 [T * top_k]
    -> out float32 [T, H]: each token's rows of this rank's experts summed, in one launch."""
    T, H = int(out.shape[0]), int(out.shape[1])
    top_k = int(ids.shape[0]) // max(T, 1)
    block_h = min(1024, triton.next_power_of_2(H))
    launch(
        _moe_sum_kernel,
        (T, triton.cdiv(H, block_h)),
        y,
        ids,
        out,
        H,
        num_experts,
        stride(y, 0),
        stride(out, 0),
        TOP_K=top_k,
        BLOCK_H=block_h,
        num_warps=4,
    )
