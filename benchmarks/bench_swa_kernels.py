"""Check and time the SWA kernels on a CUDA GPU with torch tensors (no paddle needed).

    python benchmarks/bench_swa_kernels.py --json OUT.json [--quick] [--variants]

Measures the ceilings first (device copy bandwidth, bf16 matmul rate), then for each kernel and
case: correctness against a float32 torch reference on fresh random data, the median time
(triton.testing.do_bench), TFLOP/s and GB/s from counts made before timing, the fraction of the
ceiling, and the speedup over a naive torch version. Inputs smaller than L2 are rotated over
several copies so each call reads cold memory. The last thing printed is the table.

Counts (per token; H heads, W window slots, docs/design.md §4.5):
  sparse MLA     FLOPs 2 * H * W * (576 + 512) (FlashMLA's count)
                 bytes 656 * W (records) + 4 * W (indices) + H * 576 * 2 (q) + H * 512 * 2 (out) + 4 * H (lse)
                 (issue 7 states 660 * W + 278528 for H = 128)
  indexer        bytes written 4 * topk (+ 8 read)
  FP8 write      bytes (512 + 64) * 2 read + 656 written + 4 slot
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import bench_ms, bf16_tflops, copy_gbps, rel_err, rotating, rotation  # noqa: E402

from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache_kernel import launch_write_mla_fp8_cache  # noqa: E402
from fastdeploy.model_executor.ops.triton_ops.sparse_mla_kernel import (  # noqa: E402
    default_num_splits,
    launch_sparse_mla,
    tuned_config,
)
from fastdeploy.model_executor.ops.triton_ops.swa_indexer_kernel import launch_swa_indexer  # noqa: E402

DEV = "cuda"
SCALE = 0.1352
BLOCK = 64


GRAPH = {"on": False}  # --cudagraph: time our kernels as CUDA-graph replays (no host launch cost)


def bench(fn, rep_ms: int = 200, graph: bool = False) -> float:
    """Median ms; ``graph``: as CUDA-graph replays when --cudagraph asks."""
    return bench_ms(fn, rep=rep_ms, mode="median", graph=graph and GRAPH["on"])


# ---------------------------------------------------------------- torch references


def dequant_torch(rec: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 656] -> float32 [..., 576]."""
    lat = rec[..., :512].contiguous().view(torch.float8_e4m3fn).float()
    sc = rec[..., 512:528].contiguous().view(torch.float32)
    lat = (lat.unflatten(-1, (4, 128)) * sc.unsqueeze(-1)).flatten(-2)
    pe = rec[..., 528:].contiguous().view(torch.bfloat16).float()
    return torch.cat([lat, pe], dim=-1)


