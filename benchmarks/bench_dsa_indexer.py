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
    launch_index_key_write,
    launch_index_logits,
    launch_index_topk,
)
from fastdeploy.model_executor.ops.triton_ops.sparse_mla_kernel import (  # noqa: E402
    default_num_splits,
    launch_sparse_mla,
    tuned_config,
)

H, D, BS, TOPK = 64, 128, 64, 2048
# (block_n, sub_n, num_warps, keys_m) of the logits kernel, each timed beside the library's tiling
TILINGS = [(64, 64, 4, False), (512, 64, 8, False), (1024, 64, 8, False), (64, 64, 4, True), (512, 64, 4, True),
           (512, 64, 8, True), (1024, 64, 8, True), (512, 128, 8, True)]  # fmt: skip
TOPK_TILES = [(2048, 4), (4096, 8), (8192, 16)]  # (tile, num_warps)


BEFORE = {}  # --before FILE: an earlier lightning_indexer_kernel.py, timed beside at decode


def load_before(path: str) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("lightning_indexer_kernel_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    BEFORE["mod"] = mod


def variants(launch_with, configs) -> dict:
    """Median ms of ``launch_with(cfg)`` for each config (a failure recorded as its message)."""
    out = {}
    for cfg in configs:
        try:
            launch_with(cfg)
            out[str(cfg)] = bench_ms(lambda c=cfg: launch_with(c), mode="median")
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
            out[str(cfg)] = repr(e)[:120]
    return out


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


def page_views(cache):
    """A paged index cache as per-slot views: e4m3 codes uint8 [slots, D], scales float32 [slots]."""
    flat = cache.view(-1, BS * (D + 4))
    return flat[:, : BS * D].reshape(-1, D), flat[:, BS * D :].contiguous().view(torch.float32).reshape(-1)


def position_slots(table, ctx: int):
    """Each table row's cache slots of positions 0..ctx-1: int64 [rows, ctx]."""
    pos = torch.arange(ctx, device="cuda")
    return table.long()[:, pos // BS] * BS + pos % BS


def same_sets(picked, want) -> bool:
    """Whether each row of two picks holds the same positions, in any order."""
    return bool((picked.sort(1).values == want.sort(1).values.to(torch.int32)).all())


def decode_rows(B: int, ctx: int):
    """B requests at context ctx, one decode query each: (cache, block table int32 [B, ctx / 64],
    q e4m3 [B, H, D], w float32 [B, H], krow int32 [B], ends int64 [B]), pages in random order."""
    nb = ctx // BS
    cache = paged_cache(*fp8_keys(B * ctx))
    table = torch.randperm(B * nb, device="cuda", dtype=torch.int32).view(B, nb)
    q = torch.randn(B, H, D, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(B, H, device="cuda") * H**-0.5 * D**-0.5
    krow = torch.arange(B, device="cuda", dtype=torch.int32)
    ends = torch.full((B,), ctx, device="cuda", dtype=torch.int64)
    return cache, table, q, w, krow, ends


def decode_case(B: int, ctx: int, dg) -> dict:
    cache, table, q, w, krow, ends = decode_rows(B, ctx)
    out = torch.full((B, ctx), float("nan"), device="cuda")

    def ours(cfg=(None, None, None, None)):  # the library's tiling unless given
        launch_index_logits(q, w, cache, table, krow, ends, out, BS, True, cfg[0], True, *cfg[1:])

    ours()
    assert not out.isnan().any()
    row = {"B": B, "ctx": ctx, "ours_ms": bench_ms(ours, mode="median"), "tilings": variants(ours, TILINGS)}
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
    row["topk_same_sets"] = same_sets(picked, want)
    row["topk_ms"] = bench_ms(lambda: launch_index_topk(out, ends, picked), mode="median")
    row["topk_tiles"] = variants(lambda c: launch_index_topk(out, ends, picked, *c), TOPK_TILES)
    if BEFORE:
        old = BEFORE["mod"]
        row["before_ms"] = bench_ms(
            lambda: old.launch_index_logits(q, w, cache, table, krow, ends, out, BS, True, dot_fp8=True), mode="median"
        )
        row["before_topk_ms"] = bench_ms(lambda: old.launch_index_topk(out, ends, picked), mode="median")
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

    def ours(cfg=(None, None, None, None)):  # the library's tiling unless given
        launch_index_logits(q, w, cache, table, krow, ends, out, BS, True, cfg[0], True, *cfg[1:])

    ours()
    row = {"T": T, "ctx": ctx, "ours_ms": bench_ms(ours, mode="median"), "tilings": variants(ours, TILINGS)}
    visible = int(ends.sum())
    flops, nbytes = 2 * H * D * visible, ctx * (D + 4) + T * ctx * 4 + T * H * (D + 4)
    row["ours_tflops"], row["ours_gbps"] = flops / row["ours_ms"] / 1e9, nbytes / row["ours_ms"] / 1e6
    if dg is not None:
        # DeepGEMM reads the keys gathered in position order: codes [ctx, D] e4m3 and scales [ctx]
        slots = position_slots(table, ctx)[0]
        codes, scales = page_views(cache)
        g_codes = codes[slots].view(torch.float8_e4m3fn).contiguous()
        g_scale = scales[slots].contiguous()
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


def random_records(n: int) -> torch.Tensor:
    """n FP8 MLA records uint8 [n, 656]: finite e4m3 codes (no NaN pattern), four power-of-two
    float32 scales, 64 bf16 rope values."""
    rec = torch.empty(n, 656, dtype=torch.uint8, device="cuda")
    codes = torch.randint(0, 0x7E, (n, 512), dtype=torch.uint8, device="cuda")
    rec[:, :512] = codes | (torch.randint(0, 2, (n, 512), dtype=torch.uint8, device="cuda") << 7)
    rec[:, 512:528] = torch.full((n, 4), 2.0**-8, device="cuda").view(torch.uint8)
    rec[:, 528:] = torch.randn(n, 64, device="cuda").bfloat16().view(torch.uint8)
    return rec


def layer_case(B: int, ctx: int, heads: int, fm) -> dict:
    """The DSA layer's attention at decode: index logits over the paged index keys, the top 2048,
    positions to slots, sparse MLA over the picked FP8 records (heads x 576), as the backend runs
    them; beside FlashMLA's sparse decode alone over the same slots. Both as CUDA-graph replays."""
    icache, table, qi, w, krow, ends = decode_rows(B, ctx)
    mla = random_records(B * ctx).view(B * (ctx // BS), BS, 1, 656)
    logits = torch.empty(B, ctx, device="cuda")
    picked = torch.empty(B, TOPK, device="cuda", dtype=torch.int32)
    q = (torch.randn(B, heads, 576, device="cuda") * 0.5).bfloat16()
    out = torch.empty(B, heads, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(B, heads, device="cuda")
    cfg = tuned_config(B, heads)
    ns = default_num_splits(B, heads, TOPK, cfg["block_h"], cfg["block_n"])
    part = torch.empty(B, ns, heads, 512, device="cuda") if ns > 1 else None
    part_l = torch.empty(B, ns, heads, device="cuda") if ns > 1 else None
    slots = torch.empty(B, TOPK, device="cuda", dtype=torch.int32)
    scale = 576**-0.5

    def pick():
        launch_index_logits(qi, w, icache, table, krow, ends, logits, BS, True, dot_fp8=True)
        launch_index_topk(logits, ends, picked)
        at = picked.long().clamp(min=0)
        blk = torch.gather(table.long(), 1, at // BS)
        slots.copy_(torch.where(picked >= 0, blk * BS + at % BS, -1))

    def attend():
        launch_sparse_mla(q, mla, slots, out, lse, scale, num_splits=ns, partial=part, partial_lse=part_l)

    def layer():
        pick()
        attend()

    layer()
    row = {"B": B, "ctx": ctx, "heads": heads, "num_splits": ns}
    row["pick_ms"] = bench_ms(pick, graph=True)
    row["attend_ms"] = bench_ms(attend, graph=True)
    row["layer_ms"] = bench_ms(layer, graph=True)
    if fm is not None:
        sched, _ = fm.get_mla_metadata()
        q4, idx = q[:, None].contiguous(), slots[:, None].contiguous()

        def flash():
            return fm.flash_mla_with_kvcache(q4, mla, None, None, 512, sched, softmax_scale=scale,
                                             is_fp8_kvcache=True, indices=idx)  # fmt: skip

        ref = flash()[0][:, 0]
        row["err_vs_flashmla"] = rel_err(out.float(), ref.float())
        row["flashmla_ms"] = bench_ms(flash, graph=True)
        row["layer_over_flashmla"] = row["layer_ms"] / row["flashmla_ms"]
    return row


def key_write_case(T: int) -> dict:
    """T new index keys (float32 [T, 128]) quantized into random slots of the paged index cache."""
    n = max(T, 4096) * 4
    cache = torch.zeros(n // BS, BS, 1, D + 4, dtype=torch.uint8, device="cuda")
    k = torch.randn(T, D, device="cuda")
    slots = torch.randperm(n, device="cuda")[:T].to(torch.int32)
    ms = bench_ms(lambda: launch_index_key_write(k, slots, cache, BS, True), mode="median")
    nbytes = T * (D * 4 + 4 + D + 4)
    return {"T": T, "ms": ms, "gbps": nbytes / ms / 1e6}


def reference_path_case(B: int, ctx: int) -> dict:
    """The pick as the engine's reference path runs it (``index_logits_ref`` + ``index_topk`` in
    paddle; here the same ops in torch, since the GPU host has no paddle): gather each key's codes
    and scale by slot, de-quantize to float32, score, then a stable descending sort; beside the
    Triton logits + top-k on the same inputs. CUDA-graph replays."""
    cache, table, q8, w, krow, ends = decode_rows(B, ctx)
    logits = torch.empty(B, ctx, device="cuda")
    picked = torch.empty(B, TOPK, device="cuda", dtype=torch.int32)
    slots = position_slots(table, ctx)
    codes, scales = page_views(cache)
    qf = q8.float()

    def reference():
        k = codes[slots].view(torch.float8_e4m3fn).float() * scales[slots][..., None]  # [B, ctx, D]
        s = torch.einsum("bhd,bsd->bhs", qf, k).clamp_min(0)
        score = (s * w[:, :, None]).sum(1)
        return torch.sort(score, dim=1, descending=True, stable=True).indices[:, :TOPK]

    def triton_path():
        launch_index_logits(q8, w, cache, table, krow, ends, logits, BS, True, dot_fp8=True)
        launch_index_topk(logits, ends, picked)

    triton_path()
    want = reference()
    return {
        "B": B,
        "ctx": ctx,
        "reference_ms": bench_ms(reference, graph=True),
        "triton_ms": bench_ms(triton_path, graph=True),
        "same_sets": same_sets(picked, want),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--before", default=None, help="an earlier lightning_indexer_kernel.py, timed beside")
    ap.add_argument("--reference-path", action="store_true", help="only the reference path against the kernels")
    a = ap.parse_args()
    if a.reference_path:
        rows = []
        for B, ctx in ((1, 4096), (1, 32768), (32, 4096), (32, 32768)):
            rows.append(reference_path_case(B, ctx))
            print(json.dumps(rows[-1]), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "reference_path": rows}, f, indent=1)
        return
    if a.before:
        load_before(a.before)
    try:
        import deep_gemm as dg
    except ImportError as e:
        print(f"deep_gemm does not import ({e}): ours alone")
        dg = None
    try:
        import flash_mla as fm
    except ImportError as e:
        print(f"flash_mla does not import ({e}): the layer alone")
        fm = None
    res = {"device": torch.cuda.get_device_name(), "copy_gbps": copy_gbps(), "fp8_tflops": fp8_rowwise_tflops()}
    res["decode"], res["prefill"], res["key_write"], res["layer"] = [], [], [], []

    def record(section: str, case, *args) -> None:
        """Run one case; a failure is recorded with its arguments and the rest still run."""
        try:
            row = case(*args)
        except Exception as e:  # noqa: BLE001 - reported in the table's JSON
            row = {"args": [x for x in args if isinstance(x, int)], "error": repr(e)[:300]}
        res[section].append(row)
        print(json.dumps(row), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)

    for B in (1, 32, 128):
        for ctx in (4096, 32768) if a.quick else (4096, 32768, 131072):
            record("decode", decode_case, B, ctx, dg)
    for ctx in (4096, 32768):
        record("prefill", prefill_case, 2048, ctx, dg)
    for T in (1, 128, 8192):
        record("key_write", key_write_case, T)
    for B in (1, 32, 128):
        for heads in (128, 64):
            record("layer", layer_case, B, 32768, heads, fm)
    res["decode"] = [r for r in res["decode"] if "error" not in r]
    res["prefill"] = [r for r in res["prefill"] if "error" not in r]
    res["layer"] = [r for r in res["layer"] if "error" not in r]
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
    print("layer   B heads  pick ms  attend ms  layer ms  FlashMLA ms  layer/FlashMLA  err")
    for r in res["layer"]:
        print(
            f"       {r['B']:4d} {r['heads']:4d} {r['pick_ms']:8.4f} {r['attend_ms']:9.4f} {r['layer_ms']:9.4f}"
            f"  {r.get('flashmla_ms', float('nan')):10.4f} {r.get('layer_over_flashmla', float('nan')):8.2f}"
            f"  {r.get('err_vs_flashmla', float('nan')):.1e}"
        )


if __name__ == "__main__":
    main()
