"""H200: MLA prefill in MHA form (``mla_prefill_kernel``) beside FlexAttention with the same
sliding-window mask and FlashMLA's sparse prefill, on the same bf16 inputs; full layers' decode on
the sparse kernel's bf16-cache variant beside FlashMLA's dense decode; torch CUDA tensors (no
paddle on the GPU host).

    python benchmarks/bench_mla_prefill.py [--json OUT] [--sweep]

Prefill cases: C = 4096 or 8192 new tokens after 4096 of context, H = 128 and 16, W = 128, 1024,
4096. The keys in view are the window before the chunk plus the chunk (S = W - 1 + C). "all in"
adds decompressing the keys in view from the 512-wide latent through W_UK / W_UV (one bf16 matmul
each); "backend" is what an SWA layer runs: gather the window's FP8 records from a paged cache,
de-quantize them (Triton), decompress, attend. "absorbed" is our sparse MLA kernel over the same
FP8 cache with the window as indices (what the SWA layer ran before the MHA form). FLOPs count the
MHA form over the keys each query sees: 2 * H * sum(visible) * (192 + 128). Every row is checked
against float32 torch on the last 64 queries (over the de-quantized keys for the FP8 paths).

Decode cases: B requests of one token each over a whole bf16 context of 4K or 32K tokens, 128
heads: our kernel (CACHE_BF16, whole-context indices) and FlashMLA's dense bf16 decode on the same
paged cache. FLOPs 2 * B * H * ctx * (576 + 512); bytes B * ctx * 1152 (the cache read once per
request). The bf16 matmul ceiling and the copy bandwidth are measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import bench_ms as bench  # noqa: E402
from common import bf16_tflops, copy_gbps, rel_err  # noqa: E402

from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache_kernel import (  # noqa: E402
    launch_dequant_mla_fp8_cache,
    launch_write_mla_fp8_cache,
)
from fastdeploy.model_executor.ops.triton_ops.mla_prefill_kernel import launch_mla_prefill  # noqa: E402
from fastdeploy.model_executor.ops.triton_ops.sparse_mla_kernel import (  # noqa: E402
    default_num_splits,
    launch_sparse_mla,
    tuned_config,
)

DEV = "cuda"
SCALE = 0.1352


def mha_reference(q, k, kr, v, qi, qpos, kpos, W):
    """float32 MHA attention of queries qi (positions qpos) over keys at kpos, window W."""
    H, S = q.shape[1], k.shape[0]
    seen = (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - W)
    kf = torch.cat([k.float(), kr.float()[:, None, :].expand(S, H, 64)], -1)
    s = torch.einsum("thd,shd->hts", q[qi].float(), kf) * SCALE
    p = torch.softmax(s.masked_fill(~seen[None], float("-inf")), -1)
    return torch.einsum("hts,shd->thd", p, v.float())


def case(C: int, H: int, W: int, ctx: int, g: torch.Generator, cfg: dict | None = None) -> dict:
    S = W - 1 + C
    r = lambda *s: torch.randn(*s, device=DEV, dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, latent, kr = r(C, H, 192), r(S, 512), r(S, 64)
    w_uk, w_uv = r(H, 128, 512) * 0.05, r(H, 128, 512) * 0.05

    def decompress():
        k = torch.einsum("sc,hdc->shd", latent, w_uk)
        v = torch.einsum("sc,hdc->shd", latent, w_uv)
        return k.contiguous(), v.contiguous()

    k, v = decompress()
    out = torch.empty(C, H, 128, device=DEV, dtype=torch.bfloat16)
    i32 = lambda x: torch.tensor(x, device=DEV, dtype=torch.int32)  # noqa: E731
    cu_q, cu_k, qs, ks = i32([0, C]), i32([0, S]), i32([ctx]), i32([ctx - W + 1])

    cfg = cfg or {}

    def ours():
        launch_mla_prefill(q, k, kr, v, out, cu_q, cu_k, qs, ks, SCALE, W, C, **cfg)

    def ours_all_in():
        kk, vv = decompress()
        launch_mla_prefill(q, kk, kr, vv, out, cu_q, cu_k, qs, ks, SCALE, W, C, **cfg)

    ours()
    # float32 reference on the last 64 queries
    qi = torch.arange(C - 64, C, device=DEV)
    qi_all = torch.arange(C, device=DEV)
    qpos, kpos = ctx + qi, ctx - W + 1 + torch.arange(S, device=DEV)
    want = mha_reference(q, k, kr, v, qi, qpos, kpos, W)
    err = rel_err(out[qi], want)

    visible = sum(min(W, ctx + i + 1) for i in range(C))
    flops = 2 * H * visible * (192 + 128)
    row = {"C": C, "H": H, "W": W, "config": cfg, "rel_err": err, "correct": err < 2e-2}
    row["flops"] = flops
    if cfg:  # a sweep row: the kernel only
        row["ours_ms"] = bench(ours)
        row["ours_tflops"] = flops / row["ours_ms"] / 1e9
        return row
    row["ours_ms"] = bench(ours)
    row["ours_all_in_ms"] = bench(ours_all_in)
    row["ours_tflops"] = flops / row["ours_ms"] / 1e9

    # The SWA layer's path: the window's FP8 records in a paged cache (slots shuffled), gathered,
    # de-quantized, decompressed, attended; and the absorbed form over the same records.
    n_slots = 3 * S
    records = torch.empty(n_slots, 656, device=DEV, dtype=torch.uint8)
    slots = torch.randperm(n_slots, device=DEV, generator=g)[:S].to(torch.int32)
    launch_write_mla_fp8_cache(latent, kr, slots, records)
    lat8 = torch.empty(S, 576, device=DEV, dtype=torch.bfloat16)
    slots64 = slots.long()

    def backend():
        launch_dequant_mla_fp8_cache(records.index_select(0, slots64), lat8)
        lat = lat8[:, :512]
        kk = (lat @ w_uk.reshape(H * 128, 512).T).view(S, H, 128)
        vv = (lat @ w_uv.reshape(H * 128, 512).T).view(S, H, 128)
        launch_mla_prefill(q, kk, lat8[:, 512:], vv, out, cu_q, cu_k, qs, ks, SCALE, W, C, **cfg)

    backend()
    k8 = torch.einsum("sc,hdc->shd", lat8[:, :512].float(), w_uk.float())
    v8 = torch.einsum("sc,hdc->shd", lat8[:, :512].float(), w_uv.float())
    want8 = mha_reference(q, k8, lat8[:, 512:], v8, qi, qpos, kpos, W)
    row["backend_rel_err"] = rel_err(out[qi], want8)
    row["backend_ms"] = bench(backend)

    q_abs = torch.cat([torch.einsum("thd,hdc->thc", q[:, :, :128].float(), w_uk.float()), q[:, :, 128:].float()], -1)
    q_abs = q_abs.to(torch.bfloat16).contiguous()
    t_w = torch.arange(W, device=DEV)[None]
    view_idx = qi_all[:, None] + t_w  # query i sees view keys i .. i + W - 1
    abs_idx = slots[view_idx.clamp(max=S - 1)].masked_fill(view_idx >= S, -1).to(torch.int32).contiguous()
    lat_out = torch.empty(C, H, 512, device=DEV, dtype=torch.bfloat16)
    lse = torch.empty(C, H, device=DEV, dtype=torch.float32)
    sc = tuned_config(C, H)
    ns = default_num_splits(C, H, W, sc["block_h"], sc["block_n"])
    part = torch.empty(C, ns, H, 512, device=DEV) if ns > 1 else None
    part_l = torch.empty(C, ns, H, device=DEV) if ns > 1 else None

    def absorbed():
        launch_sparse_mla(q_abs, records, abs_idx, lat_out, lse, SCALE, num_splits=ns, partial=part, partial_lse=part_l)

    absorbed()
    got_abs = torch.einsum("thc,hdc->thd", lat_out[qi].float(), w_uv.float())
    row["absorbed_rel_err"] = rel_err(got_abs, want8)
    row["absorbed_ms"] = bench(absorbed)

    try:  # FlashMLA's sparse prefill: the absorbed form over the same window, as the SWA path runs it today
        import flash_mla

        hp = 64 if H <= 64 else 128
        q_abs = torch.cat([torch.einsum("thd,hdc->thc", q[:, :, :128], w_uk), q[:, :, 128:]], -1)
        q_abs = torch.cat([q_abs, q_abs.new_zeros(C, hp - H, 576)], 1) if hp != H else q_abs.contiguous()
        cache = torch.cat([latent, kr], -1)  # [S, 576] bf16: the keys in view, de-quantized
        pool = torch.cat([cache, r(2 * S, 576)])[torch.randperm(3 * S, device=DEV, generator=g)]  # a paged cache
        where = torch.argsort(torch.randperm(3 * S, device=DEV, generator=g))[:S]
        pool[where] = cache
        topk = -(-W // 128) * 128
        t = torch.arange(topk, device=DEV)[None]
        idx = torch.where(t < W, qi_all[:, None] + t, -1)  # query i sees keys i .. i + W - 1 of the view
        idx = idx.to(torch.int32)[:, None, :].contiguous()
        kv = cache[:, None, :].contiguous()

        def flashmla():
            return flash_mla.flash_mla_sparse_fwd(q_abs, kv, idx, SCALE, 512)

        def flashmla_gather():  # the window's rows gathered from the paged cache first
            g_kv = pool.index_select(0, where)[:, None, :]
            return flash_mla.flash_mla_sparse_fwd(q_abs, g_kv, idx, SCALE, 512)

        fo = torch.einsum("thc,hdc->thd", flashmla()[0][:, :H].float(), w_uv.float())
        row["flashmla_rel_err"] = rel_err(fo[qi], want)
        row["flashmla_ms"] = bench(flashmla)
        row["flashmla_gather_ms"] = bench(flashmla_gather)
    except Exception as e:  # noqa: BLE001 - reported, the rest still runs
        row["flashmla_error"] = repr(e)[:300]
    try:  # FlexAttention, MHA form, the same window
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        k0 = ctx - W + 1

        def mask(b, h, qi, kj):
            return (kj + k0 <= qi + ctx) & (kj + k0 > qi + ctx - W)

        bm = create_block_mask(mask, None, None, C, S, device=DEV)
        flex = torch.compile(flex_attention)
        qt = q.transpose(0, 1)[None]
        kt = torch.cat([k, kr[:, None, :].expand(S, H, 64)], -1).transpose(0, 1)[None].contiguous()
        vt = v.transpose(0, 1)[None].contiguous()
        got = flex(qt, kt, vt, block_mask=bm, scale=SCALE)[0].transpose(0, 1)
        row["flex_rel_err"] = rel_err(got[qi], want)
        row["flex_ms"] = bench(lambda: flex(qt, kt, vt, block_mask=bm, scale=SCALE))
        row["flex_tflops"] = flops / row["flex_ms"] / 1e9
    except Exception as e:  # noqa: BLE001 - reported, the rest still runs
        row["flex_error"] = repr(e)[:300]
    errs = [
        row[k]
        for k in ("rel_err", "backend_rel_err", "absorbed_rel_err", "flashmla_rel_err", "flex_rel_err")
        if k in row
    ]
    row["correct"] = max(errs) < 2e-2
    return row


def decode_case(B: int, H: int, ctx: int, g: torch.Generator, page: int = 64) -> dict:
    """Full-layer decode: B requests at position ctx - 1, bf16 paged cache, 128 heads."""
    blocks = B * ctx // page
    cache = (torch.randn(blocks + 8, page, 1, 576, device=DEV, generator=g) * 0.5).to(torch.bfloat16)
    table = (torch.randperm(blocks, device=DEV, generator=g) + 8).view(B, ctx // page).to(torch.int32)
    pos = torch.arange(ctx, device=DEV)
    idx = (table.long()[:, pos // page] * page + pos % page).to(torch.int32).contiguous()  # whole context
    q = torch.randn(B, H, 576, device=DEV, dtype=torch.bfloat16, generator=g)
    out = torch.empty(B, H, 512, device=DEV, dtype=torch.bfloat16)
    lse = torch.empty(B, H, device=DEV, dtype=torch.float32)
    sc = tuned_config(B, H)
    ns = default_num_splits(B, H, ctx, sc["block_h"], sc["block_n"])
    part = torch.empty(B, ns, H, 512, device=DEV) if ns > 1 else None
    part_l = torch.empty(B, ns, H, device=DEV) if ns > 1 else None

    def ours():
        launch_sparse_mla(q, cache, idx, out, lse, SCALE, num_splits=ns, partial=part, partial_lse=part_l)

    ours()
    flat = cache.view(-1, 576)
    want = {}
    for b in (0, B - 1):  # float32 reference for two requests
        kv = flat[idx[b].long()].float()
        want[b] = torch.softmax(q[b].float() @ kv.T * SCALE, -1) @ kv[:, :512]
    errs = [rel_err(out[b], w) for b, w in want.items()]
    flops = 2 * B * H * ctx * (576 + 512)
    row = {"B": B, "H": H, "ctx": ctx, "num_splits": ns, "rel_err": max(errs), "flops": flops}
    row["bytes"] = B * ctx * 576 * 2
    row["ours_ms"] = bench(ours)
    row["ours_tflops"] = flops / row["ours_ms"] / 1e9
    row["ours_gbps"] = row["bytes"] / row["ours_ms"] / 1e6
    try:
        import flash_mla

        seqlens = torch.full((B,), ctx, device=DEV, dtype=torch.int32)
        sched, _ = flash_mla.get_mla_metadata()
        q4 = q[:, None].contiguous()

        def fm():
            return flash_mla.flash_mla_with_kvcache(
                q4, cache, table, seqlens, 512, sched, softmax_scale=SCALE, causal=True
            )

        fo = fm()[0][:, 0]
        row["flashmla_rel_err"] = max(rel_err(fo[b], w) for b, w in want.items())
        row["flashmla_ms"] = bench(fm)
        row["flashmla_tflops"] = flops / row["flashmla_ms"] / 1e9
    except Exception as e:  # noqa: BLE001 - reported, the rest still runs
        row["flashmla_error"] = repr(e)[:300]
    row["correct"] = row["rel_err"] < 2e-2 and row.get("flashmla_rel_err", 0) < 2e-2
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true", help="tile configs on the W 4096 cases instead")
    args = ap.parse_args()
    g = torch.Generator(device=DEV).manual_seed(0)
    if args.sweep:
        rows = []
        for H in (128, 16):
            for bm, bn, nw, ns in (
                (64, 64, 4, 2),
                (64, 64, 4, 3),
                (128, 64, 8, 2),
                (128, 64, 8, 3),
                (128, 128, 8, 2),
                (64, 128, 4, 2),
                (128, 32, 4, 3),
            ):
                cfg = dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
                try:
                    rows.append(case(4096, H, 4096, 4096, g, cfg))
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                    rows.append({"H": H, "config": cfg, "error": repr(e)[:200]})
                print(json.dumps(rows[-1]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    res = {
        "device": torch.cuda.get_device_name(),
        "bf16_matmul_tflops": bf16_tflops(),
        "copy_gbps": copy_gbps(),
        "rows": [],
        "decode": [],
    }
    for C in (4096, 8192):
        for H in (128, 16):
            for W in (128, 1024, 4096):
                res["rows"].append(case(C, H, W, 4096, g))
                print(json.dumps(res["rows"][-1]), flush=True)
    for ctx in (4096, 32768):
        for B in (64, 128):
            res["decode"].append(decode_case(B, 128, ctx, g))
            print(json.dumps(res["decode"][-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"bf16 matmul ceiling {res['bf16_matmul_tflops']:.0f} TFLOP/s, copy {res['copy_gbps']:.0f} GB/s")
    head = (
        "C",
        "H",
        "W",
        "ok",
        "ours ms",
        "all in",
        "backend",
        "absorbed",
        "TFLOP/s",
        "flex ms",
        "FlashMLA",
        "+gather",
    )
    print(" ".join(f"{h:>8}" for h in head))
    nan = float("nan")
    for r in res["rows"]:
        keys = ("ours_ms", "ours_all_in_ms", "backend_ms", "absorbed_ms", "ours_tflops", "flex_ms")
        vals = [r.get(k, nan) for k in keys] + [r.get("flashmla_ms", nan), r.get("flashmla_gather_ms", nan)]
        lead = f"{r['C']:8} {r['H']:8} {r['W']:8} {'y' if r['correct'] else 'N':>8} "
        print(lead + " ".join(f"{v:8.3f}" for v in vals))
    print("full-layer decode, bf16 cache, 128 heads")
    print(" ".join(f"{h:>9}" for h in ("ctx", "B", "ok", "ours ms", "TFLOP/s", "GB/s", "FlashMLA", "TFLOP/s", "ratio")))
    for r in res["decode"]:
        fm = r.get("flashmla_ms", nan)
        vals = (r["ours_ms"], r["ours_tflops"], r["ours_gbps"], fm, r.get("flashmla_tflops", nan), fm / r["ours_ms"])
        print(f"{r['ctx']:9} {r['B']:9} {'y' if r['correct'] else 'N':>9} " + " ".join(f"{v:9.3f}" for v in vals))


if __name__ == "__main__":
    main()
