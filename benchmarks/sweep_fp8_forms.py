"""H200: forms of the block-scaled FP8 GEMM's K loop at large M (issue 22), beside the landed
``_w8a8_gemm_tma_kernel``, and the SASS of each form's loop.

    python benchmarks/sweep_fp8_forms.py [--json OUT] [--sass DIR] [--ms 4096]

Forms (one kernel, the differences as constexpr flags):
- main: each K block's FP8 dot starts from zero and is promoted into the float32 accumulator
  with its scales (acc += dot * a_s * b_s), the landed kernel's loop;
- pipe2: the same math software-pipelined by hand, the dot of block k+1 issued before block k's
  promotion (two partial tiles live), which is how DeepGEMM overlaps promotion with the MMA;
- noscale: the dots accumulated in place without scales (a wrong result: the loop's bound).
Tile shapes, warps, stages and GROUP_M (row tiles sharing a weight tile in L2) vary per config.
Checked against float32 torch of the same quantized math; TFLOP/s from 2 M N K.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fp8_moe import SHAPES  # noqa: E402

from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import (  # noqa: E402
    e4m3_descriptor,
    grouped_tile,
    launch_act_quant,
)
from fastdeploy.model_executor.ops.triton_ops.launcher import interpret_mode  # noqa: E402

# (form, block_m, block_n, warps, stages, group_m)
CONFIGS = [
    ("main", 128, 128, 8, 4, 8),
    ("main", 128, 128, 8, 4, 4),
    ("main", 128, 128, 8, 4, 16),
    ("main", 64, 128, 4, 3, 8),
    ("main", 64, 128, 4, 4, 8),
    ("main", 64, 128, 4, 5, 8),
    ("pipe2", 128, 128, 8, 3, 8),
    ("pipe2", 128, 128, 8, 4, 8),
    ("pipe2", 64, 128, 4, 3, 8),
    ("pipe2", 64, 128, 4, 4, 8),
    ("noscale", 128, 128, 8, 4, 8),
    ("main", 64, 64, 4, 4, 8),
    ("main", 64, 64, 4, 6, 8),
]


@triton.jit
def _scales(AS, BS, rows, r_ok, nb, kb, sas_m, sas_k, sbs):
    return tl.load(AS + rows * sas_m + kb * sas_k, mask=r_ok, other=0.0) * tl.load(BS + nb * sbs + kb)


@triton.jit
def _dot(a_desc, b_desc, pid_m, pid_n, kb, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP8: tl.constexpr):
    a = a_desc.load([pid_m * BLOCK_M, kb * 128])
    b = b_desc.load([pid_n * BLOCK_N, kb * 128])
    if not DOT_FP8:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, tl.trans(b))


@triton.jit
def _form_kernel(
    a_desc,
    b_desc,
    AS,
    BS,
    C,
    M,
    N,
    K,
    sas_m,
    sas_k,
    sbs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    FORM: tl.constexpr,  # 0 main, 1 pipe2, 2 noscale
    DOT_FP8: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < M
    nb = (pid_n * BLOCK_N) // 128
    n_kb = tl.cdiv(K, 128)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if FORM == 1:
        p = _dot(a_desc, b_desc, pid_m, pid_n, 0, BLOCK_M, BLOCK_N, DOT_FP8)
        s = _scales(AS, BS, rows, r_ok, nb, 0, sas_m, sas_k, sbs)
        for kb in range(1, n_kb):
            q = _dot(a_desc, b_desc, pid_m, pid_n, kb, BLOCK_M, BLOCK_N, DOT_FP8)  # in flight ...
            acc += p * s[:, None]  # ... while the previous block is promoted
            p = q
            s = _scales(AS, BS, rows, r_ok, nb, kb, sas_m, sas_k, sbs)
        acc += p * s[:, None]
    elif FORM == 2:
        for kb in range(n_kb):
            a = a_desc.load([pid_m * BLOCK_M, kb * 128])
            b = b_desc.load([pid_n * BLOCK_N, kb * 128])
            if not DOT_FP8:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc)
    else:
        for kb in range(n_kb):
            part = _dot(a_desc, b_desc, pid_m, pid_n, kb, BLOCK_M, BLOCK_N, DOT_FP8)
            acc += part * _scales(AS, BS, rows, r_ok, nb, kb, sas_m, sas_k, sbs)[:, None]
    ok = r_ok[:, None] & (cols < N)[None, :]
    tl.store(C + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(C.dtype.element_ty), mask=ok)


FORMS = {"main": 0, "pipe2": 1, "noscale": 2}
KEYS = ("form", "bm", "bn", "warps", "stages", "group_m")


def run_form(cfg: tuple, a, a_s, b, b_s, out):
    form, bm, bn, warps, stages, group = cfg
    M, K, N = a.shape[0], a.shape[1], b.shape[0]
    return _form_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        e4m3_descriptor(a, bm),
        e4m3_descriptor(b, bn),
        a_s,
        b_s,
        out,
        M,
        N,
        K,
        a_s.stride(1),
        a_s.stride(0),
        b_s.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        GROUP_M=group,
        FORM=FORMS[form],
        DOT_FP8=not interpret_mode(),
        num_warps=warps,
        num_stages=stages,
    )


def loop_summary(sass: str) -> dict:
    """Counts in the SASS of the kernel's hottest loop (the longest backward-branch body): tensor
    core ops, warpgroup waits (and how many groups each leaves in flight), FP32 FMAs / MULs."""
    lines = sass.splitlines()
    addr = {}
    for i, line in enumerate(lines):
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/", line)
        if m:
            addr[int(m.group(1), 16)] = i
    best = (0, 0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", line)
        if m and int(m.group(1), 16) in addr and addr[int(m.group(1), 16)] < i:
            lo = addr[int(m.group(1), 16)]
            if i - lo > best[0]:
                best = (i - lo, lo, i)
    body = lines[best[1] : best[2] + 1]
    waits = [re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+)", x) for x in body]
    return {
        "loop_lines": len(body),
        "hgmma": sum("HGMMA" in x for x in body),
        "depbar_in_flight": [int(w.group(1), 16) for w in waits if w],
        "ffma": sum(" FFMA" in x for x in body),
        "fmul": sum(" FMUL" in x for x in body),
        "fadd": sum(" FADD" in x for x in body),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sass", help="a folder for each config's SASS")
    ap.add_argument("--ms", default="4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    dev = "cpu" if interpret_mode() else "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
            w = torch.randn(N, K, device=dev, generator=g) * 0.02
            ws = w.view(N // 128, 128, K // 128, 128).abs().amax((1, 3)) / 448
            wsf = ws.repeat_interleave(128, 0).repeat_interleave(128, 1)
            codes = (w / wsf).to(torch.float8_e4m3fn)
            w_deq = codes.float() * wsf
            a = torch.empty(M, K, device=dev, dtype=torch.uint8)
            a_s = torch.empty(K // 128, M, device=dev)
            launch_act_quant(x, a, a_s, m_major=True)
            want = (a.view(torch.float8_e4m3fn).float() * a_s.t().repeat_interleave(128, 1)) @ w_deq.T
            out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            b = codes.view(torch.uint8)
            for cfg in CONFIGS:
                out.fill_(float("nan"))
                row = {
                    "shape": name,
                    "N": N,
                    "K": K,
                    "M": M,
                    "cfg": dict(zip(KEYS, cfg, strict=True)),
                }
                try:
                    ck = run_form(cfg, a, a_s, b, ws, out)
                    row["rel_err"] = ((out.float() - want).norm() / want.norm()).item()
                    if dev == "cuda":
                        now = (cfg, a, a_s, b, ws, out)
                        row["ms"] = triton.testing.do_bench(lambda now=now: run_form(*now), warmup=25, rep=200)
                        row["tflops"] = 2 * M * N * K / row["ms"] / 1e9
                        if args.sass and name == "o_proj":
                            try:  # computed from the cubin by cuobjdump on first access
                                sass = ck.asm["sass"]
                            except Exception as e:  # noqa: BLE001
                                sass, row["sass_error"] = None, repr(e)[:200]
                            if sass:
                                tag = "_".join(map(str, cfg))
                                with open(os.path.join(args.sass, f"{tag}.sass"), "w") as f:
                                    f.write(sass)
                                row["loop"] = loop_summary(sass)
                except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                    row["error"] = repr(e)[:300]
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
