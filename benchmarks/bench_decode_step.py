"""H200: one DeepSeek-V3 decoder layer's decode step made of the project's kernels in the order the
model launches them (``attn_kernels`` / ``mlp_kernels``; a CPU test checks these lists against the
tiny model's own launches), at TP 1 and TP 8 shapes, batch 1-256, context 4K and 32K: eager
(Python launching every kernel), CUDA-graph replay, and the sum of its kernel times (profiler).
Projected to 61 layers plus the LM head and the device sampler (timed here too) as time per
output token and tokens/s per GPU. torch CUDA tensors (no paddle on the GPU host); FP8 weights
(W8A8 block GEMM, fused MoE), bf16 activations; the norms, rotary, absorption matmuls, router
and the full layer's bf16 cache write are torch ops, as paddle ops are in the model. Not timed:
TP all-reduces (two a layer), the embedding.

    python benchmarks/bench_decode_step.py [--json OUT] [--quick]
    python benchmarks/bench_decode_step.py --verify-k 1,2,3 [--json OUT]

``--verify-k``: MTP's verify step (docs/design.md §4.16) against the 1-token decode step, at TP 8,
context 4K: B requests with k drafts run B * (k + 1) query tokens through the layer (graph
replay). Each query token reads its own window here; in a verify step a request's k + 1 tokens
read nearly the same keys, so this bounds the attention's cost from above.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fp8_moe import moe_align_torch  # noqa: E402  (fused_moe.moe_align in torch ops)
from bench_fp8_moe import replay_ms as call_replay_ms  # noqa: E402  (ms a call, as a graph of n calls)
from common import events_ms, kernel_sum_ms  # noqa: E402
from common import replay_ms as _replay_ms  # noqa: E402

from fastdeploy.model_executor.ops.triton_ops.expert_sort_kernel import (  # noqa: E402
    align_scratch_size,
    launch_expert_sort,
    launch_moe_align,
)
from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import (  # noqa: E402
    SPLIT_COUNTERS,
    launch_act_quant,
    launch_w8a8_gemm,
    tuned_config,
)
from fastdeploy.model_executor.ops.triton_ops.fused_moe_kernel import (  # noqa: E402
    aligned_rows,
    block_m_for,
    launch_moe_gemm,
    launch_moe_sum,
)
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache_kernel import launch_write_mla_fp8_cache  # noqa: E402
from fastdeploy.model_executor.ops.triton_ops.moe_route_kernel import launch_moe_route  # noqa: E402
from fastdeploy.model_executor.ops.triton_ops.rms_norm_kernel import launch_rms_norm  # noqa: E402
from fastdeploy.model_executor.ops.triton_ops.rotary_kernel import launch_rope  # noqa: E402
from fastdeploy.model_executor.ops.triton_ops.sampling_kernel import (  # noqa: E402
    CUT_DEPTHS,
    KMAX,
    launch_sample,
    num_chunks,
    row_keys,
)
from fastdeploy.model_executor.ops.triton_ops.sparse_mla_kernel import (  # noqa: E402
    default_num_splits,
    launch_sparse_mla,
)
from fastdeploy.model_executor.ops.triton_ops.sparse_mla_kernel import tuned_config as mla_config  # noqa: E402

DEV = "cuda"
HIDDEN, Q_LORA, KV_LORA, ROPE, NOPE, V = 7168, 1536, 512, 64, 128, 128
EXPERTS, TOPK, MOE_INTER, SHARED_INTER, VOCAB, LAYERS = 256, 8, 2048, 2048, 129280, 61
GROUPS, TOPK_GROUPS, ROUTED_SCALE = 8, 4, 2.5  # DeepSeek-V3's noaux_tc routing
# layer_case's graph_<form>_ms and their column titles: the eager GEMM configs; the router (weight
# cast a call, routing ops), expert sort and sum over k as before this round; then each earlier
# form put back, cumulatively in order.
BEFORE_FORMS = {
    "eager_cfg": "eager configs",
    "prev_round": "router + sort + sum before",
    "torch_rope": "torch rope",
    "torch_norm": "+ norms",
    "torch_align": "+ torch sort",
    "torch_sum": "+ zeroed f32 sum",
    "torch_route": "+ torch routing",
    "router_cast": "+ router weight cast",
}


def fp8_weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 255, (n, k), device=DEV, dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x30  # no NaN codes
    scales = torch.rand(-(-n // 128), -(-k // 128), device=DEV, generator=g) * 2e-3 + 1e-3
    return codes, scales


class Linear8:
    """y [M, N] bf16 = x [M, K] bf16 through the W8A8 block GEMM, as ``fp8_gemm`` runs it."""

    def __init__(self, n: int, k: int, m: int, g: torch.Generator) -> None:
        self.w, self.ws = fp8_weight(n, k, g)
        self.shape = (m, n, k)
        self.out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
        self.a = torch.empty(m, k, device=DEV, dtype=torch.uint8)
        self.counters = torch.zeros(SPLIT_COUNTERS, device=DEV, dtype=torch.int32)
        self.set_captured(False)

    def set_captured(self, captured: bool) -> None:
        """The config a captured step takes (``tuned_config(..., captured=True)``) or the eager one,
        with its buffers (M-major activation scales for the TMA kernel, split partials)."""
        m, n, k = self.shape
        self.cfg = tuned_config(m, n, k, captured=captured)
        tma = bool(self.cfg.get("tma"))
        self.a_s = torch.empty(-(-k // 128), m, device=DEV) if tma else torch.empty(m, -(-k // 128), device=DEV)
        sk = self.cfg["split_k"]
        self.part = torch.empty(sk, m, n, device=DEV) if sk > 1 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg["fuse_quant"]:
            launch_w8a8_gemm(x.contiguous(), None, self.w, self.ws, self.out, self.cfg, self.part, self.counters)
        else:
            launch_act_quant(x, self.a, self.a_s, m_major=bool(self.cfg.get("tma")))
            launch_w8a8_gemm(self.a, self.a_s, self.w, self.ws, self.out, self.cfg, self.part, self.counters)
        return self.out


def route_torch(logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``MoEGate``'s paddle ops after the router GEMM, in torch: the routing's earlier form."""
    B = logits.shape[0]
    scores = logits.sigmoid()
    choice = scores + bias
    grouped = choice.view(B, GROUPS, -1)
    group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
    top_groups = group_scores.topk(TOPK_GROUPS, dim=-1)[1]
    ones = torch.ones_like(top_groups, dtype=torch.float32)
    mask = torch.zeros(B, GROUPS, device=DEV).scatter(1, top_groups, ones)
    masked = torch.where(mask.unsqueeze(-1).expand_as(grouped).reshape(B, -1) > 0, choice, float("-inf"))
    ids = masked.topk(TOPK, dim=-1)[1]
    w = scores.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * ROUTED_SCALE