def quantize_torch(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Naive torch FP8 record writer: [T, 512], [T, 64] -> uint8 [T, 656]."""
    x = kv_c.float().unflatten(-1, (4, 128))
    amax = x.abs().amax(-1)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / 448))).clamp(min=2.0**-126), 1.0)
    q = (x / scale.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)
    return torch.cat([q, scale.view(torch.uint8), k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)], dim=-1)


def indexer_torch(pos, bid, bt, bs, W, topk):
    j = torch.arange(topk, device=pos.device)
    p, b = pos.long()[:, None], bid.long()[:, None]
    n = torch.clamp(p + 1, max=W)
    q = p - n + 1 + j
    valid = (p >= 0) & (b >= 0) & (j < n)
    blk = bt.long()[b.clamp(min=0), (q // bs).clamp(0, bt.shape[1] - 1)]
    return torch.where(valid & (blk >= 0), blk * bs + q % bs, -1).int()


def sparse_mla_torch(q, cache, idx, scale, dtype=torch.float32, chunk_bytes=2**31):
    """Naive: gather records, de-quantize, two matmuls, in token chunks bounded by chunk_bytes."""
    T, H, _ = q.shape
    topk = idx.shape[1]
    step = max(1, chunk_bytes // (topk * 576 * 4))
    flat = cache.view(-1, 656)
    outs, lses = [], []
    for s in range(0, T, step):
        ix = idx[s : s + step].long()
        ok = ix >= 0
        kv = dequant_torch(flat[ix.clamp(min=0)]).to(dtype)  # [t, topk, 576]
        logits = torch.matmul(q[s : s + step].to(dtype), kv.transpose(1, 2)).float() * scale
        logits = logits.masked_fill(~ok[:, None, :], float("-inf"))
        lse = torch.logsumexp(logits, -1)
        p = torch.softmax(logits, -1).nan_to_num(0.0)
        outs.append(torch.matmul(p.to(dtype), kv[..., :512]).to(torch.bfloat16))
        lses.append(lse.masked_fill(~ok.any(-1, keepdim=True), float("inf")))
    return torch.cat(outs), torch.cat(lses)


# ---------------------------------------------------------------- ceilings


def ceilings() -> dict:
    return {
        "copy_GBps": copy_gbps(2**30, bench),
        "bf16_matmul_TFLOPs": bf16_tflops(),
        "gpu": torch.cuda.get_device_name(),
    }


# ---------------------------------------------------------------- cases


def make_window_case(T: int, W: int, ctx_extra: int, g: torch.Generator):
    """T query tokens whose windows are full (each has >= W tokens of context): decode-style
    (one token per request) when ctx_extra < 0, else one request of T new tokens after W context."""
    if ctx_extra < 0:
        n_req, L = T, W + 7
        pos = torch.full((T,), L - 1, dtype=torch.int32)
        bid = torch.arange(T, dtype=torch.int32)
    else:
        n_req, L = 1, W + T
        pos = torch.arange(W, W + T, dtype=torch.int32)
        bid = torch.zeros(T, dtype=torch.int32)
    nb = -(-L // BLOCK)
    perm = torch.randperm(n_req * nb, generator=g).int().view(n_req, nb)
    return pos.to(DEV), bid.to(DEV), perm.to(DEV), n_req * nb


def fill_cache(num_blocks: int, g: torch.Generator) -> torch.Tensor:
    S = num_blocks * BLOCK
    kv_c = torch.randn(S, 512, generator=g).to(DEV) * 2
    k_pe = torch.randn(S, 64, generator=g).to(DEV)
    cache = torch.empty(num_blocks, BLOCK, 1, 656, dtype=torch.uint8, device=DEV)
    launch_write_mla_fp8_cache(kv_c.bfloat16(), k_pe.bfloat16(), torch.arange(S, dtype=torch.int32, device=DEV), cache)
    return cache


def sparse_case(T, H, W, prefill, g, ceil, variants=None, check_tokens=64):
    pos, bid, bt, nblocks = make_window_case(T, W, 0 if prefill else -1, g)
    topk = W
    idx = torch.empty(T, topk, dtype=torch.int32, device=DEV)
    launch_swa_indexer(pos, bid, bt, idx, BLOCK, W)
    cache = fill_cache(nblocks, g)
    q = torch.randn(T, H, 576, generator=g).to(DEV).bfloat16()
    flops = 2 * H * W * (576 + 512) * T
    nbytes = T * (656 * W + 4 * W + H * 576 * 2 + H * 512 * 2 + 4 * H)
    # correctness on a subset of tokens vs float32 torch
    sub = slice(0, min(T, check_tokens))
    ref_o, ref_l = sparse_mla_torch(q[sub], cache, idx[sub], SCALE)
    configs = variants or [tuned_config(T, H)]
    rows = []
    n_rot = rotation(nbytes)
    qs = [q] + [q.clone() for _ in range(n_rot - 1)]
    caches = [cache] + [cache.clone() for _ in range(n_rot - 1)]
    naive_ms = None
    for cfg in configs:
        bh = cfg["block_h"]
        bn = cfg["block_n"]
        ns = cfg.get("num_splits", max(1, round(default_num_splits(T, H, topk, bh, bn) * cfg.get("split_mult", 1))))
        part = torch.empty(T, ns, H, 512, device=DEV) if ns > 1 else None
        part_l = torch.empty(T, ns, H, device=DEV) if ns > 1 else None
        out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=DEV)
        lse = torch.full((T, H), float("nan"), device=DEV)
        kw = dict(
            block_h=bh,
            block_n=bn,
            num_splits=ns,
            partial=part,
            partial_lse=part_l,
            num_warps=cfg.get("num_warps"),
            num_stages=cfg.get("num_stages"),
        )
        try:
            launch_sparse_mla(q, cache, idx, out, lse, SCALE, **kw)
        except Exception as e:  # a config that does not compile (registers, shared memory)
            rows.append({"config": {**cfg, "block_h": bh, "num_splits": ns}, "error": str(e)[:200]})
            continue
        torch.cuda.synchronize()
        err = max(rel_err(out[sub].float(), ref_o.float()), rel_err(lse[sub], ref_l))
        ok = bool(torch.isfinite(out).all()) and err < 2e-2
        ms = bench(
            rotating(lambda i, o=out, l_=lse, k=kw: launch_sparse_mla(qs[i], caches[i], idx, o, l_, SCALE, **k), n_rot),
            graph=True,
        )
        rows.append({"config": {**cfg, "block_h": bh, "block_n": bn, "num_splits": ns}, "ms": ms, "err": err, "ok": ok})
    if not variants:
        naive_ms = bench(lambda: sparse_mla_torch(q, cache, idx, SCALE, dtype=torch.bfloat16), rep_ms=100)
    good = [r for r in rows if r.get("ok")]
    best = min(good, key=lambda r: r["ms"]) if good else (rows[0] if rows else {})
    ms = best.get("ms", float("nan"))
    return {
        "kernel": "sparse_mla_prefill" if prefill else "sparse_mla_decode",
        "case": f"T={T} H={H} W={W}",
        "ms": ms,
        "TFLOPs": flops / ms / 1e9,
        "GBps": nbytes / ms / 1e6,
        "frac_matmul": flops / ms / 1e9 / ceil["bf16_matmul_TFLOPs"],
        "frac_copy": nbytes / ms / 1e6 / ceil["copy_GBps"],
        "naive_ms": naive_ms,
        "speedup": (naive_ms / ms) if naive_ms else None,
        "err": best.get("err"),
        "ok": bool(best.get("ok")),
        "best_config": best.get("config"),
        "variants": rows,
    }


def indexer_case(T, W, g, ceil, sweep=False):
    L = W + T
    pos = torch.randint(0, L, (T,), generator=g, dtype=torch.int32).to(DEV)
    bid = torch.randint(0, 8, (T,), generator=g, dtype=torch.int32).to(DEV)
    bt = torch.randperm(8 * (-(-L // BLOCK)), generator=g).int().view(8, -1).to(DEV)
    out = torch.full((T, W), -7, dtype=torch.int32, device=DEV)
    launch_swa_indexer(pos, bid, bt, out, BLOCK, W)
    ok = bool(torch.equal(out, indexer_torch(pos, bid, bt, BLOCK, W, W)))
    nbytes = T * (4 * W + 8)
    variants = []
    for bt_, bk, nw in INDEXER_VARIANTS if sweep else [(8, 2048, 4)]:
        kw = dict(block_t=bt_, block_k=bk, num_warps=nw)
        out.fill_(-7)
        launch_swa_indexer(pos, bid, bt, out, BLOCK, W, **kw)
        good = bool(torch.equal(out, indexer_torch(pos, bid, bt, BLOCK, W, W)))
        variants.append(
            {
                "config": kw,
                "ok": good,
                "ms": bench(lambda kw=kw: launch_swa_indexer(pos, bid, bt, out, BLOCK, W, **kw), graph=True),
            }
        )
    naive = bench(lambda: indexer_torch(pos, bid, bt, BLOCK, W, W))
    return memory_bound_row("swa_indexer", f"T={T} W={W}", variants, ok, 0.0 if ok else 1.0, nbytes, naive, ceil)


def fp8_write_case(T, g, ceil, sweep=False):
    kv_c = (torch.randn(T, 512, generator=g) * torch.rand(T, 1, generator=g) * 10).to(DEV).bfloat16()
    k_pe = torch.randn(T, 64, generator=g).to(DEV).bfloat16()
    nblocks = -(-T // BLOCK) + 3
    slots = torch.randperm(nblocks * BLOCK, generator=g)[:T].int().to(DEV)
    cache = torch.zeros(nblocks, BLOCK, 1, 656, dtype=torch.uint8, device=DEV)
    launch_write_mla_fp8_cache(kv_c, k_pe, slots, cache)
    want = quantize_torch(kv_c, k_pe)
    got = cache.view(-1, 656)[slots.long()]
    ok = bool(torch.equal(got, want))
    nbytes = T * ((512 + 64) * 2 + 656 + 4)
    variants = []
    for bt_, nw in FP8_WRITE_VARIANTS if sweep else [(16, 4)]:
        kw = dict(block_t=bt_, num_warps=nw)
        cache.zero_()
        launch_write_mla_fp8_cache(kv_c, k_pe, slots, cache, **kw)
        good = bool(torch.equal(cache.view(-1, 656)[slots.long()], want))
        ms_v = bench(lambda kw=kw: launch_write_mla_fp8_cache(kv_c, k_pe, slots, cache, **kw), graph=True)
        variants.append({"config": kw, "ok": good, "ms": ms_v})

    def naive():
        cache.view(-1, 656)[slots.long()] = quantize_torch(kv_c, k_pe)

    mismatch = int((got != want).any(-1).sum())
    return memory_bound_row("fp8_cache_write", f"T={T}", variants, ok, mismatch, nbytes, bench(naive), ceil)


def memory_bound_row(kernel, case, variants, ok, err, nbytes, naive_ms, ceil):
    """A memory-bound kernel's table row: its fastest correct variant against the copy ceiling;
    correct only if the first check and every variant were."""
    best = min((v for v in variants if v["ok"]), key=lambda v: v["ms"], default=variants[0])
    ms = best["ms"]
    gbps = nbytes / ms / 1e6
    return {
        "kernel": kernel,
        "case": case,
        "ms": ms,
        "GBps": gbps,
        "frac_copy": gbps / ceil["copy_GBps"],
        "naive_ms": naive_ms,
        "speedup": naive_ms / ms,
        "err": err,
        "ok": ok and all(v["ok"] for v in variants),
        "best_config": best["config"],
        "variants": variants,
    }


VARIANTS = [  # block_h 64: wgmma tiles (two warpgroups); 16 / 32: mma.sync tiles
    {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2},
    {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 3},
    {"block_h": 64, "block_n": 32, "num_warps": 8, "num_stages": 2},
    {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 1},
    {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2, "split_mult": 2},
    {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 2},
    {"block_h": 16, "block_n": 64, "num_warps": 8, "num_stages": 2},
    {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 2, "split_mult": 2},
]
INDEXER_VARIANTS = [(16, 1024, 4), (8, 2048, 4), (16, 2048, 8), (32, 1024, 8), (8, 1024, 4), (16, 512, 4), (4, 4096, 8)]
FP8_WRITE_VARIANTS = [(32, 8), (64, 16), (32, 4), (64, 8), (16, 4)]  # BLOCK_T, warps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench_swa_kernels.json")
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--variants", action="store_true", help="time the tuning variants of the kernels")
    ap.add_argument("--no-attention", action="store_true", help="only the indexer and the FP8 writer")
    ap.add_argument("--cases", help="only these sparse cases, kind:T:H:W comma-separated (kind decode|prefill)")
    ap.add_argument("--cudagraph", action="store_true", help="time the project's kernels as CUDA-graph replays")
    args = ap.parse_args()
    GRAPH["on"] = args.cudagraph
    g = torch.Generator().manual_seed(int(time.time()))
    ceil = ceilings()
    print(f"ceilings: {ceil}", flush=True)
    results = []
    if args.cases:  # e.g. decode:128:16:4096,prefill:4096:128:4096
        cases = [
            (int(T), int(H), int(W), kind == "prefill")
            for kind, T, H, W in (c.split(":") for c in args.cases.split(","))
        ]
    else:  # the indexer, the writer, then per window and head count each decode size and a prefill
        results.append(indexer_case(16384, 4096, g, ceil, sweep=args.variants))
        results.append(fp8_write_case(65536, g, ceil, sweep=args.variants))
        Ts, Hs, Ws = ([128], [128, 16], [128, 4096]) if args.quick else ([64, 128], [128, 16], [128, 1024, 4096])
        cases = (
            []
            if args.no_attention
            else [
                (T, H, W, prefill) for W in Ws for H in Hs for T, prefill in [*((t, False) for t in Ts), (4096, True)]
            ]
        )
    var = VARIANTS if args.variants else None
    for T, H, W, prefill in cases:
        results.append(sparse_case(T, H, W, prefill, g, ceil, var))
        print(json.dumps({k: results[-1][k] for k in ("kernel", "case", "ms", "ok", "best_config")}), flush=True)
    with open(args.json, "w") as f:
        json.dump({"ceilings": ceil, "date": time.strftime("%Y-%m-%d"), "results": results}, f, indent=1)
    print(f"\n{ceil['gpu']}: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    hdr = ("kernel", "case", "ms", "TFLOP/s", "GB/s", "%ceil", "naive x", "err", "ok", "best")
    print("%-20s %-22s %9s %8s %7s %6s %8s %8s %2s  %s" % hdr)
    for r in results:
        frac = max(r.get("frac_matmul") or 0, r.get("frac_copy") or 0)
        err = r["err"] if r["err"] is not None else float("nan")
        row = (r["kernel"], r["case"], r["ms"], r.get("TFLOPs") or 0, r["GBps"], 100 * frac, r.get("speedup") or 0)
        print(
            "%-20s %-22s %9.4f %8.1f %7.0f %5.1f%% %8.1f" % row,
            "%8.1e %2s " % (err, "Y" if r["ok"] else "N"),
            r.get("best_config", ""),
        )


if __name__ == "__main__":
    main()
