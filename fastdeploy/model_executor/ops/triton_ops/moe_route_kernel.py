"""DeepSeek-V3's expert routing (sigmoid scores, ``noaux_tc`` group-limited top-k) as one Triton
launch (docs/design.md §4.8), paddle-free. The paddle form (``layers/moe.py``, ``MoEGate``) runs
about fifteen small launches after the router GEMM for the same math, once a MoE layer a step.

For a token's router logits z [E] (float32), with experts in n_group groups of G = E / n_group:
s = sigmoid(z); c = s + bias; a group's score is the sum of its top min(2, G) values of c; the
topk_group best groups stay, the others' experts are masked; the top_k unmasked experts by c are
chosen, weighted by s (divided by their sum when ``norm``, then times ``scale``). Ties go to the
lower index.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops.launcher import launch, stride


@triton.jit
def _moe_route_kernel(
    Z,
    Bias,
    Ids,
    W,
    E,
    G,
    sz,
    scale,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program a token: Ids int64 [T, TOP_K], W float32 [T, TOP_K]."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    z = tl.load(Z + t * sz + e, mask=ok, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-z))
    c = tl.where(ok, s + tl.load(Bias + e, mask=ok, other=0.0).to(tl.float32), float("-inf"))
    g = tl.arange(0, BLOCK_G)
    member = (e[None, :] // G == g[:, None]) & ok[None, :] & (g < N_GROUP)[:, None]  # [groups, experts]
    by_group = tl.where(member, c[None, :], float("-inf"))
    first = tl.max(by_group, 1)
    at = tl.argmax(by_group, 1)
    second = tl.max(tl.where(e[None, :] == at[:, None], float("-inf"), by_group), 1)
    score = first + tl.where(G >= 2, second, 0.0)
    score = tl.where(g < N_GROUP, score, float("-inf"))
    kept = tl.zeros([BLOCK_G], tl.int1)
    for _ in tl.static_range(TOPK_GROUP):  # the best groups, one at a time
        best = tl.argmax(tl.where(kept, float("-inf"), score), 0)
        kept = kept | (g == best)
    allowed = tl.max((member & kept[:, None]).to(tl.int32), 0) > 0
    cand = tl.where(allowed, c, float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int64)
    ws = tl.zeros([BLOCK_K], tl.float32)
    for k in tl.static_range(TOP_K):  # the best experts, one at a time
        j = tl.argmax(cand, 0)
        ids = tl.where(kk == k, j.to(tl.int64), ids)
        ws = tl.where(kk == k, tl.sum(tl.where(e == j, s, 0.0), 0), ws)
        cand = tl.where(e == j, float("-inf"), cand)
    if NORM:
        ws = ws / (tl.sum(ws, 0) + 1e-20)
    tl.store(Ids + t * TOP_K + kk, ids, mask=kk < TOP_K)
    tl.store(W + t * TOP_K + kk, ws * scale, mask=kk < TOP_K)


def launch_moe_route(
    logits, bias, ids, weights, n_group: int, topk_group: int, norm: bool, scale: float, num_warps: int = 1
) -> None:
    """logits float32 [T, E] (the router GEMM's), bias [E] -> ids int64 [T, top_k], weights
    float32 [T, top_k] (top_k = ids.shape[1]). One warp a token: its reductions run serially, and
    on the H200 one warp took 5.6 us at batch 1 against 7.2 with four
    (results/h200_2026-12-04_small_kernels.json)."""
    T, E = int(logits.shape[0]), int(logits.shape[1])
    top_k = int(ids.shape[1])
    if T == 0:
        return
    launch(
        _moe_route_kernel,
        (T,),
        logits,
        bias,
        ids,
        weights,
        E,
        E // n_group,
        stride(logits, 0),
        float(scale),
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        NORM=norm and top_k > 1,
        BLOCK_E=max(16, triton.next_power_of_2(E)),
        BLOCK_G=max(2, triton.next_power_of_2(n_group)),
        BLOCK_K=max(2, triton.next_power_of_2(top_k)),
        num_warps=num_warps,
    )