def route_check(g: torch.Generator, B: int = 256) -> dict:
    """The routing kernel against its torch form on the GPU: the same experts for every token,
    weights within 1e-5."""
    logits = torch.randn(B, EXPERTS, device=DEV, generator=g) * 2
    bias = torch.randn(EXPERTS, device=DEV, generator=g) * 0.1
    ids, w = torch.empty(B, TOPK, device=DEV, dtype=torch.int64), torch.empty(B, TOPK, device=DEV)
    launch_moe_route(logits, bias, ids, w, GROUPS, TOPK_GROUPS, True, ROUTED_SCALE)
    want_ids, want_w = route_torch(logits, bias)
    a, ia = ids.sort(1)
    b, ib = want_ids.sort(1)
    err = (w.gather(1, ia) - want_w.gather(1, ib)).abs().max().item()
    return {"tokens": B, "same_experts": bool(torch.equal(a, b)), "max_weight_err": err}


def rms(x: torch.Tensor, w: torch.Tensor, kernel: bool = True) -> torch.Tensor:
    """The model's RMSNorm: one Triton launch, or (``kernel`` False) the elementwise ops of its
    paddle form, the form before."""
    if kernel:
        out = torch.empty_like(x)
        launch_rms_norm(x, w, out, 1e-6)
        return out
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(torch.bfloat16)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], -1).to(x.dtype)


