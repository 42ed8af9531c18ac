"""Fused MoE: the paddle wrapper of ``fused_moe_kernel.py`` and the paddle reference beside it.

x [T, H] (bf16 / float32); topk_ids int [T, top_k] (this rank's expert ids 0 .. E-1; any other id
is another rank's expert and contributes nothing here); topk_weights float32 [T, top_k];
w1 (gate) and w3 (up) [E, I, H], w2 (down) [E, H, I]: bf16 / float32, or e4m3 codes uint8 with
scales s1, s3 float32 [E, ceil(I/128), ceil(H/128)] and s2 [E, ceil(H/128), ceil(I/128)].
-> float32 [T, H] = sum over k of topk_weights[t, k] * down(silu(gate(x_t)) * up(x_t)) of expert
topk_ids[t, k]. With FP8 weights each GEMM's input is quantized per row per 128 columns, as in
the W8A8 linear (docs/design.md §4.8). The intermediate and each entry's weighted down output are
kept in x's dtype (as vLLM and SGLang keep them), the sum over k in float32.
"""

from __future__ import annotations

import paddle

from fastdeploy.model_executor.ops.triton_ops.expert_sort_kernel import (
    ALIGN_KERNEL_MAX,
    align_scratch_size,
    launch_expert_sort,
)
from fastdeploy.model_executor.ops.triton_ops.fp8_gemm import w8a8_block_linear_ref
from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import launch_act_quant
from fastdeploy.model_executor.ops.triton_ops.fused_moe_kernel import (
    aligned_rows,
    block_m_for,
    launch_moe_gemm,
    launch_moe_sum,
    moe_tile_config,
)


def moe_align(topk_ids: paddle.Tensor, num_experts: int, block_m: int) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Sort the routed entries (topk_ids [T, top_k] or flat [N]) by expert, each expert's run
    padded to block_m, on the device (no
    host sync): -> sorted_ids int32 [P] (entry ids t * top_k + k; N = T * top_k marks padding) and
    block_expert int32 [P / block_m] (-1 for blocks past the last expert's run). P is the bound
    N + E * (block_m - 1), rounded up to block_m, so the launch grid depends on shapes only. Up to
    ALIGN_KERNEL_MAX entries one Triton program does it; above, four launches over chunks of
    entries."""
    flat = topk_ids.flatten().astype("int64")
    N, E = flat.shape[0], num_experts
    P = aligned_rows(N, E, block_m)
    sorted_ids, block_expert = paddle.empty([P], "int32"), paddle.empty([P // block_m], "int32")
    scratch = paddle.empty([align_scratch_size(E, N)], "int32") if N > ALIGN_KERNEL_MAX else None
    launch_expert_sort(flat, E, block_m, sorted_ids, block_expert, scratch)
    return sorted_ids, block_expert


def _quantized(x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
    codes = paddle.empty(x.shape, "uint8")
    scales = paddle.empty([x.shape[0], -(-x.shape[1] // 128)], "float32")
    launch_act_quant(x, codes, scales)
    return codes, scales


def fused_moe(
    x: paddle.Tensor,
    topk_ids: paddle.Tensor,
    topk_weights: paddle.Tensor,
    w1: paddle.Tensor,
    w3: paddle.Tensor,
    w2: paddle.Tensor,
    s1: paddle.Tensor | None = None,
    s3: paddle.Tensor | None = None,
    s2: paddle.Tensor | None = None,
) -> paddle.Tensor:
    """The Triton path: one sort, two grouped GEMM launches (plus activation quantization with
    FP8 weights), one sum over top_k. No buffer is zeroed: rows of entries routed to other
    ranks are never written, quantized rows of them never read, and the sum skips them."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E, inter_dim = w1.shape[0], w1.shape[1]
    N = T * K
    bm = block_m_for(N, E)
    flat = topk_ids.flatten().astype("int64")  # the entries' experts, for the sort and the sum
    sorted_ids, block_expert = moe_align(flat, E, bm)
    fp8 = s1 is not None
    tiles = moe_tile_config(N, E, fp8, (H, inter_dim))
    x = x.contiguous()
    inter = paddle.empty([N, inter_dim], x.dtype)
    if fp8:
        codes, scales = _quantized(x)
        launch_moe_gemm(
            codes, w1, inter, sorted_ids, block_expert, N, K, bm, a_s=scales, ws1=s1, w3=w3, ws3=s3, **tiles
        )
        a2, a2_s = _quantized(inter)
    else:
        launch_moe_gemm(x, w1, inter, sorted_ids, block_expert, N, K, bm, w3=w3)
        a2, a2_s = inter, None
    y = paddle.empty([N, H], x.dtype)
    top_w = topk_weights.astype("float32").flatten().contiguous()
    down_tiles = moe_tile_config(N, E, fp8, (H, inter_dim), down=True)
    launch_moe_gemm(a2, w2, y, sorted_ids, block_expert, N, K, bm, a_s=a2_s, ws1=s2, top_w=top_w, **down_tiles)
    out = paddle.empty([T, H], "float32")
    launch_moe_sum(y, flat, E, out)
    return out


def fused_moe_ref(
    x: paddle.Tensor,
    topk_ids: paddle.Tensor,
    topk_weights: paddle.Tensor,
    w1: paddle.Tensor,
    w3: paddle.Tensor,
    w2: paddle.Tensor,
    s1: paddle.Tensor | None = None,
    s3: paddle.Tensor | None = None,
    s2: paddle.Tensor | None = None,
) -> paddle.Tensor:
    """The same math, one expert at a time in float32 paddle ops (the CPU path)."""
    T, H = x.shape
    E = w1.shape[0]
    out = paddle.zeros([T, H], "float32")
    flat = topk_ids.flatten().astype("int64")
    wflat = topk_weights.astype("float32").flatten()
    xf = x.astype("float32")

    def lin(a: paddle.Tensor, w: paddle.Tensor, s: paddle.Tensor | None, e: int) -> paddle.Tensor:
        if s is None:
            return paddle.matmul(a, w[e].astype("float32"), transpose_y=True)
        return w8a8_block_linear_ref(a, w[e], s[e])

    for e in paddle.unique(flat).tolist():
        if not 0 <= e < E:
            continue
        hit = paddle.nonzero(flat == e).flatten()
        tok = hit // topk_ids.shape[1]
        h = paddle.nn.functional.silu(lin(xf[tok], w1, s1, e)) * lin(xf[tok], w3, s3, e)
        if x.dtype != paddle.float32:  # the kernel keeps the intermediate in x's dtype
            h = h.astype(x.dtype).astype("float32")
        y = lin(h, w2, s2, e) * wflat[hit].unsqueeze(-1)
        if x.dtype != paddle.float32:  # and each entry's weighted down output
            y = y.astype(x.dtype).astype("float32")
        out = paddle.index_add(out, tok, 0, y)
    return out
