"""H200: the W8A8 block-scaled FP8 GEMM (``fp8_gemm_kernel``) at DeepSeek-V3's linear shapes beside
bf16 ``torch.matmul`` and ``torch._scaled_mm`` with row-wise scales, on the same weights; torch
CUDA tensors (no paddle on the GPU host).

    python benchmarks/bench_fp8_moe.py [--json OUT]

Shapes (N x K): q_b_proj 24576 x 1536, o_proj 7168 x 16384, expert gate_up 4096 x 7168, expert
down 7168 x 2048, dense gate_up 36864 x 7168; M = 1, 16, 64, 512, 4096 tokens. Ours is timed all
in (activation quantization, GEMM, split-K sum); ``_scaled_mm`` gets activations already
quantized (its quantization is not timed) and only row-wise scales, since this torch refuses
block-wise ones; bf16 multiplies the de-quantized weight. FLOPs 2 M N K; bytes: the weight (1 byte
an element for FP8, 2 for bf16) plus activations in and out. At M <= 64 ours and bf16 are also
timed as CUDA-graph replays over enough weight copies to read each from HBM ("graph"): the GPU
time a captured decode step sees, without the host's launch cost. Ours is checked against float32
torch of the same quantized math, bf16 and ``_scaled_mm`` against the float32 product of what
they were given. Ceilings in the same run: bf16 and FP8 (row-wise ``_scaled_mm``) at 8192^3, and
the device copy bandwidth.

Fused MoE (``fused_moe_kernel``): DeepSeek-V3's routed experts, 256 experts of 7168 -> 2048 -> 7168,
top-8 of random scores, T = 1 .. 4096 tokens, bf16 and FP8 block weights (the same weights: bf16 is
the FP8 codes de-quantized). Ours: the sort by expert (``launch_expert_sort``, as
``fused_moe.moe_align``), the activation quantization (FP8), the two grouped-GEMM launches into
bf16 rows, the masked sum over top-8 (``--moe-forms`` times the earlier forms beside it).
Naive: a per-expert torch loop in bf16 (one batched gate / up / down per expert that has tokens,
as the model ran before). Checked against float32 torch of the same (quantized) math on 4 tokens.
FLOPs 2 T 8 3 7168 2048.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from itertools import product

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    bench_ms,
    bf16_tflops,
    cold_replay_ms,  # noqa: E402
    copy_gbps,
    fp8_rowwise_tflops,
    rel_err,
)
from common import replay_ms as _replay_ms  # noqa: E402

from fastdeploy.model_executor.ops.triton_ops import fp8_gemm_kernel  # noqa: E402
from fastdeploy.model_executor.ops.triton_ops.expert_sort_kernel import (  # noqa: E402
    ALIGN_KERNEL_MAX,
    align_scratch_size,
    launch_expert_sort,
    launch_moe_align,
    launch_moe_align_chunks,
)
from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import launch_act_quant  # noqa: E402
from fastdeploy.model_executor.ops.triton_ops.fused_moe_kernel import (  # noqa: E402
    aligned_rows,
    block_m_for,
    launch_moe_gemm,
    launch_moe_sum,
    moe_tile_config,
)

DEV = "cuda"
sweep_only = False
SHAPES = {
    "q_b_proj": (24576, 1536),
    "o_proj": (7168, 16384),
    "expert_gate_up": (4096, 7168),
    "expert_down": (7168, 2048),
    "dense_gate_up": (36864, 7168),
}
MS = (1, 16, 64, 512, 4096)


REP_MS = 150  # do_bench's measuring time a timing; the small sweep shortens it


def bench(fn) -> float:
    return bench_ms(fn, rep=REP_MS)


def replay_ms(fn, n: int = 20) -> float:
    """ms a call of fn as one CUDA graph of n calls (no host launch cost)."""
    return _replay_ms(fn, n, bench)


def graph_ms(fn, weight: torch.Tensor) -> float:
    """ms a call of fn(weight copy) as one CUDA graph over copies that each read from HBM."""
    return cold_replay_ms(fn, weight, bench)


def ceilings() -> dict:
    return {"bf16_tflops": bf16_tflops(), "fp8_rowwise_tflops": fp8_rowwise_tflops(), "copy_gbps": copy_gbps()}


def quantize_ref(x: torch.Tensor) -> torch.Tensor:
    """float32 x quantized per token per 128 columns and de-quantized (the kernels' math)."""
    M, K = x.shape
    xb = x.float().view(M, K // 128, 128)
    s = xb.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    return ((xb / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).view(M, K)


def load_before(path: str):
    """An earlier ``fp8_gemm_kernel.py`` as a module (its imports resolve in this checkout)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fp8_gemm_kernel_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gemm_fn(mod, x: torch.Tensor, N: int, ws: torch.Tensor, cfg: dict | None = None):
    """fn(weight codes) -> out, running module ``mod``'s GEMM as ``fp8_gemm.w8a8_block_linear``
    does, with its own tuned config; buffers allocated once. cfg["fuse_quant"]: the activations
    go in unquantized (quantized inside the GEMM). Handles the API before split K was summed in
    the GEMM (partials summed by torch)."""
    M, K = x.shape
    cfg = cfg or mod.tuned_config(M, N, K)
    a = torch.empty(M, K, device=DEV, dtype=torch.uint8)
    tma = bool(cfg.get("tma"))  # M-major activation scales
    a_s = torch.empty(K // 128, M, device=DEV) if tma else torch.empty(M, K // 128, device=DEV)
    out = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
    sk = cfg["split_k"]
    part = torch.empty(sk, M, N, device=DEV) if sk > 1 else None
    new_api = hasattr(mod, "SPLIT_COUNTERS")  # split K summed in the GEMM launch
    counters = torch.zeros(getattr(mod, "SPLIT_COUNTERS", 1), device=DEV, dtype=torch.int32)

    def fn(wi: torch.Tensor) -> torch.Tensor:
        if cfg.get("fuse_quant"):
            a_in, a_s_in = x, None
        else:
            if tma:
                mod.launch_act_quant(x, a, a_s, m_major=True)
            else:
                mod.launch_act_quant(x, a, a_s)
            a_in, a_s_in = a, a_s
        if new_api:
            mod.launch_w8a8_gemm(a_in, a_s_in, wi, ws, out, cfg, part, counters)
            return out
        if part is None:
            mod.launch_w8a8_gemm(a_in, a_s_in, wi, ws, out, cfg)
            return out
        mod.launch_w8a8_gemm(a_in, a_s_in, wi, ws, part, cfg)
        return part.sum(0).to(torch.bfloat16)

    fn.cfg = cfg
    return fn


def deepgemm_fn(x: torch.Tensor, N: int, ws: torch.Tensor):
    """fn(weight codes) -> out through DeepGEMM's ``fp8_gemm_nt`` on the same codes and scales, the
    activations quantized by our kernel beforehand (not timed) and their scales given in the
    M-major TMA-aligned layout it reads; None where deep_gemm does not import."""
    try:
        import deep_gemm
    except ImportError:
        return None
    M, K = x.shape
    a = torch.empty(M, K, device=DEV, dtype=torch.uint8)
    a_s = torch.empty(M, K // 128, device=DEV)
    launch_act_quant(x, a, a_s)
    sfa = deep_gemm.get_mn_major_tma_aligned_tensor(a_s)
    a8 = a.view(torch.float8_e4m3fn)
    out = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)

    def fn(wi: torch.Tensor) -> torch.Tensor:
        deep_gemm.fp8_gemm_nt((a8, sfa), (wi.view(torch.float8_e4m3fn), ws), out)
        return out

    return fn


def case(
    name: str, N: int, K: int, M: int, g: torch.Generator, cfg: dict | None = None, before=None, small_sweep=False
) -> dict:
    x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
    w = torch.randn(N, K, device=DEV, generator=g) * 0.02
    ws = w.view(N // 128, 128, K // 128, 128).abs().amax((1, 3)) / 448  # block scales
    codes = (w / ws.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
    w_deq = codes.float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)
    codes_u8 = codes.view(torch.uint8)
    w_bf16 = w_deq.to(torch.bfloat16)

    ours = gemm_fn(fp8_gemm_kernel, x, N, ws, cfg)
    want = quantize_ref(x) @ w_deq.T
    row = {"shape": name, "N": N, "K": K, "M": M, "config": ours.cfg, "rel_err": rel_err(ours(codes_u8), want)}
    row["correct"] = row["rel_err"] < 1e-2
    if ours.cfg["split_k"] > 1 and not small_sweep:  # the in-launch split-K sum, 100 times over
        first = ours(codes_u8).clone()
        x2 = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
        other = gemm_fn(fp8_gemm_kernel, x2, N, ws, ours.cfg)
        first2 = other(codes_u8).clone()
        same = True
        for _ in range(100):  # interleaved with another GEMM: the counters must reset every launch
            same &= bool(torch.equal(ours(codes_u8), first)) and bool(torch.equal(other(codes_u8), first2))
        row["split_repeat_bitwise_identical"] = same
        row["correct"] &= same and rel_err(first2, quantize_ref(x2) @ w_deq.T) < 1e-2
    flops = 2 * M * N * K
    if small_sweep:  # graph replays only
        row["ours_graph_ms"] = graph_ms(ours, codes_u8)
        return row
    row["ours_ms"] = bench(lambda: ours(codes_u8))
    if sweep_only:
        row["ours_tflops"] = flops / row["ours_ms"] / 1e9
        return row
    row["bf16_ms"] = bench(lambda: x @ w_bf16.T)
    row["bf16_rel_err"] = rel_err(x @ w_bf16.T, x.float() @ w_bf16.float().T)

    # _scaled_mm, row-wise: activations per token, weights per output row (not DeepSeek's blocks)
    x_s = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
    x8 = (x.float() / x_s).to(torch.float8_e4m3fn)
    w_s = w_deq.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
    w8 = (w_deq / w_s).to(torch.float8_e4m3fn)
    w8t, w_st = w8.t(), w_s.t().contiguous()
    try:
        got = torch._scaled_mm(x8, w8t, x_s, w_st, out_dtype=torch.bfloat16)
        row["scaled_mm_rel_err"] = rel_err(got, (x8.float() * x_s) @ (w8.float() * w_s).T)
        row["scaled_mm_ms"] = bench(lambda: torch._scaled_mm(x8, w8t, x_s, w_st, out_dtype=torch.bfloat16))
    except Exception as e:  # noqa: BLE001 - reported, the rest still runs
        row["scaled_mm_error"] = repr(e)[:200]
    dg = deepgemm_fn(x, N, ws)
    if dg is not None:
        row["deepgemm_rel_err"] = rel_err(dg(codes_u8), want)
        row["deepgemm_ms"] = bench(lambda: dg(codes_u8))
    for k in ("ours", "bf16", "scaled_mm", "deepgemm"):
        if f"{k}_ms" in row:
            row[f"{k}_tflops"] = flops / row[f"{k}_ms"] / 1e9
    row["ours_gbps"] = (N * K + M * K * 2 + M * N * 2) / row["ours_ms"] / 1e6
    if before is not None and M > 64:  # eager, as ours above
        prev = gemm_fn(before, x, N, ws)
        row["before_config"] = prev.cfg
        row["before_rel_err"] = rel_err(prev(codes_u8), want)
        row["before_ms"] = bench(lambda: prev(codes_u8))
        row["before_tflops"] = flops / row["before_ms"] / 1e9
    if M > 64:  # GPU time without the eager launch cost, which bounds the M 512 rows
        for k, fn in (("ours", ours), ("deepgemm", dg), ("before", prev if before is not None else None)):
            if fn is not None:
                row[f"{k}_graph_ms"] = graph_ms(fn, codes_u8)
                row[f"{k}_graph_tflops"] = flops / row[f"{k}_graph_ms"] / 1e9
        row["bf16_graph_ms"] = graph_ms(lambda wi: x @ wi.T, w_bf16)
    row["bf16_gbps"] = (N * K * 2 + M * K * 2 + M * N * 2) / row["bf16_ms"] / 1e6
    if M <= 64:
        row["ours_graph_ms"] = graph_ms(ours, codes_u8)
        row["bf16_graph_ms"] = graph_ms(lambda wi: x @ wi.T, w_bf16)
        row["graph_speedup"] = row["bf16_graph_ms"] / row["ours_graph_ms"]
        row["ours_graph_gbps"] = (N * K + M * K * 2 + M * N * 2) / row["ours_graph_ms"] / 1e6
        if dg is not None:
            row["deepgemm_graph_ms"] = graph_ms(dg, codes_u8)
        for form, fuse in (("q1", True), ("q2", False)):  # quantized inside the GEMM / by its own launch
            if fuse and ours.cfg.get("tma"):  # the TMA kernel takes quantized activations only
                continue
            fn = gemm_fn(fp8_gemm_kernel, x, N, ws, {**ours.cfg, "fuse_quant": fuse})
            got = fn(codes_u8).clone()
            row[f"{form}_bitwise_equal_ours"] = bool(torch.equal(got, ours(codes_u8)))
            row[f"{form}_graph_ms"] = graph_ms(fn, codes_u8)
        cap = gemm_fn(fp8_gemm_kernel, x, N, ws, fp8_gemm_kernel.tuned_config(M, N, K, captured=True))
        row["captured_config"], row["captured_rel_err"] = cap.cfg, rel_err(cap(codes_u8), want)
        row["correct"] &= row["captured_rel_err"] < 1e-2
        row["captured_graph_ms"] = graph_ms(cap, codes_u8)  # the config a captured step asks for
        if before is not None:
            prev = gemm_fn(before, x, N, ws)
            row["before_config"] = prev.cfg
            row["before_rel_err"] = rel_err(prev(codes_u8), want)
            row["before_ms"] = bench(lambda: prev(codes_u8))
            row["before_graph_ms"] = graph_ms(prev, codes_u8)
            if hasattr(before, "tuned_config"):  # the earlier tree's captured config
                try:
                    pc = gemm_fn(before, x, N, ws, before.tuned_config(M, N, K, captured=True))
                    row["before_captured_graph_ms"] = graph_ms(pc, codes_u8)
                except TypeError:  # a tree before the captured configs
                    pass
    return row


def moe_align_torch(ids: torch.Tensor, E: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_moe.moe_align`` in torch ops (the GPU host has no paddle)."""
    flat = ids.flatten().long()
    N = flat.numel()
    counts = torch.zeros(E, device=DEV, dtype=torch.long).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    skey = flat[order]
    dest = (ends - padded)[skey] + torch.arange(N, device=DEV) - (counts.cumsum(0) - counts)[skey]
    P = aligned_rows(N, E, bm)
    sorted_ids = torch.full((P,), N, device=DEV, dtype=torch.long)
    sorted_ids[dest] = order
    blocks = torch.arange(P // bm, device=DEV)
    expert = torch.searchsorted(ends // bm, blocks, right=True)
    return sorted_ids.int(), torch.where(expert < E, expert, -1).int()


def moe_weights(g: torch.Generator, E: int = 256, H: int = 7168, inter: int = 2048) -> dict:
    """FP8 codes and block scales for w1, w3 [E, I, H] and w2 [E, H, I], and the same weights
    de-quantized to bf16."""
    out = {}
    for name, (n, k) in (("w1", (inter, H)), ("w3", (inter, H)), ("w2", (H, inter))):
        codes = torch.randint(0, 255, (E, n, k), device=DEV, dtype=torch.uint8, generator=g)
        codes[(codes & 0x7F) == 0x7F] = 0x30  # no NaN codes
        scales = torch.rand(E, n // 128, k // 128, device=DEV, generator=g) * 2e-3 + 1e-3
        deq = torch.empty(E, n, k, device=DEV, dtype=torch.bfloat16)
        for e in range(E):
            s = scales[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
            deq[e] = (codes[e].view(torch.float8_e4m3fn).float() * s).to(torch.bfloat16)
        out[name], out[name + "_s"], out[name + "_bf16"] = codes, scales, deq
    return out


def moe_parts(T: int, w: dict, g: torch.Generator) -> dict:
    """ms of each launch of the FP8 fused MoE (tuned tiles) at T tokens, top-8, and their sum."""
    E, inter, H = w["w1"].shape
    K = 8
    N = T * K
    x = torch.randn(T, H, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.randn(T, E, device=DEV, generator=g).topk(K, dim=1).indices
    top_w = torch.rand(N, device=DEV, generator=g)
    cfg = moe_tile_config(N, E, True, (H, inter))
    cfg_down = moe_tile_config(N, E, True, (H, inter), down=True)
    bm = block_m_for(N, E)
    mid = torch.zeros(N, inter, device=DEV, dtype=torch.bfloat16)
    y = torch.zeros(N, H, device=DEV)
    xc, xs = torch.empty(T, H, device=DEV, dtype=torch.uint8), torch.empty(T, H // 128, device=DEV)
    ic, ics = torch.empty(N, inter, device=DEV, dtype=torch.uint8), torch.empty(N, inter // 128, device=DEV)
    sorted_ids, block_expert = moe_align_torch(ids, E, bm)
    gu = dict(a_s=xs, ws1=w["w1_s"], w3=w["w3"], ws3=w["w3_s"], **cfg)
    parts = {
        "align": lambda: launch_expert_sort(flat_ids, E, bm, si_buf, be_buf, scratch),
        "quant_x": lambda: launch_act_quant(x, xc, xs),
        "gate_up": lambda: launch_moe_gemm(xc, w["w1"], mid, sorted_ids, block_expert, N, K, bm, **gu),
        "quant_mid": lambda: launch_act_quant(mid, ic, ics),
        "down": lambda: launch_moe_gemm(
            ic, w["w2"], y, sorted_ids, block_expert, N, K, bm, a_s=ics, ws1=w["w2_s"], top_w=top_w, **cfg_down
        ),
        "zero_y": y.zero_,
        "sum_topk": lambda: y.view(T, K, H).sum(1),
    }
    alt = {  # the down output's other forms (not in sum_ms): bf16 rows, one masked sum launch
        "zero_mid": mid.zero_,
        "align_torch_ops": lambda: moe_align_torch(ids, E, bm),
        "down_bf16": lambda: launch_moe_gemm(
            ic, w["w2"], y16, sorted_ids, block_expert, N, K, bm, a_s=ics, ws1=w["w2_s"], top_w=top_w, **cfg_down
        ),
        "moe_sum_f32": lambda: launch_moe_sum(y, flat_ids, E, summed),
        "moe_sum_bf16": lambda: launch_moe_sum(y16, flat_ids, E, summed),
    }

    if cfg_down != cfg:  # the down GEMM on the gate / up tiles (the form before)
        alt["down_bf16_gate_up_tiles"] = lambda: launch_moe_gemm(
            ic, w["w2"], y16, sorted_ids, block_expert, N, K, bm, a_s=ics, ws1=w["w2_s"], top_w=top_w, **cfg
        )
    y16, summed = torch.zeros(N, H, device=DEV, dtype=torch.bfloat16), torch.empty(T, H, device=DEV)
    flat_ids = ids.flatten()
    si_buf, be_buf = torch.empty_like(sorted_ids), torch.empty_like(block_expert)
    scratch = torch.empty(align_scratch_size(E, N), device=DEV, dtype=torch.int32)
    out = {"T": T, "config": cfg, "down_config": cfg_down, "block_m": bm, "padded_rows": int((sorted_ids < N).numel())}
    for name, fn in parts.items():
        fn()
        out[f"{name}_ms"] = bench(fn)
    out["sum_ms"] = sum(v for k, v in out.items() if k.endswith("_ms"))
    for name, fn in alt.items():
        fn()
        out[f"alt_{name}_ms"] = bench(fn)
    for name, flops in (("gate_up", 2 * N * 2 * inter * H), ("down", 2 * N * H * inter)):
        out[f"{name}_tflops"] = flops / out[f"{name}_ms"] / 1e9
    out.update(deepgemm_moe_gemms(x, ids, w))
    return out


def deepgemm_moe_gemms(x: torch.Tensor, ids: torch.Tensor, w: dict) -> dict:
    """DeepGEMM's two grouped GEMMs (``m_grouped_fp8_gemm_nt_contiguous``) on the same routing and
    weights, in its contiguous layout (each expert's rows padded to its M alignment, -1 rows
    between): gate and up as one [E, 2 I, H] weight, then down. Only the GEMMs are timed (not the
    gather, SiLU or quantizations); checked against float32 of the same quantized math on the
    first 4 experts' rows. {} where deep_gemm does not import."""
    try:
        import deep_gemm
    except ImportError:
        return {}
    E, inter, H = w["w1"].shape
    T, K = ids.shape
    flat = ids.flatten().long()
    align = deep_gemm.get_mk_alignment_for_contiguous_layout()
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + align - 1) // align * align
    starts = padded.cumsum(0) - padded
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    dest = starts[e_sorted] + torch.arange(flat.numel(), device=DEV) - (counts.cumsum(0) - counts)[e_sorted]
    m = int(padded.sum())
    layout = torch.full((m,), -1, device=DEV, dtype=torch.int32)
    layout[dest] = e_sorted.int()
    rows = torch.zeros(m, H, device=DEV, dtype=torch.bfloat16)
    rows[dest] = x[order // K]
    mid = torch.zeros(m, inter, device=DEV, dtype=torch.bfloat16)
    mid[dest] = torch.randn(flat.numel(), inter, device=DEV).to(torch.bfloat16)

    def quant(a: torch.Tensor):
        codes, sc = (
            torch.empty(a.shape, device=DEV, dtype=torch.uint8),
            torch.empty(a.shape[0], a.shape[1] // 128, device=DEV),
        )
        launch_act_quant(a, codes, sc)
        return codes.view(torch.float8_e4m3fn), deep_gemm.get_mn_major_tma_aligned_tensor(sc), sc

    a8, sfa, sa = quant(rows)
    i8, sfi, si = quant(mid)
    w13 = torch.cat([w["w1"], w["w3"]], 1).view(torch.float8_e4m3fn)
    s13 = torch.cat([w["w1_s"], w["w3_s"]], 1).contiguous()
    w2 = w["w2"].view(torch.float8_e4m3fn)
    d1 = torch.empty(m, 2 * inter, device=DEV, dtype=torch.bfloat16)
    d2 = torch.empty(m, H, device=DEV, dtype=torch.bfloat16)
    gate_up = lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a8, sfa), (w13, s13), d1, layout)  # noqa: E731
    down = lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous((i8, sfi), (w2, w["w2_s"]), d2, layout)  # noqa: E731
    gate_up(), down()
    errs = []
    for e in range(4):  # float32 of the same quantized math
        r = (layout == e).nonzero().flatten()
        for a, s_, wc, ws, d in ((a8, sa, w13, s13, d1), (i8, si, w2, w["w2_s"], d2)):
            deq_a = a[r].float() * s_[r].repeat_interleave(128, 1)
            deq_w = wc[e].float() * ws[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
            want = deq_a @ deq_w.T
            errs.append(rel_err(d[r], want))
    N = flat.numel()
    out = {"deepgemm_padded_rows": m, "deepgemm_alignment": align, "deepgemm_rel_err": max(errs)}
    out["deepgemm_gate_up_ms"] = replay_ms(gate_up)
    out["deepgemm_down_ms"] = replay_ms(down)
    out["deepgemm_gate_up_tflops"] = 2 * N * 2 * inter * H / out["deepgemm_gate_up_ms"] / 1e9
    out["deepgemm_down_tflops"] = 2 * N * H * inter / out["deepgemm_down_ms"] / 1e9
    return out


MOE_FORMS = ("zero_sum", "f32_sum_kernel", "bf16_sum_kernel")  # the down output's form; the first: before


def moe_case(
    T: int,
    fp8: bool,
    w: dict,
    g: torch.Generator,
    ceil: float,
    cfg: dict | None = None,
    form: str = "bf16_sum_kernel",
    graph: bool = False,
) -> dict:
    """form: ``zero_sum``, the form before: the expert sort in one program up to 1024 entries and
    in torch ops (the paddle-ops form) above, float32 down rows and the intermediate zeroed every
    call, torch's sum over k; ``f32_sum_kernel`` / ``bf16_sum_kernel``: the model's sort
    (``launch_expert_sort``), rows in float32 / bf16 (the model's: x's dtype), never zeroed, summed
    by ``_moe_sum_kernel``.
    graph: time a CUDA-graph replay at every T (else at T <= 64) and skip the naive loop."""
    E, inter, H = w["w1"].shape
    K = 8
    x = torch.randn(T, H, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.randn(T, E, device=DEV, generator=g).topk(K, dim=1).indices
    wts = torch.rand(T, K, device=DEV, generator=g)
    N = T * K
    if cfg is None:  # the model's tiles
        cfg, cfg_down = moe_tile_config(N, E, fp8, (H, inter)), moe_tile_config(N, E, fp8, (H, inter), down=True)
    else:  # a sweep's: the same for both GEMMs unless cfg["down"] overrides
        cfg = dict(cfg)
        cfg_down = {**cfg, **cfg.pop("down", {})}
    bm = cfg.pop("block_m", None) or block_m_for(N, E)
    cfg_down.pop("block_m", None)
    inter_buf = torch.zeros(N, inter, device=DEV, dtype=torch.bfloat16)
    y = torch.zeros(N, H, device=DEV, dtype=torch.bfloat16 if form == "bf16_sum_kernel" else torch.float32)
    out = torch.empty(T, H, device=DEV)
    xc, xs = torch.empty(T, H, device=DEV, dtype=torch.uint8), torch.empty(T, H // 128, device=DEV)
    ic, ics = torch.empty(N, inter, device=DEV, dtype=torch.uint8), torch.empty(N, inter // 128, device=DEV)
    top_w = wts.flatten().contiguous()
    flat_ids = ids.flatten().contiguous()
    P = aligned_rows(N, E, bm)
    si_buf, be_buf = torch.empty(P, device=DEV, dtype=torch.int32), torch.empty(P // bm, device=DEV, dtype=torch.int32)
    scratch = torch.empty(align_scratch_size(E, N), device=DEV, dtype=torch.int32)

    def ours():
        if form == "zero_sum" and N > 1024:  # the sort before: paddle ops (here torch) above 1024 entries
            sorted_ids, block_expert = moe_align_torch(ids, E, bm)
        elif form == "zero_sum":  # and one program up to them
            sorted_ids, block_expert = si_buf, be_buf
            launch_moe_align(flat_ids, E, bm, sorted_ids, block_expert)
        else:
            sorted_ids, block_expert = si_buf, be_buf
            launch_expert_sort(flat_ids, E, bm, sorted_ids, block_expert, scratch)
        if form == "zero_sum":
            y.zero_()
            inter_buf.zero_()
        if fp8:
            launch_act_quant(x, xc, xs)
            launch_moe_gemm(
                xc,
                w["w1"],
                inter_buf,
                sorted_ids,
                block_expert,
                N,
                K,
                bm,
                a_s=xs,
                ws1=w["w1_s"],
                w3=w["w3"],
                ws3=w["w3_s"],
                **cfg,
            )
            launch_act_quant(inter_buf, ic, ics)
            launch_moe_gemm(
                ic, w["w2"], y, sorted_ids, block_expert, N, K, bm, a_s=ics, ws1=w["w2_s"], top_w=top_w, **cfg_down
            )
        else:
            launch_moe_gemm(x, w["w1_bf16"], inter_buf, sorted_ids, block_expert, N, K, bm, w3=w["w3_bf16"], **cfg)
            launch_moe_gemm(inter_buf, w["w2_bf16"], y, sorted_ids, block_expert, N, K, bm, top_w=top_w, **cfg)
        if form == "zero_sum":
            return y.view(T, K, H).sum(1)
        launch_moe_sum(y, flat_ids, E, out)
        return out

    def naive():
        out = torch.zeros(T, H, device=DEV)
        flat = ids.flatten()
        for e in flat.unique().tolist():  # a host sync, then one batched MLP per expert with tokens
            hit = (flat == e).nonzero().flatten()
            tok = hit // K
            xe = x[tok]
            h = torch.nn.functional.silu(xe @ w["w1_bf16"][e].T) * (xe @ w["w3_bf16"][e].T)
            out.index_add_(0, tok, (h @ w["w2_bf16"][e].T).float() * wts.flatten()[hit, None])
        return out

    got = ours().clone()

    def weight(name: str, e: int) -> torch.Tensor:  # float32, exactly what the kernel multiplies by
        if not fp8:
            return w[name + "_bf16"][e].float()
        s = w[name + "_s"][e].repeat_interleave(128, 0).repeat_interleave(128, 1)
        return w[name][e].view(torch.float8_e4m3fn).float() * s

    errs = []
    for t in range(min(T, 4)):  # float32 reference of the same math
        xt = quantize_ref(x[t : t + 1]) if fp8 else x[t : t + 1].float()
        want = torch.zeros(H, device=DEV)
        for k in range(K):
            e = ids[t, k].item()
            h = torch.nn.functional.silu(xt @ weight("w1", e).T) * (xt @ weight("w3", e).T)
            h = h.to(torch.bfloat16).float()  # the kernel keeps the intermediate in bf16
            h = quantize_ref(h) if fp8 else h
            want += wts[t, k] * (h @ weight("w2", e).T)[0]
        errs.append(rel_err(got[t], want))
    flops = 2 * T * K * 3 * H * inter
    row = {"T": T, "fp8": fp8, "form": form, "block_m": bm, "config": cfg, "down_config": cfg_down}
    row.update(rel_err=max(errs), flops=flops)
    row["ours_ms"] = bench(ours)
    if sweep_only:
        row["ours_tflops"] = flops / row["ours_ms"] / 1e9
        return row
    if T <= 64 or graph:  # decode sizes: also the GPU time of a CUDA-graph replay (no host launch cost)
        ours()
        torch.cuda.synchronize()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            ours()
        row["ours_graph_ms"] = bench(cg.replay)
        del cg
    if graph:
        row["ours_tflops"] = flops / row["ours_graph_ms"] / 1e9
        return row
    row["naive_ms"] = bench(naive)
    row["ours_tflops"] = flops / row["ours_ms"] / 1e9
    row["ceiling_frac"] = row["ours_tflops"] / ceil
    row["speedup_vs_naive"] = row["naive_ms"] / row["ours_ms"]
    row["correct"] = row["rel_err"] < 1e-2
    return row


def save(res: dict, path: str | None) -> None:
    """The results so far (a run cut short keeps its finished rows)."""
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


def main() -> None:
    global sweep_only
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true", help="tile configs instead (kernel rows only)")
    ap.add_argument("--moe-parts", action="store_true", help="the FP8 fused MoE's launches timed one by one")
    ap.add_argument("--moe-sweep", action="store_true", help="fused MoE tile configs (kernel rows only)")
    ap.add_argument("--moe-forms", action="store_true", help="the FP8 fused MoE with each down-output form")
    ap.add_argument("--small-sweep", action="store_true", help="M <= 64 tile / split configs, graph replays")
    ap.add_argument("--tma-small-sweep", action="store_true", help="the same over the TMA kernel's configs")
    ap.add_argument("--gemm-only", action="store_true", help="skip the fused MoE rows")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="the GEMM rows' M values, comma-separated")
    ap.add_argument("--before", help="an earlier fp8_gemm_kernel.py, timed beside ours at M <= 64")
    ap.add_argument("--compare", help="an earlier --json result: each row's ratio to it, > 5%% slower flagged")
    ap.add_argument("--against", help="with --compare: this result instead of a new run (no GPU needed)")
    args = ap.parse_args()
    if args.compare and args.against:
        with open(args.compare) as f, open(args.against) as g2:
            sys.exit(compare(json.load(f), json.load(g2)))
    g = torch.Generator(device=DEV).manual_seed(0)
    if args.moe_forms:  # the down output's forms, before and after, one run; graph replays
        w, rows = moe_weights(g), []
        for T in (1, 16, 64, 512, 4096):
            for form in MOE_FORMS:
                row = moe_case(T, True, w, g, 1.0, form=form, graph=True)
                rows.append(row)
                print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "moe_forms": rows}, f, indent=1)
        return
    if args.moe_parts:  # where the FP8 fused MoE's time goes, launch by launch
        w = moe_weights(g)
        before = load_before(args.before) if args.before else None
        res = {"device": torch.cuda.get_device_name(), "moe_parts": [], "act_quant": []}
        for T in (64, 4096):
            res["moe_parts"].append(moe_parts(T, w, g))
            print(T, json.dumps(res["moe_parts"][-1]), flush=True)
        res["align"] = []
        for T in (1, 8, 16, 32, 64, 128, 256, 512, 4096):  # the expert sort's forms against torch ops
            ids = torch.randn(T, 256, device=DEV, generator=g).topk(8, dim=1).indices
            bm = block_m_for(T * 8, 256)
            P = aligned_rows(T * 8, 256, bm)
            si, be = torch.empty(P, device=DEV, dtype=torch.int32), torch.empty(P // bm, device=DEV, dtype=torch.int32)
            row = {"T": T, "N": T * 8}
            row["torch_ops_us"] = replay_ms(lambda i=ids, m=bm: moe_align_torch(i, 256, m)) * 1e3
            sc = torch.empty(align_scratch_size(256, T * 8), device=DEV, dtype=torch.int32)
            flat = ids.flatten()
            want = moe_align_torch(ids, 256, bm)
            forms = {"model": lambda i=flat, s_=si, b_=be, m=bm, c=sc: launch_expert_sort(i, 256, m, s_, b_, c)}
            forms["chunks"] = lambda i=flat, s_=si, b_=be, m=bm, c=sc: launch_moe_align_chunks(i, 256, m, s_, b_, c)
            if T * 8 <= 1024:  # one program (the model's form up to 1024 entries before)
                forms["one_program"] = lambda i=flat, s_=si, b_=be, m=bm: launch_moe_align(i, 256, m, s_, b_)
            row["model_launches"] = 1 if T * 8 <= ALIGN_KERNEL_MAX else 4
            for name, fn in forms.items():
                si.fill_(-7)
                be.fill_(-7)
                row[f"{name}_us"] = replay_ms(fn) * 1e3
                row[f"{name}_equal"] = bool(torch.equal(si, want[0]) and torch.equal(be, want[1]))
            res["align"].append(row)
            print(json.dumps(row), flush=True)
        for M in (1, 64, 512, 4096, 32768):  # graph replays of 20 launches (GPU time)
            for K in (7168, 2048):
                x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
                codes, sc = torch.empty(M, K, device=DEV, dtype=torch.uint8), torch.empty(M, K // 128, device=DEV)
                row = {"M": M, "K": K}
                for name, mod in (("ours", fp8_gemm_kernel), ("before", before)):
                    if mod is not None:
                        row[f"{name}_us"] = replay_ms(lambda m=mod: m.launch_act_quant(x, codes, sc)) * 1e3  # noqa: B023 - run at once
                        row[f"{name}_codes"] = codes.clone()
                if before is not None:
                    row["bitwise_equal_before"] = bool(torch.equal(row["ours_codes"], row["before_codes"]))
                row.pop("ours_codes", None), row.pop("before_codes", None)
                res["act_quant"].append(row)
                print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    if args.moe_sweep:
        sweep_only = True
        w, rows = moe_weights(g), []
        for T in (64, 4096):  # FP8; w_tma: the weights through tensor descriptors
            for fp8 in (True,):
                for bm, bn, nw, ns, tma in (
                    (None, 64, 4, 3, False),
                    (None, 128, 8, 3, False),
                    (64, 128, 4, 4, False),
                    (None, 64, 4, 3, True),
                    (None, 64, 4, 4, True),
                    (None, 128, 8, 3, True),
                    (None, 128, 8, 4, True),
                    (64, 128, 4, 4, True),
                    (128, 128, 8, 3, True),
                    (128, 128, 8, 4, True),
                    (128, 64, 4, 4, True),
                    (128, 64, 8, 4, True),  # 128-row tiles, the gated pair as 128 x 128 on 8 warps
                    (128, 64, 8, 3, True),
                ):
                    if bm and T < 512:
                        continue
                    cfg = {"block_m": bm, "block_n": bn, "num_warps": nw, "num_stages": ns, "w_tma": tma}
                    try:
                        rows.append(moe_case(T, fp8, w, g, 1.0, cfg))
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                        rows.append({"T": T, "fp8": fp8, "config": cfg, "error": repr(e)[:150]})
                    r = rows[-1]
                    print(T, fp8, cfg, f"{r.get('ours_ms', float('nan')):.3f} ms", f"err {r.get('rel_err', 0):.1e}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    if args.sweep:
        sweep_only = True
        rows = []
        big = [(bm, bn, w, st) for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for st in (3, 4, 5)]
        for name, M in (("dense_gate_up", 4096), ("o_proj", 512)):
            N, K = SHAPES[name]
            for bm, bn, w, st in big:
                cfg = {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st, "split_k": 1}
                try:
                    rows.append(case(name, N, K, M, g, cfg))
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                    rows.append({"shape": name, "M": M, "config": cfg, "error": repr(e)[:150]})
                print(json.dumps(rows[-1]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        for r in rows:
            c = r["config"]
            print(
                r["shape"],
                r["M"],
                c["block_m"],
                c["block_n"],
                c["num_warps"],
                c["num_stages"],
                c["split_k"],
                f"{r.get('ours_ms', float('nan')):.4f}",
                f"{r.get('ours_tflops', float('nan')):.0f}",
            )
        return
    if args.small_sweep or args.tma_small_sweep:
        global REP_MS
        REP_MS = 50
        small_sweep(g, args.json, tma=args.tma_small_sweep)
        return
    before = load_before(args.before) if args.before else None
    res = {"device": torch.cuda.get_device_name(), **ceilings(), "gemm": []}
    for name, (N, K) in SHAPES.items():
        for M in map(int, args.ms.split(",")):
            res["gemm"].append(case(name, N, K, M, g, before=before))
            print(json.dumps(res["gemm"][-1]), flush=True)
            save(res, args.json)
    res["moe"] = []
    w = moe_weights(g) if not args.gemm_only else None
    for fp8 in (False, True) if w is not None else ():
        ceil = res["fp8_rowwise_tflops"] if fp8 else res["bf16_tflops"]
        for T in (1, 16, 64, 512, 4096):
            res["moe"].append(moe_case(T, fp8, w, g, ceil))
            print(json.dumps(res["moe"][-1]), flush=True)
            save(res, args.json)
    print(
        f"ceilings: bf16 {res['bf16_tflops']:.0f} TFLOP/s, FP8 row-wise {res['fp8_rowwise_tflops']:.0f} TFLOP/s, "
        f"copy {res['copy_gbps']:.0f} GB/s"
    )
    head = ("shape", "M", "ok", "ours ms", "TFLOP/s", "GB/s", "bf16 ms", "scaled_mm", "deepgemm", "DG TF/s")
    head += ("vs bf16", "vs s_mm", "vs DG", "graph x", "before ms", "vs before")
    print(" ".join(f"{h:>14}" if i == 0 else f"{h:>9}" for i, h in enumerate(head)))
    nan = float("nan")
    for r in res["gemm"]:
        sm, dg = r.get("scaled_mm_ms", nan), r.get("deepgemm_ms", nan)
        vals = (r["ours_ms"], r["ours_tflops"], r["ours_gbps"], r["bf16_ms"], sm, dg, r.get("deepgemm_tflops", nan))
        vals += (r["bf16_ms"] / r["ours_ms"], sm / r["ours_ms"], dg / r["ours_ms"], r.get("graph_speedup", nan))
        vals += (r.get("before_ms", nan), r.get("before_ms", nan) / r["ours_ms"])
        lead = f"{r['shape']:>14} {r['M']:9} {'y' if r['correct'] else 'N':>9} "
        print(lead + " ".join(f"{v:9.3f}" for v in vals))
    print("fused MoE, 256 experts top-8, 7168 -> 2048 -> 7168 (ceiling: bf16 or FP8 row-wise of this run)")
    head = ("weights", "T", "ok", "ours ms", "TFLOP/s", "of ceil", "naive ms", "speedup", "graph ms")
    print(" ".join(f"{h:>9}" for h in head))
    for r in res["moe"]:
        vals = (r["ours_ms"], r["ours_tflops"], r["ceiling_frac"], r["naive_ms"], r["speedup_vs_naive"])
        vals += (r.get("ours_graph_ms", nan),)
        lead = f"{'fp8' if r['fp8'] else 'bf16':>9} {r['T']:9} {'y' if r['correct'] else 'N':>9} "
        print(lead + " ".join(f"{v:9.3f}" for v in vals))
    print_small(res["gemm"])
    print_large(res["gemm"])
    if args.compare:
        with open(args.compare) as f:
            sys.exit(compare(json.load(f), res))


def print_small(rows: list) -> None:
    """The M <= 64 rows as graph replays in us: ours (tuned), before, both quantization forms, bf16,
    DeepGEMM; ours' GB/s; then eager (Python launches, CUDA events) ours and before."""
    nan = float("nan")
    print("M <= 64 as CUDA-graph replays over cold weights (us; GB/s of ours; ratios x / ours)")
    head = ("shape", "M", "ours", "GB/s", "before", "q inside", "q launch", "bf16", "deepgemm", "vs bf16", "vs before")
    head += ("vs DG", "eager", "eager bef", "captured", "cap bef", "cap/bf16")
    print(" ".join(f"{h:>14}" if i == 0 else f"{h:>9}" for i, h in enumerate(head)))
    for r in rows:
        if r["M"] > 64:
            continue
        keys = ("ours_graph_ms", "before_graph_ms", "q1_graph_ms", "q2_graph_ms", "bf16_graph_ms", "deepgemm_graph_ms")
        o, b, q1, q2, f, d = (r.get(k, nan) for k in keys)
        c, cb = r.get("captured_graph_ms", nan), r.get("before_captured_graph_ms", nan)
        vals = (o * 1e3, r.get("ours_graph_gbps", nan), b * 1e3, q1 * 1e3, q2 * 1e3, f * 1e3, d * 1e3, f / o, b / o)
        vals += (d / o, r.get("ours_ms", nan) * 1e3, r.get("before_ms", nan) * 1e3, c * 1e3, cb * 1e3, f / c)
        print(f"{r['shape']:>14} {r['M']:9} " + " ".join(f"{v:9.2f}" for v in vals))


def print_large(rows: list) -> None:
    """The M > 64 rows as graph replays (GPU time, no launch cost): ms, TFLOP/s, ratios."""
    nan = float("nan")
    print("M > 64 as CUDA-graph replays (ms; TFLOP/s of ours; ratios x / ours)")
    head = ("shape", "M", "ours", "TFLOP/s", "before", "bf16", "deepgemm", "DG TF/s", "vs before", "vs bf16", "vs DG")
    print(" ".join(f"{h:>14}" if i == 0 else f"{h:>9}" for i, h in enumerate(head)))
    for r in rows:
        if r["M"] <= 64 or "ours_graph_ms" not in r:
            continue
        o, b, f, d = (r.get(f"{k}_graph_ms", nan) for k in ("ours", "before", "bf16", "deepgemm"))
        vals = (o, r["ours_graph_tflops"], b, f, d, r.get("deepgemm_graph_tflops", nan), b / o, f / o, d / o)
        print(f"{r['shape']:>14} {r['M']:9} " + " ".join(f"{v:9.3f}" for v in vals))


def row_key(r: dict) -> tuple:
    return ("gemm", r["shape"], r["M"]) if "shape" in r else ("moe", r["fp8"], r["T"])


def compare(old: dict, new: dict, slack: float = 0.05) -> int:
    """Print new / old time for every row and time column both runs have; return 1 (and say which)
    if any is more than ``slack`` slower, else 0."""
    before = {row_key(r): r for r in old.get("gemm", []) + old.get("moe", [])}
    slow = []
    for r in new.get("gemm", []) + new.get("moe", []):
        o = before.get(row_key(r))
        if o is None:
            continue
        for col in ("ours_ms", "ours_graph_ms"):
            if col in r and col in o:
                ratio = r[col] / o[col]
                flag = "SLOWER" if ratio > 1 + slack else ""
                name = "/".join(map(str, row_key(r)))
                print(f"{name:>32} {col:>14} {o[col]:9.4f} -> {r[col]:9.4f} {ratio:6.2f}x {flag}")
                if flag:
                    slow.append((row_key(r), col, ratio))
    for k, col, ratio in slow:
        print(f"regression: {k} {col} {ratio:.2f}x the stored run")
    return 1 if slow else 0


def small_sweep(g: torch.Generator, out: str | None, tma: bool = False) -> None:
    """M = 1 / 16 / 64 on every shape over tile widths, warps, stages and K splits, as graph replays
    (bf16 beside). tma: the tensor-descriptor kernel's configs (64-row tiles, one warpgroup),
    beside the captured step's tuned config."""
    rows, bf16 = [], {}
    for name, (N, K) in SHAPES.items():
        for M in (1, 16, 64):
            n_kb = K // 128
            if tma:
                grid = [(bn, 4, st, sp) for bn in (64, 128) for st in (3, 5) for sp in (1, 2, 4, 8)]
            else:
                grid = list(product((32, 64, 128, 256), (4, 8), (3, 4), (1, 2, 4, 8, 16)))
            cfgs = [fp8_gemm_kernel.tuned_config(M, N, K, captured=True)] if tma else []
            for bn, nw, st, split in grid:
                if n_kb // split < 2 or (nw == 8 and bn < 128):
                    continue
                cfg = {"block_m": 64 if tma else max(16, 1 << (M - 1).bit_length()), "block_n": bn}
                cfg.update(num_warps=nw, num_stages=st, split_k=-(-n_kb // -(-n_kb // split)), tma=tma)
                cfgs.append(cfg)
            for cfg in cfgs:
                bn, nw, st, split = cfg["block_n"], cfg["num_warps"], cfg["num_stages"], cfg["split_k"]
                try:
                    rows.append(case(name, N, K, M, g, cfg, small_sweep=True))
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                    rows.append({"shape": name, "M": M, "config": cfg, "error": repr(e)[:150]})
                us = rows[-1].get("ours_graph_ms", float("nan")) * 1e3
                print(name, M, bn, nw, st, split, cfg.get("tma", False), f"{us:.2f} us", flush=True)
            x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
            w = (torch.randn(N, K, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
            bf16[(name, M)] = graph_ms(lambda wi: x @ wi.T, w)  # noqa: B023 - called at once
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    best = {}
    for r in rows:
        k = (r["shape"], r["M"])
        if "ours_graph_ms" in r and (k not in best or r["ours_graph_ms"] < best[k]["ours_graph_ms"]):
            best[k] = r
    for (name, M), r in best.items():
        tuned = fp8_gemm_kernel.tuned_config(M, *SHAPES[name], captured=tma)
        same = [x for x in rows if (x["shape"], x["M"]) == (name, M) and x["config"] == tuned]
        tuned_us = same[0]["ours_graph_ms"] * 1e3 if same else float("nan")
        best_us, b = r["ours_graph_ms"] * 1e3, bf16[(name, M)] * 1e3
        print(f"best {name} M={M}: {r['config']} {best_us:.2f} us; tuned {tuned} {tuned_us:.2f} us")
        print(f"    bf16 {b:.2f} us: best {b / best_us:.2f}x, tuned {b / tuned_us:.2f}x")


if __name__ == "__main__":
    main()