class Layer:
    """One decoder layer (MLA + MoE) at TP ``tp`` for a decode batch of B tokens, each at ``ctx``
    positions of context; ``swa``: attends over the last ``window`` through the FP8 cache, else
    over all ``ctx`` through a bf16 cache."""

    def __init__(self, B: int, tp: int, ctx: int, swa: bool, window: int, g: torch.Generator) -> None:
        H = 128 // tp
        self.B, self.H, self.swa = B, H, swa
        self.q_a = Linear8(Q_LORA, HIDDEN, B, g)
        self.q_b = Linear8(H * (NOPE + ROPE), Q_LORA, B, g)
        self.kv_a = Linear8(KV_LORA + ROPE, HIDDEN, B, g)
        self.o = Linear8(HIDDEN, H * V, B, g)
        inter = MOE_INTER // tp
        self.w1, self.w1s = fp8_weight(EXPERTS * inter, HIDDEN, g)
        self.w3, self.w3s = fp8_weight(EXPERTS * inter, HIDDEN, g)
        self.w2, self.w2s = fp8_weight(EXPERTS * HIDDEN, inter, g)
        self.w1, self.w3 = self.w1.view(EXPERTS, inter, HIDDEN), self.w3.view(EXPERTS, inter, HIDDEN)
        self.w1s, self.w3s = self.w1s.view(EXPERTS, -1, HIDDEN // 128), self.w3s.view(EXPERTS, -1, HIDDEN // 128)
        self.w2, self.w2s = self.w2.view(EXPERTS, HIDDEN, inter), self.w2s.view(EXPERTS, HIDDEN // 128, -1)
        self.inter = inter
        self.shared_gate = Linear8(SHARED_INTER // tp, HIDDEN, B, g)
        self.shared_up = Linear8(SHARED_INTER // tp, HIDDEN, B, g)
        self.shared_down = Linear8(HIDDEN, SHARED_INTER // tp, B, g)
        self.router = (torch.randn(EXPERTS, HIDDEN, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
        self.router_bias = torch.randn(EXPERTS, device=DEV, generator=g) * 0.1
        self.route_ids = torch.empty(B, TOPK, device=DEV, dtype=torch.int64)
        self.route_w = torch.empty(B, TOPK, device=DEV)
        self.route_kernel = True
        self.router32, self.router_cast = self.router.float(), False
        self.norms = [torch.rand(n, device=DEV, generator=g) + 0.5 for n in (HIDDEN, Q_LORA, KV_LORA, HIDDEN)]
        self.w_uk = (torch.randn(H, NOPE, KV_LORA, device=DEV, generator=g) * 0.05).to(torch.bfloat16)
        self.w_uv = (torch.randn(H, KV_LORA, V, device=DEV, generator=g) * 0.05).to(torch.bfloat16)
        self.cos = torch.rand(B, ROPE // 2, device=DEV, generator=g)
        self.sin = torch.rand(B, ROPE // 2, device=DEV, generator=g)
        # the cache: B requests' contexts laid out one after another, slots = positions
        n_slots = B * ctx + 1
        topk = window if swa else ctx
        if swa:
            self.cache = torch.randint(0, 120, (n_slots, 656), device=DEV, dtype=torch.uint8, generator=g)
            self.cache[:, 512:528] = torch.tensor([0, 0, 128, 59] * 4, dtype=torch.uint8, device=DEV)  # scales ~4e-3
        else:
            self.cache = (torch.randn(n_slots, 576, device=DEV, generator=g) * 0.1).to(torch.bfloat16)
        base = torch.arange(B, device=DEV).unsqueeze(1) * ctx
        self.indices = (base + ctx - topk + torch.arange(topk, device=DEV).unsqueeze(0)).int().contiguous()
        self.slots = (base[:, 0] + ctx - 1).int()
        self.scale = 1.0 / math.sqrt(NOPE + ROPE)
        cfg = mla_config(B, H)
        self.splits = default_num_splits(B, H, topk, cfg["block_h"], cfg["block_n"])
        self.attn_out = torch.empty(B, H, KV_LORA, device=DEV, dtype=torch.bfloat16)
        self.lse = torch.empty(B, H, device=DEV)
        self.partial = torch.empty(B, self.splits, H, KV_LORA, device=DEV) if self.splits > 1 else None
        self.partial_lse = torch.empty(B, self.splits, H, device=DEV) if self.splits > 1 else None
        N = B * TOPK
        self.bm = block_m_for(N, EXPERTS)
        self.xc = torch.empty(B, HIDDEN, device=DEV, dtype=torch.uint8)
        self.xs = torch.empty(B, HIDDEN // 128, device=DEV)
        self.h = torch.empty(N, inter, device=DEV, dtype=torch.bfloat16)
        self.hc = torch.empty(N, inter, device=DEV, dtype=torch.uint8)
        self.hs = torch.empty(N, inter // 128, device=DEV)
        self.y = torch.empty(N, HIDDEN, device=DEV, dtype=torch.bfloat16)
        self.y32 = torch.empty(N, HIDDEN, device=DEV)
        self.routed_out = torch.empty(B, HIDDEN, device=DEV)
        P = aligned_rows(N, EXPERTS, self.bm)
        self.sorted_ids = torch.empty(P, device=DEV, dtype=torch.int32)
        self.block_expert = torch.empty(P // self.bm, device=DEV, dtype=torch.int32)
        self.align_scratch = torch.empty(align_scratch_size(EXPERTS, N), device=DEV, dtype=torch.int32)
        self.align_form = "model"  # or "one_program" (up to 1024 entries, torch ops above), "torch"
        self.sum_kernel = True
        self.rms_kernel = True
        self.rope_kernel = True
        self.pos = torch.full((B,), ctx - 1, device=DEV, dtype=torch.int64)
        self.cos_table = torch.rand(ctx, ROPE // 2, device=DEV, generator=g)
        self.sin_table = torch.rand(ctx, ROPE // 2, device=DEV, generator=g)
        self.q_pe = torch.empty(B, H, ROPE, device=DEV, dtype=torch.bfloat16)
        self.k_pe = torch.empty(B, ROPE, device=DEV, dtype=torch.bfloat16)

    def set_captured(self, captured: bool) -> None:
        for lin in vars(self).values():
            if isinstance(lin, Linear8):
                lin.set_captured(captured)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        B, H = self.B, self.H
        k = self.rms_kernel
        h = rms(x, self.norms[0], k)
        q = self.q_b(rms(self.q_a(h), self.norms[1], k)).view(B, H, NOPE + ROPE)
        kv_a = self.kv_a(h)
        kv_c = rms(kv_a[:, :KV_LORA], self.norms[2], k)
        if self.rope_kernel:  # the model's form: one launch
            q_pe, k_pe = self.q_pe, self.k_pe
            launch_rope(self.pos, q, kv_a, self.cos_table, self.sin_table, q_pe, k_pe)
        else:  # the paddle form's elementwise ops
            q_pe = rope(q[:, :, NOPE:], self.cos.unsqueeze(1), self.sin.unsqueeze(1))
            k_pe = rope(kv_a[:, KV_LORA:], self.cos, self.sin)
        q_lat = torch.bmm(q[:, :, :NOPE].transpose(0, 1), self.w_uk).transpose(0, 1)  # [B, H, 512]
        qa = torch.cat([q_lat, q_pe], -1).contiguous()
        if self.swa:
            launch_write_mla_fp8_cache(kv_c, k_pe, self.slots, self.cache)
        else:
            self.cache[self.slots.long()] = torch.cat([kv_c, k_pe], -1)
        launch_sparse_mla(
            qa,
            self.cache,
            self.indices,
            self.attn_out,
            self.lse,
            self.scale,
            num_splits=self.splits,
            partial=self.partial,
            partial_lse=self.partial_lse,
        )
        o = torch.bmm(self.attn_out.transpose(0, 1), self.w_uv).transpose(0, 1).reshape(B, H * V)
        x = x + self.o(o.contiguous())
        h = rms(x, self.norms[3], k)
        router = self.router.float() if self.router_cast else self.router32  # the earlier form cast it a call
        logits = h.float() @ router.T  # the model's router GEMM, in float32
        if self.route_kernel:  # the model's form: one launch
            ids, top_w = self.route_ids, self.route_w
            launch_moe_route(logits, self.router_bias, ids, top_w, GROUPS, TOPK_GROUPS, True, ROUTED_SCALE)
        else:  # the earlier form: MoEGate's paddle ops, mirrored in torch
            ids, top_w = route_torch(logits, self.router_bias)
        top_w = top_w.flatten()
        sorted_ids, block_expert = self.sorted_ids, self.block_expert
        if self.align_form == "model":  # one launch, four above ALIGN_KERNEL_MAX entries
            launch_expert_sort(ids.flatten(), EXPERTS, self.bm, sorted_ids, block_expert, self.align_scratch)
        elif self.align_form == "one_program" and B * TOPK <= 1024:  # the model's form before
            launch_moe_align(ids.flatten(), EXPERTS, self.bm, sorted_ids, block_expert)
        else:  # the earlier form: torch ops (what moe_align did in paddle ops)
            sorted_ids, block_expert = moe_align_torch(ids, EXPERTS, self.bm)
        launch_act_quant(h, self.xc, self.xs)
        N = B * TOPK
        launch_moe_gemm(
            self.xc,
            self.w1,
            self.h,
            sorted_ids,
            block_expert,
            N,
            TOPK,
            self.bm,
            a_s=self.xs,
            ws1=self.w1s,
            w3=self.w3,
            ws3=self.w3s,
        )
        launch_act_quant(self.h, self.hc, self.hs)
        y = self.y if self.sum_kernel else self.y32.zero_()  # the earlier form: float32 rows zeroed, torch's sum
        launch_moe_gemm(
            self.hc, self.w2, y, sorted_ids, block_expert, N, TOPK, self.bm, a_s=self.hs, ws1=self.w2s, top_w=top_w
        )
        if self.sum_kernel:  # the model's form: bf16 rows, one masked sum launch
            launch_moe_sum(y, ids.flatten(), EXPERTS, self.routed_out)
            routed = self.routed_out
        else:
            routed = y.view(B, TOPK, HIDDEN).sum(1)
        gate, up = self.shared_gate(h), self.shared_up(h)
        shared = self.shared_down((torch.nn.functional.silu(gate.float()) * up.float()).to(torch.bfloat16))
        return x + routed.to(torch.bfloat16) + shared


def small_kernel_rows(g: torch.Generator, before=None) -> list[dict]:
    """Graph-replay us of the routing (by warps), the one-program expert sort and the model's sort
    (``launch_expert_sort``) at decode batches, the sorts also by ``before`` (an earlier
    fused_moe_kernel module) and checked against the torch definition into poisoned outputs (10
    launches a graph)."""
    rows = []
    for B in (1, 8, 128):
        logits = torch.randn(B, EXPERTS, device=DEV, generator=g)
        bias = torch.randn(EXPERTS, device=DEV, generator=g) * 0.1
        ids, w = torch.empty(B, TOPK, device=DEV, dtype=torch.int64), torch.empty(B, TOPK, device=DEV)
        launch_moe_route(logits, bias, ids, w, GROUPS, TOPK_GROUPS, True, ROUTED_SCALE)
        N = B * TOPK
        bm = block_m_for(N, EXPERTS)
        P = aligned_rows(N, EXPERTS, bm)
        si, be = torch.empty(P, device=DEV, dtype=torch.int32), torch.empty(P // bm, device=DEV, dtype=torch.int32)
        want = moe_align_torch(ids, EXPERTS, bm)
        row = {"B": B, "entries": N}
        for warps in (1, 4):
            route = (logits, bias, ids, w, GROUPS, TOPK_GROUPS, True, ROUTED_SCALE)
            fn = lambda a=route, nw=warps: launch_moe_route(*a, num_warps=nw)  # noqa: E731
            row[f"route_w{warps}_us"] = call_replay_ms(fn, 10) * 1e3
        scratch = torch.empty(align_scratch_size(EXPERTS, N), device=DEV, dtype=torch.int32)
        args = (ids.flatten(), EXPERTS, bm, si, be)
        for suffix, mod in (("", sys.modules[__name__]), ("_before", before)):
            if mod is None:
                continue
            forms = {"align": lambda m=mod, a=args: m.launch_moe_align(*a)}  # one program
            forms["sort"] = lambda m=mod, a=(*args, scratch): m.launch_expert_sort(*a)  # the model's form
            for name, fn in forms.items():
                si.fill_(-7)
                be.fill_(-7)
                row[f"{name}{suffix}_us"] = call_replay_ms(fn, 10) * 1e3
                row[f"{name}{suffix}_equal"] = bool(torch.equal(si, want[0]) and torch.equal(be, want[1]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def replay_ms(layer, x: torch.Tensor) -> float:
    """ms a replay of the layer captured as one CUDA graph."""
    return _replay_ms(lambda: layer(x), 1, events_ms)


def layer_case(B: int, tp: int, ctx: int, swa: bool, window: int, g: torch.Generator) -> dict:
    """Eager with the engine's configs; graph replay and kernel sum with the captured configs
    (``tuned_config(..., captured=True)``), and graph replay with the eager ones beside them."""
    layer = Layer(B, tp, ctx, swa, window, g)
    x = (torch.randn(B, HIDDEN, device=DEV, generator=g) * 0.5).to(torch.bfloat16)
    out = layer(x)
    finite = bool(torch.isfinite(out.float()).all())
    eager = events_ms(lambda: layer(x))
    replay_eager_cfg = replay_ms(layer, x)
    layer.set_captured(True)
    finite &= bool(torch.isfinite(layer(x).float()).all())
    replay = replay_ms(layer, x)
    ksum = kernel_sum_ms(lambda: layer(x))
    layer.align_form, layer.sum_kernel, layer.route_kernel, layer.router_cast = "one_program", False, False, True
    replay_prev_round = replay_ms(layer, x)  # the router, expert sort and sum over k as before this round
    layer.align_form, layer.sum_kernel, layer.route_kernel, layer.router_cast = "model", True, True, False
    layer.rope_kernel = False
    replay_torch_rope = replay_ms(layer, x)
    layer.rms_kernel = False
    replay_torch_norm = replay_ms(layer, x)
    layer.align_form = "torch"
    replay_torch_align = replay_ms(layer, x)
    layer.sum_kernel = False
    replay_torch_sum = replay_ms(layer, x)
    layer.route_kernel = False
    replay_torch_route = replay_ms(layer, x)
    layer.router_cast = True
    replay_router_cast = replay_ms(layer, x)  # every earlier form put back
    layer = None  # free the weights and caches before the next case
    torch.cuda.empty_cache()
    return {
        "B": B,
        "tp": tp,
        "ctx": ctx,
        "kind": "swa" if swa else "full",
        "eager_ms": eager,
        "graph_ms": replay,
        "graph_eager_cfg_ms": replay_eager_cfg,
        "graph_prev_round_ms": replay_prev_round,
        "graph_torch_rope_ms": replay_torch_rope,
        "graph_torch_norm_ms": replay_torch_norm,
        "graph_torch_align_ms": replay_torch_align,
        "graph_torch_sum_ms": replay_torch_sum,
        "graph_torch_route_ms": replay_torch_route,
        "graph_router_cast_ms": replay_router_cast,
        "kernel_sum_ms": ksum,
        "graph_speedup": eager / replay,
        "graph_vs_kernel_sum": replay / ksum,
        "finite": finite,
    }


def head_and_sampler_ms(B: int, tp: int, g: torch.Generator) -> float:
    """The LM head (bf16, vocab split over TP) and the device sampler (full vocab) at batch B."""
    w = (torch.randn(VOCAB // tp, HIDDEN, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(B, HIDDEN, device=DEV, generator=g).to(torch.bfloat16)
    logits = torch.randn(B, VOCAB, device=DEV, generator=g)
    f = torch.zeros(B, 8, device=DEV)
    f[:, 0], f[:, 1], f[:, 3] = 0.8, 0.9, 1.0
    i = torch.zeros(B, 4, device=DEV, dtype=torch.int32)
    i[:, 0], i[:, 1] = 50, -1
    keys = torch.from_numpy(row_keys(np.arange(B, dtype=np.uint64), np.zeros(B, np.uint64))).to(DEV)
    bufs = [
        torch.empty(B, VOCAB, device=DEV),
        torch.zeros(1, VOCAB, device=DEV, dtype=torch.int32),
        torch.zeros(1, VOCAB, device=DEV, dtype=torch.uint8),
        f,
        i,
        keys,
        torch.full((B, 1), -1, device=DEV, dtype=torch.int32),
        torch.zeros(B, 1, device=DEV),
        torch.tensor(CUT_DEPTHS, device=DEV),
        torch.empty(B, 4, device=DEV),
        torch.empty(B, device=DEV, dtype=torch.int32),
        torch.empty(B, KMAX, device=DEV),
        torch.empty(B, KMAX, device=DEV, dtype=torch.int32),
        torch.empty(B, device=DEV, dtype=torch.int32),
        torch.empty(B, device=DEV),
        torch.empty(B, num_chunks(B, VOCAB, 2048), 8, device=DEV),
        torch.empty(B, num_chunks(B, VOCAB, 2048), 34, device=DEV),
    ]

    def step():
        x @ w.T
        launch_sample(logits, bufs[0], *bufs[1:])

    return events_ms(step)


def stack_ms(per: dict, key: str, swa_fraction: float) -> float:
    """The 61 layers of a step from one SWA and one full layer's times (``per[kind][key]``)."""
    return LAYERS * (swa_fraction * per["swa"][key] + (1 - swa_fraction) * per["full"][key])


# tokens a verify step of k drafts yields: the fitted tiny model's per-position acceptance
# (README's MTP table, batch 1) and DeepSeek-V3's reported first-draft acceptance (k = 1 only)
TOKENS_A_STEP = {"fitted": {1: 1.69, 2: 2.17, 3: 2.38}, "deepseek": {1: 1.85}}


def verify_rows(a, g: torch.Generator) -> None:
    """One layer's verify step (B * (k + 1) tokens) against its 1-token decode step (B tokens),
    then the projected TP 8 time a token: 61 layers (``--swa-fraction`` SWA) of the verify step,
    the LM head and sampler over B * (k + 1) rows, and the draft passes as the engine's captured
    draft graph runs them (``worker/draft_graphs.py``): the MTP layer (a full layer) over the
    step's B * (k + 1) rows, then k - 1 times over B rows, each pass's LM head and arg-max over
    B rows (timed as head and sampler: an upper bound); over the tokens a step yields. The host's
    work between steps is not in it (speculating steps run in turn)."""
    ks = [int(k) for k in a.verify_k.split(",")]
    rows = []
    print("| TP | B | ctx | layer | decode ms | " + " | ".join(f"k={k} ms (x decode)" for k in ks) + " |")
    print("|---|---|---|---|---|" + "---|" * len(ks))
    for B in (1, 8, 32):
        per = {}
        for swa in (True, False):
            base = layer_case(B, 8, 4096, swa, a.window, g)
            row = {"B": B, "kind": base["kind"], "decode_ms": base["graph_ms"]}
            cells = []
            for k in ks:
                r = layer_case(B * (k + 1), 8, 4096, swa, a.window, g)
                row[f"verify_k{k}_ms"] = r["graph_ms"]
                cells.append(f"{r['graph_ms']:.3f} ({r['graph_ms'] / base['graph_ms']:.2f}x)")
            rows.append(row)
            per[base["kind"]] = row
            print(
                f"| 8 | {B} | 4096 | {base['kind']} | {base['graph_ms']:.3f} | " + " | ".join(cells) + " |", flush=True
            )
        layers = {key: stack_ms(per, key, a.swa_fraction) for key in per["swa"] if "ms" in key}
        proj = {"B": B, "decode_ms_token": layers["decode_ms"] + head_and_sampler_ms(B, 8, g)}
        for k in ks:
            mtp = per["full"][f"verify_k{k}_ms"] + (k - 1) * per["full"]["decode_ms"]  # pass 1 over every row
            drafts = mtp + k * head_and_sampler_ms(B, 8, g)
            step = layers[f"verify_k{k}_ms"] + head_and_sampler_ms(B * (k + 1), 8, g) + drafts
            proj[f"verify_k{k}_step_ms"] = step
            proj[f"draft_k{k}_ms"] = drafts
            for source, tokens in TOKENS_A_STEP.items():
                if k in tokens:
                    proj[f"k{k}_{source}_ms_token"] = step / tokens[k]
        rows.append({"projection": proj})
        print(json.dumps(proj), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"verify": rows, "window": a.window, "tokens_a_step": TOKENS_A_STEP}, fh)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--window", type=int, default=2048, help="SWA layers' window")
    ap.add_argument("--swa-fraction", type=float, default=0.5, help="share of the 61 layers that are SWA")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tp", default="1,8", help="TP sizes, comma-separated")
    ap.add_argument("--batches", default=None, help="batch sizes, comma-separated")
    ap.add_argument("--breakdown", default=None, metavar="TP,B,CTX,KIND", help="print one layer's kernel times")
    ap.add_argument("--verify-k", default=None, metavar="K,...", help="time MTP verify steps of k drafts instead")
    ap.add_argument("--small-kernels", action="store_true", help="the routing and one-program sort kernels instead")
    ap.add_argument("--before-moe", default=None, help="with --small-kernels: an earlier fused_moe_kernel.py")
    a = ap.parse_args()
    g = torch.Generator(device=DEV).manual_seed(0)
    if a.verify_k:
        verify_rows(a, g)
        return
    if a.small_kernels:
        before = None
        if a.before_moe:
            import importlib.util

            spec = importlib.util.spec_from_file_location("before_fused_moe_kernel", a.before_moe)
            before = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(before)
        rows = small_kernel_rows(g, before)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(rows, fh, indent=1)
        return
    if a.breakdown:
        tp, B, ctx, kind = a.breakdown.split(",")
        layer = Layer(int(B), int(tp), int(ctx), kind == "swa", a.window, g)
        x = (torch.randn(int(B), HIDDEN, device=DEV, generator=g) * 0.5).to(torch.bfloat16)
        from torch.profiler import ProfilerActivity, profile

        layer(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                layer(x)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
        return
    batches = (
        tuple(int(b) for b in a.batches.split(",")) if a.batches else (1, 8, 64) if a.quick else (1, 8, 32, 128, 256)
    )
    rows, proj = [], []
    check = route_check(g)
    print("routing kernel against its torch form:", json.dumps(check))
    cols = ("eager ms", "graph ms", *BEFORE_FORMS.values())
    cols += ("kernel sum ms", "eager/graph", "graph/kernel sum")
    print("| TP | B | ctx | layer | " + " | ".join(cols) + " |")
    print("|---" * (4 + len(cols)) + "|")
    for tp in tuple(int(t) for t in a.tp.split(",")):
        for ctx in (4096, 32768):
            for B in batches:
                if B * ctx > 256 * 4096 * 4 and tp == 1:
                    continue  # cache over 20 GB: skipped at TP 1
                per = {}
                for swa in (True, False):
                    r = layer_case(B, tp, ctx, swa, a.window, g)
                    rows.append(r)
                    per[r["kind"]] = r
                    print(
                        f"| {tp} | {B} | {ctx} | {r['kind']} | {r['eager_ms']:.3f} | {r['graph_ms']:.3f} | "
                        + " | ".join(f"{r[f'graph_{form}_ms']:.3f}" for form in BEFORE_FORMS)
                        + " | "
                        f"{r['kernel_sum_ms']:.3f} | {r['graph_speedup']:.2f} | "
                        f"{r['graph_vs_kernel_sum']:.2f} |",
                        flush=True,
                    )
                tail = head_and_sampler_ms(B, tp, g)

                def tpot_of(key: str, per: dict = per, tail: float = tail) -> float:
                    return stack_ms(per, key, a.swa_fraction) + tail

                tpot = tpot_of("graph_ms")
                row = {"tp": tp, "B": B, "ctx": ctx, "tpot_ms": tpot}
                row.update({f"tpot_{form}_ms": tpot_of(f"graph_{form}_ms") for form in BEFORE_FORMS})
                proj.append({**row, "tok_s_per_gpu": B / tpot * 1e3 / tp, "tail_ms": tail})
    print("\nProjected decode (61 layers, graph replay, + LM head and sampler; no all-reduce):")
    print("| TP | B | ctx | ms / token | " + " | ".join(BEFORE_FORMS.values()) + " | tokens/s per GPU |")
    print("|---" * (5 + len(BEFORE_FORMS)) + "|")
    for p in proj:
        before = " | ".join(f"{p[f'tpot_{form}_ms']:.2f}" for form in BEFORE_FORMS)
        print(f"| {p['tp']} | {p['B']} | {p['ctx']} | {p['tpot_ms']:.2f} | {before} | {p['tok_s_per_gpu']:.0f} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(
                {
                    "layers": rows,
                    "projection": proj,
                    "window": a.window,
                    "swa_fraction": a.swa_fraction,
                    "route_check": check,
                },
                fh,
            )


if __name__ == "__main__":
    main()
