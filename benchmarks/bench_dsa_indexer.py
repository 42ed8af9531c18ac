"""H200: DSA's index logits (``ops/triton_ops/lightning_indexer_kernel.py``) beside DeepGEMM's
``fp8_paged_mqa_logits`` (decode rows over the paged cache) and ``fp8_mqa_logits`` (a prefill
chunk over gathered keys), at DeepSeek-V3.2's shapes: 64 index heads x 128, e4m3 keys with a
float32 scale each in 64-token pages (132 bytes a token), e4m3 queries with their scale in the
head weights; the top 2048 (the project's Triton top-k: ties to the lower position) beside ``torch.topk``.

Counts (METHOD.md): FLOPs 2 x 64 x 128 a (query, visible key); bytes: each visible key's 132
bytes once a request (decode: once a query), q and w once, 4 bytes of logit a (query, key)
written. Ceilings of the same run: device copy GB/s and e4m3 row-wise GEMM TFLOP/s.

    PYTHONPATH=~/deepgemm python benchmarks/bench_dsa_indexer.py [--json OUT] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import bench_ms, copy_gbps, fp8_rowwise_tflops, rel_err  # noqa: E402

from fastdeploy.model_executor.ops.triton_ops.lightning_indexer_kernel import (  # noqa: E402
    launch_index_logits,
    launch_index_topk,
)

H, D, BS, TOPK = 64, 128, 64, 2048


def fp8_keys(n: int):
    """n random keys as e4m3 codes and power-of-two scales -> (codes uint8 [n, D], scale [n])."""
    k = torch.randn(n, D, device="cuda")
    amax = k.abs().amax(-1).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    return (k / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8), scale


def paged_cache(codes, scale):
    """Pages of 64 keys: [pages, 64, 1, 132] uint8, codes then scales (DeepGEMM's layout)."""
    n = codes.shape[0]
    pages = n // BS
    flat = torch.empty(pages, BS * (D + 4), dtype=torch.uint8, device="cuda")
    flat[:, : BS * D] = codes.view(pages, BS * D)
    flat[:, BS * D :] = scale.view(pages, BS).view(torch.uint8).view(pages, BS * 4)
    return flat.view(pages, BS, 1, D + 4)


def decode_case(B: int, ctx: int, dg) -> dict:
    nb = ctx // BS
    codes, scale = fp8_keys(B * ctx)
    cache = paged_cache(codes, scale)
    table = torch.randperm(B * nb, device="cuda", dtype=torch.int32).view(B, nb)
    q = torch.randn(B, H, D, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(B, H, device="cuda") * H**-0.5 * D**-0.5
    krow = torch.arange(B, device="cuda", dtype=torch.int32)
    ends = torch.full((B,), ctx, device="cuda", dtype=torch.int64)
    out = torch.full((B, ctx), float("nan"), device="cuda")

    def ours():
        launch_index_logits(q, w, cache, table, krow, ends, out, BS, True, dot_fp8=True)

    ours()
    assert not out.isnan().any()
    row = {"B": B, "ctx": ctx, "ours_ms": bench_ms(ours, mode="median")}
    flops, nbytes = 2 * H * D * B * ctx, B * ctx * (D + 4) + B * ctx * 4 + B * H * (D + 4)
    row["ours_tflops"], row["ours_gbps"] = flops / row["ours_ms"] / 1e9, nbytes / row["ours_ms"] / 1e6
    if dg is not None:
        ctx_lens = torch.full((B, 1), ctx, device="cuda", dtype=torch.int32)
        meta = dg.get_paged_mqa_logits_metadata(ctx_lens, BS, dg.get_num_sms())

        def theirs():
            return dg.fp8_paged_mqa_logits(q.view(B, 1, H, D), cache, w, ctx_lens, table, meta, ctx, False, None)

        ref = theirs()
        row["err_vs_deepgemm"] = rel_err(out, ref[:, :ctx].float())
        row["deepgemm_ms"] = bench_ms(theirs, mode="median")
        row["ratio_to_deepgemm"] = row["deepgemm_ms"] / row["ours_ms"]
    picked = torch.full((B, TOPK), -2, device="cuda", dtype=torch.int32)
    launch_index_topk(out, ends, picked)
    want = torch.topk(out, TOPK, dim=1).indices
    row["topk_same_sets"] = bool((picked.sort(1).values == want.sort(1).values.to(torch.int32)).all())
    row["topk_ms"] = bench_ms(lambda: launch_index_topk(out, ends, picked), mode="median")
    row["torch_topk_ms"] = bench_ms(lambda: torch.topk(out, TOPK, dim=1), mode="median")
    return row


def prefill_case(T: int, ctx: int, dg) -> dict:
    """One request's chunk of T queries at positions ctx - T .. ctx - 1 (causal)."""
    codes, scale = fp8_keys(ctx)
    cache = paged_cache(codes, scale)
    nb = ctx // BS
    table = torch.randperm(nb, device="cuda", dtype=torch.int32).view(1, nb)
    pos = torch.arange(ctx - T, ctx, device="cuda")
    q = torch.randn(T, H, D, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(T, H, device="cuda") * H**-0.5 * D**-0.5
    krow = torch.zeros(T, device="cuda", dtype=torch.int32)
    ends = (pos + 1).to(torch.int64)
    out = torch.full((T, ctx), float("nan"), device="cuda")

    def ours():
        launch_index_logits(q, w, cache, table, krow, ends, out, BS, True, dot_fp8=True)

    ours()
    row = {"T": T, "ctx": ctx, "ours_ms": bench_ms(ours, mode="median")}
    visible = int(ends.sum())
    flops, nbytes = 2 * H * D * visible, ctx * (D + 4) + T * ctx * 4 + T * H * (D + 4)
    row["ours_tflops"], row["ours_gbps"] = flops / row["ours_ms"] / 1e9, nbytes / row["ours_ms"] / 1e6
    if dg is not None:
        # DeepGEMM reads the keys gathered in position order: codes [ctx, D] e4m3 and scales [ctx]
        slots = table[0].long()[torch.arange(ctx, device="cuda") // BS] * BS + torch.arange(ctx, device="cuda") % BS
        flat = cache.view(-1, BS * (D + 4))
        g_codes = flat[:, : BS * D].reshape(-1, D)[slots].view(torch.float8_e4m3fn).contiguous()
        g_scale = flat[:, BS * D :].contiguous().view(torch.float32).reshape(-1)[slots].contiguous()
        ks = torch.zeros(T, device="cuda", dtype=torch.int32)
        ke = ends.to(torch.int32)

        def theirs():
            return dg.fp8_mqa_logits(q, (g_codes, g_scale), w, ks, ke, False, 0)

        ref = theirs()
        valid = torch.arange(ctx, device="cuda")[None, :] < ends[:, None]
        row["err_vs_deepgemm"] = rel_err(out[valid], ref[:, :ctx][valid].float())
        row["deepgemm_ms"] = bench_ms(theirs, mode="median")
        row["ratio_to_deepgemm"] = row["deepgemm_ms"] / row["ours_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    try:
        import deep_gemm as dg
    except ImportError as e:
        print(f"deep_gemm does not import ({e}): ours alone")
        dg = None
    res = {"device": torch.cuda.get_device_name(), "copy_gbps": copy_gbps(), "fp8_tflops": fp8_rowwise_tflops()}
    res["decode"], res["prefill"] = [], []
    for B in (1, 32, 128):
        for ctx in (4096, 32768) if a.quick else (4096, 32768, 131072):
            res["decode"].append(decode_case(B, ctx, dg))
            print(json.dumps(res["decode"][-1]), flush=True)
    for ctx in (4096, 32768):
        res["prefill"].append(prefill_case(2048, ctx, dg))
        print(json.dumps(res["prefill"][-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{res['device']}: copy {res['copy_gbps']:.0f} GB/s, e4m3 GEMM {res['fp8_tflops']:.0f} TFLOP/s")
    print("decode  B    ctx   ours ms  GB/s  TFLOP/s  DeepGEMM ms  ratio  err      topk ms  torch.topk ms same")
    for r in res["decode"]:
        print(
            f"       {r['B']:4d} {r['ctx']:6d} {r['ours_ms']:8.4f} {r['ours_gbps']:6.0f} {r['ours_tflops']:6.1f}"
            f"  {r.get('deepgemm_ms', float('nan')):10.4f} {r.get('ratio_to_deepgemm', float('nan')):6.2f}"
            f"  {r.get('err_vs_deepgemm', float('nan')):.1e} {r['topk_ms']:8.4f} {r['torch_topk_ms']:8.4f}"
            f" {r['topk_same_sets']}"
        )
    print("prefill T    ctx   ours ms  GB/s  TFLOP/s  DeepGEMM ms  ratio  err")
    for r in res["prefill"]:
        print(
            f"       {r['T']:4d} {r['ctx']:6d} {r['ours_ms']:8.4f} {r['ours_gbps']:6.0f} {r['ours_tflops']:6.1f}"
            f"  {r.get('deepgemm_ms', float('nan')):10.4f} {r.get('ratio_to_deepgemm', float('nan')):6.2f}"
            f"  {r.get('err_vs_deepgemm', float('nan')):.1e}"
        )


if __name__ == "__main__":
    main()
