"""Compile every project Triton kernel for sm_90 (H100/H200) on any machine, no GPU needed,
and print the compiler's resource report: registers per thread, spills, shared memory.

    TRITON_INTERPRET=0 python tools/kernel_resources.py [--json OUT]

Catches what the interpreter cannot (non-constexpr globals, layout or shared-memory limits)
and shows the register pressure behind the benchmark numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fastdeploy.model_executor.ops.triton_ops import (  # noqa: E402
    expert_sort_kernel as expert_sort,
)
from fastdeploy.model_executor.ops.triton_ops import (  # noqa: E402
    fp8_gemm_kernel as gemm,
)
from fastdeploy.model_executor.ops.triton_ops import (  # noqa: E402
    fused_moe_kernel as moe,
)
from fastdeploy.model_executor.ops.triton_ops import (  # noqa: E402
    mla_fp8_cache_kernel as fp8,
)
from fastdeploy.model_executor.ops.triton_ops import (  # noqa: E402
    mla_prefill_kernel as prefill,
)
from fastdeploy.model_executor.ops.triton_ops import (  # noqa: E402
    moe_route_kernel as route,
)
from fastdeploy.model_executor.ops.triton_ops import (  # noqa: E402
    rms_norm_kernel as norm,
)
from fastdeploy.model_executor.ops.triton_ops import (  # noqa: E402
    rotary_kernel as rope,
)
from fastdeploy.model_executor.ops.triton_ops import (  # noqa: E402
    sampling_kernel as sampler,
)
from fastdeploy.model_executor.ops.triton_ops import (  # noqa: E402
    sparse_mla_kernel as sparse,
)
from fastdeploy.model_executor.ops.triton_ops import (  # noqa: E402
    swa_indexer_kernel as indexer,
)
from fastdeploy.model_executor.ops.triton_ops import (  # noqa: E402
    token_mask_kernel,
)

TARGET = GPUTarget("cuda", 90, 32)


def cases():
    """(name, kernel, signature, constexprs, options) for each kernel and tuned config."""
    yield (
        "fp8_write",
        fp8._write_kernel,
        {
            "kv_c_ptr": "*bf16",
            "k_pe_ptr": "*bf16",
            "slot_ptr": "*i32",
            "cache_ptr": "*u8",
            "T": "i32",
            "stride_kv": "i32",
            "stride_pe": "i32",
            "BLOCK_T": "constexpr",
        },
        {"BLOCK_T": 16},
        {"num_warps": 4},
    )
    yield (
        "fp8_dequant",
        fp8._dequant_kernel,
        {"rec_ptr": "*u8", "out_ptr": "*bf16", "N": "i32", "BLOCK_N": "constexpr"},
        {"BLOCK_N": 8},
        {},
    )
    yield (
        "swa_indexer",
        indexer._swa_indexer_kernel,
        {
            "pos_ptr": "*i32",
            "bid_ptr": "*i32",
            "bt_ptr": "*i32",
            "out_ptr": "*i32",
            "T": "i32",
            "topk": "i32",
            "max_blocks": "i32",
            "window": "i32",
            "BLOCK_SIZE": "constexpr",
            "BLOCK_T": "constexpr",
            "BLOCK_K": "constexpr",
        },
        {"BLOCK_SIZE": 64, "BLOCK_T": 8, "BLOCK_K": 2048},
        {},
    )
    sig = {
        "q_ptr": "*bf16",
        "cache_ptr": "*u8",
        "idx_ptr": "*i32",
        "out_ptr": "*bf16",
        "lse_ptr": "*fp32",
        "H": "i32",
        "topk": "i32",
        "tiles_per_split": "i32",
        "qk_scale_log2": "fp32",
        "stride_qt": "i32",
        "stride_qh": "i32",
        "stride_ot": "i32",
        "stride_os": "i32",
        "stride_oh": "i32",
        "stride_lt": "i32",
        "stride_ls": "i32",
        "EMPTY_LSE": "constexpr",
        "BLOCK_H": "constexpr",
        "BLOCK_N": "constexpr",
        "DOT_DTYPE": "constexpr",
        "SPLIT_LATENT": "constexpr",
        "CACHE_BF16": "constexpr",
    }
    for tuned in (sparse.TUNED_WIDE, sparse.TUNED_NARROW):  # the recorded tunings
        for cache_bf16 in (False, True):  # SWA layers' FP8 records, full layers' bf16 latent
            bh, bn = tuned["block_h"], tuned["block_n"]
            const = {
                "EMPTY_LSE": float("inf"),
                "BLOCK_H": bh,
                "BLOCK_N": bn,
                "DOT_DTYPE": tl.bfloat16,
                "SPLIT_LATENT": bh < sparse.WGMMA_HEADS,
                "CACHE_BF16": cache_bf16,
            }
            opts = {"num_warps": tuned["num_warps"], "num_stages": tuned["num_stages"]}
            sig_c = {**sig, "cache_ptr": "*bf16"} if cache_bf16 else sig
            name = f"sparse_mla h{bh} n{bn}" + (" bf16 cache" if cache_bf16 else "")
            yield name, sparse._sparse_mla_kernel, sig_c, const, opts
    yield (
        "mla_prefill",
        prefill._mla_prefill_kernel,
        {
            **{n: "*bf16" for n in ("Q", "K", "KR", "V", "Out")},
            **{n: "*i32" for n in ("CuQ", "CuK", "QStart", "KStart")},
            "scale": "fp32",
            "window": "i32",
            **{n: "i32" for n in ("sq_t", "sq_h", "sk_s", "sk_h", "skr_s", "sv_s", "sv_h", "so_t", "so_h")},
            "BLOCK_M": "constexpr",
            "BLOCK_N": "constexpr",
            "DOT_BF16": "constexpr",
            "D_NOPE": "constexpr",
            "D_ROPE": "constexpr",
            "D_V": "constexpr",
        },
        {"BLOCK_M": 128, "BLOCK_N": 64, "DOT_BF16": True, "D_NOPE": 128, "D_ROPE": 64, "D_V": 128},
        {"num_warps": 8, "num_stages": 3},
    )
    yield (
        "fp8_act_quant",
        gemm._act_quant_kernel,
        {
            "X": "*bf16",
            "Codes": "*u8",
            "Scales": "*fp32",
            **{n: "i32" for n in ("M", "K", "sx", "sc", "ss_m", "ss_k")},
            "FP8_BLOCK_": "constexpr",
            "ROWS": "constexpr",
        },
        {"FP8_BLOCK_": 128, "ROWS": 16},
        {},
    )
    small = gemm.tuned_config(1, 7168, 16384)
    for cfg, fused in ((gemm.tuned_config(512, 7168, 2048), False), (small, False), (small, True)):
        yield (
            f"w8a8_gemm m{cfg['block_m']} n{cfg['block_n']}{' quant_a' if fused else ''}",
            gemm._w8a8_gemm_kernel,
            {
                "A": "*bf16" if fused else "*u8",
                "AS": "*fp32",
                "B": "*u8",
                "BS": "*fp32",
                "C": "*bf16",
                "P": "*fp32",
                "Counters": "*i32",
                **{n: "i32" for n in ("M", "N", "K", "sa", "sas", "sb", "sbs", "sc", "kb_per_split", "n_split")},
                "BLOCK_M": "constexpr",
                "BLOCK_N": "constexpr",
                "DOT_FP8": "constexpr",
                "QUANT_A": "constexpr",
                "SPLIT": "constexpr",
            },
            {
                "BLOCK_M": cfg["block_m"],
                "BLOCK_N": cfg["block_n"],
                "DOT_FP8": True,
                "QUANT_A": fused,
                "SPLIT": cfg["split_k"] > 1,
            },
            {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
        )
    for cfg in (  # 128 x 128 on 8 warps; one warpgroup (short K); the captured M 64, K split
        gemm.tuned_config(4096, 36864, 7168),
        gemm.tuned_config(4096, 7168, 2048),
        gemm.tuned_config(64, 4096, 7168, captured=True),
    ):
        yield (
            f"w8a8_gemm_tma m{cfg['block_m']} n{cfg['block_n']} w{cfg['num_warps']} split {cfg['split_k']}",
            gemm._w8a8_gemm_tma_kernel,
            {
                "a_desc": f"tensordesc<fp8e4nv[{cfg['block_m']}, 128]>",
                "b_desc": f"tensordesc<fp8e4nv[{cfg['block_n']}, 128]>",
                "AS": "*fp32",
                "BS": "*fp32",
                "C": "*bf16",
                "P": "*fp32",
                "Counters": "*i32",
                **{n: "i32" for n in ("M", "N", "K", "sas_m", "sas_k", "sbs", "kb_per_split", "n_split")},
                "BLOCK_M": "constexpr",
                "BLOCK_N": "constexpr",
                "GROUP_M": "constexpr",
                "DOT_FP8": "constexpr",
                "SPLIT": "constexpr",
            },
            {
                "BLOCK_M": cfg["block_m"],
                "BLOCK_N": cfg["block_n"],
                "GROUP_M": 8,
                "DOT_FP8": True,
                "SPLIT": cfg["split_k"] > 1,
            },
            {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
        )
    yield (
        "rms_norm",
        norm._rms_norm_kernel,
        {"X": "*bf16", "W": "*fp32", "Y": "*bf16", **{n: "i32" for n in ("N", "sx", "sy")}, "eps": "fp32"}
        | {"BLOCK": "constexpr"},
        {"BLOCK": 8192},
        {"num_warps": 8},
    )
    yield (
        "rope",
        rope._rope_kernel,
        {
            "Q": "*bf16",
            "K": "*bf16",
            "Pos": "*i64",
            "Cos": "*fp32",
            "Sin": "*fp32",
            "QOut": "*bf16",
            "KOut": "*bf16",
            **{n: "i32" for n in ("H", "max_pos", "q_off", "k_off", "sq_t", "sq_h", "sk_t")},
            "HALF": "constexpr",
        },
        {"HALF": 32},
        {"num_warps": 1},
    )
    yield (
        "moe_align",
        expert_sort._moe_align_kernel,
        {
            "Ids": "*i64",
            "SortedIds": "*i32",
            "BlockExpert": "*i32",
            **{n: "i32" for n in ("N", "E", "P")},
            "BLOCK_M": "constexpr",
            "BLOCK_E": "constexpr",
            "BLOCK": "constexpr",
            "FILL": "constexpr",
        },
        {"BLOCK_M": 16, "BLOCK_E": 256, "BLOCK": 32, "FILL": 1024},
        {"num_warps": 4},
    )
    i32 = dict.fromkeys(("N", "E", "P"), "i32")
    yield (
        "moe_align_count",
        expert_sort._align_count_kernel,
        {"Ids": "*i64", "Counts": "*i32", "SortedIds": "*i32", **i32}
        | {"BLOCK": "constexpr", "BLOCK_E": "constexpr", "FILL": "constexpr"},
        {"BLOCK": 32, "BLOCK_E": 256, "FILL": 64},
        {"num_warps": 4},
    )
    yield (
        "moe_align_scan",
        expert_sort._align_scan_kernel,
        {"Counts": "*i32", "Totals": "*i32", "C": "i32", "BLOCK_C": "constexpr", "BLOCK_E": "constexpr"}
        | {"COLS": "constexpr"},
        {"BLOCK_C": 64, "BLOCK_E": 256, "COLS": 16},
        {"num_warps": 4},
    )
    yield (
        "moe_align_starts",
        expert_sort._align_starts_kernel,
        {"Totals": "*i32", "Starts": "*i32", "BlockExpert": "*i32", "E": "i32", "P": "i32"}
        | {"BLOCK_M": "constexpr", "BLOCK_E": "constexpr"},
        {"BLOCK_M": 64, "BLOCK_E": 256},
        {"num_warps": 4},
    )
    yield (
        "moe_align_scatter",
        expert_sort._align_scatter_kernel,
        {"Ids": "*i64", "Counts": "*i32", "Starts": "*i32", "SortedIds": "*i32", "N": "i32", "E": "i32"}
        | {"BLOCK": "constexpr", "BLOCK_E": "constexpr"},
        {"BLOCK": 32, "BLOCK_E": 256},
        {"num_warps": 4},
    )
    yield (
        "moe_sum",
        moe._moe_sum_kernel,
        {"Y": "*bf16", "Ids": "*i64", "Out": "*fp32", **dict.fromkeys(("H", "E", "sy", "so"), "i32")}
        | {"TOP_K": "constexpr", "BLOCK_H": "constexpr"},
        {"TOP_K": 8, "BLOCK_H": 1024},
        {"num_warps": 4},
    )
    yield (
        "moe_route",
        route._moe_route_kernel,
        {"Z": "*fp32", "Bias": "*fp32", "Ids": "*i64", "W": "*fp32", "E": "i32", "G": "i32", "sz": "i32"}
        | {"scale": "fp32"}
        | dict.fromkeys(("N_GROUP", "TOPK_GROUP", "TOP_K", "NORM", "BLOCK_E", "BLOCK_G", "BLOCK_K"), "constexpr"),
        {"N_GROUP": 8, "TOPK_GROUP": 4, "TOP_K": 8, "NORM": True, "BLOCK_E": 256, "BLOCK_G": 8, "BLOCK_K": 8},
        {"num_warps": 4},
    )
    tiles = {"EPS": sampler.SAMPLING_EPS, "BLOCK": 2048}
    yield (
        "sampler_prepare",
        sampler._prepare_kernel,
        {
            "logits_ptr": "*fp32",
            "logits_stride": "i32",
            "work_ptr": "*fp32",
            "counts_ptr": "*i32",
            "seen_ptr": "*u8",
            "fparams_ptr": "*fp32",
            "iparams_ptr": "*i32",
            "bias_ids_ptr": "*i32",
            "bias_vals_ptr": "*fp32",
            "part_ptr": "*fp32",
            **{n: "i32" for n in ("V", "NB", "CHUNK")},
            "EPS": "constexpr",
            "BLOCK": "constexpr",
        },
        tiles,
        {"num_warps": 4},
    )
    yield (
        "sampler_cuts",
        sampler._cuts_kernel,
        {
            **{n: "*fp32" for n in ("work_ptr", "fparams_ptr", "depths_ptr", "part_ptr", "cuts_ptr", "stats_ptr")},
            "argmax_ptr": "*i32",
            "V": "i32",
            "CHUNK": "i32",
            "EPS": "constexpr",
            "BLOCK": "constexpr",
            "TILE": "constexpr",
        },
        {**tiles, "TILE": 256},
        {"num_warps": 4},
    )
    yield (
        "sampler_compact",
        sampler._compact_kernel,
        {
            "work_ptr": "*fp32",
            "fparams_ptr": "*fp32",
            "iparams_ptr": "*i32",
            "depths_ptr": "*fp32",
            "stats_ptr": "*fp32",
            "cuts_ptr": "*fp32",
            "scratch_y_ptr": "*fp32",
            "scratch_id_ptr": "*i32",
            **{n: "i32" for n in ("V", "KMAX", "CHUNK")},
            "EPS": "constexpr",
            "BLOCK": "constexpr",
        },
        tiles,
        {"num_warps": 4},
    )
    yield (
        "sampler_draw",
        sampler._draw_kernel,
        {
            "work_ptr": "*fp32",
            "logits_ptr": "*fp32",
            "logits_stride": "i32",
            "fparams_ptr": "*fp32",
            "iparams_ptr": "*i32",
            "seeds_ptr": "*i32",
            "depths_ptr": "*fp32",
            "stats_ptr": "*fp32",
            "argmax_ptr": "*i32",
            "cuts_ptr": "*fp32",
            "scratch_y_ptr": "*fp32",
            "scratch_id_ptr": "*i32",
            "tokens_ptr": "*i32",
            "logprobs_ptr": "*fp32",
            **{n: "i32" for n in ("V", "KMAX", "S")},
            "EPS": "constexpr",
            "BLOCK": "constexpr",
            "TILE": "constexpr",
        },
        {**tiles, "TILE": 256},
        {"num_warps": 4},
    )
    yield (
        "sampler_count",
        sampler._count_kernel,
        {"tokens_ptr": "*i32", "iparams_ptr": "*i32", "counts_ptr": "*i32", "V": "i32"},
        {},
        {},
    )
    yield (
        "token_bitmask",
        token_mask_kernel._apply_token_bitmask_kernel,
        {
            "logits_ptr": "*fp32",
            "logits_stride": "i32",
            "words_ptr": "*i32",
            "words_stride": "i32",
            "rows_ptr": "*i32",
            "V": "i32",
            "MASKED": "constexpr",
            "BLOCK": "constexpr",
        },
        {"MASKED": -1e30, "BLOCK": token_mask_kernel.BLOCK},
        {},
    )
    yield (
        "sparse_mla_combine",
        sparse._combine_kernel,
        {
            "part_ptr": "*fp32",
            "part_lse_ptr": "*fp32",
            "out_ptr": "*bf16",
            "lse_ptr": "*fp32",
            "H": "i32",
            "num_splits": "i32",
            "S_POW2": "constexpr",
            "BLOCK_D": "constexpr",
        },
        {"S_POW2": 8, "BLOCK_D": 128},
        {},
    )


def cubin_usage(cubin: bytes) -> dict:
    """Registers, stack (spills) and static shared memory from ``cuobjdump --dump-resource-usage``
    (the one Triton bundles) on the kernel's cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    got = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", out))
    return {"regs": int(got.get("REG", -1)), "stack_bytes": int(got.get("STACK", -1))}


def aligned_attrs(sig: dict) -> dict:
    """What a GPU launch specialises on for the benchmark shapes: every pointer 16-byte aligned
    and every int argument a multiple of 16 (without it, loads compile to single bytes)."""
    return {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(sig.values()) if ty != "constexpr" and ty != "fp32"}


def report() -> list[dict]:
    rows = []
    for name, fn, sig, const, opts in cases():
        src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=aligned_attrs(sig))
        c = triton.compile(src, target=TARGET, options=opts)
        md = c.metadata
        rows.append(
            {"kernel": name, "num_warps": md.num_warps, "shared_bytes": md.shared, **cubin_usage(c.asm["cubin"])}
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = report()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        print(f"{r['kernel']:20} warps {r['num_warps']:2}  shared {r['shared_bytes']:7} B", end="")
        print(f"  regs {r['regs']}  stack {r['stack_bytes']} B")


if __name__ == "__main__":
    main()
