"""Write a small random DeepSeek-V3 MLA_SWA checkpoint (config, safetensors, BPE tokenizer).

    python -m fastdeploy.tools.make_tiny_model OUT_DIR [--seed N] [--num-layers L]
        [--sliding-window W] [--swa-layers IDS] [--first-k-dense-replace K] [--fp8] [--mtp]

IDS is a comma list of SWA layer ids, ``all`` or ``none`` (with ``--mtp``, id L is the MTP
layer's). ``--mtp`` adds DeepSeek-V3's multi-token-prediction layer and fits it to the model
(``tools/mtp_fit.py``; the acceptance it reached goes to ``mtp_fit.json``). Same arguments, same bytes. The
writer itself is ``fastdeploy.tools.tiny_checkpoint`` (the engine builds the
``tiny-mla-swa`` preset with it); this module is its command line.
"""

from __future__ import annotations

import argparse

from fastdeploy.tools.mtp_fit import fit_mtp
from fastdeploy.tools.tiny_checkpoint import make_tiny_model

__all__ = ["make_tiny_model", "parse_swa_layers", "main"]


def parse_swa_layers(ids: str, num_layers: int, flag: str = "--swa-layers") -> list[int]:
    """``all`` | ``none`` | ``0,2,3`` -> layer ids; raises ValueError naming ``flag`` and the bad id."""
    if ids == "all":
        return list(range(num_layers))
    if ids == "none":
        return []
    out = []
    for part in ids.split(","):
        try:
            i = int(part)
        except ValueError:
            raise ValueError(f"{flag}: {part!r} is not a layer id (use ids, 'all' or 'none')") from None
        if not 0 <= i < num_layers:
            raise ValueError(f"{flag}: layer id {i} outside 0..{num_layers - 1}")
        out.append(i)
    return sorted(set(out))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fastdeploy.tools.make_tiny_model", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--sliding-window", type=int, default=32)
    ap.add_argument(
        "--first-k-dense-replace",
        type=int,
        default=None,
        help="leading dense-MLP layers (rest MoE); default 1, 0 with --mtp",
    )
    ap.add_argument("--swa-layers", default=None, help="comma list of SWA layer ids, 'all' or 'none' (default: even)")
    ap.add_argument(
        "--fp8", action="store_true", help="DeepSeek-V3's FP8 format: e4m3 projections, 128x128 block scales"
    )
    ap.add_argument("--mtp", action="store_true", help="add an MTP layer (the draft model) fitted to the model")
    ap.add_argument("--dsa-layers", default=None, help="comma list of DeepSeek-V3.2 indexed layer ids, or 'all'")
    ap.add_argument("--index-topk", type=int, default=16, help="keys each query of an indexed layer attends")
    args = ap.parse_args(argv)
    if args.num_layers < 1:
        ap.error("--num-layers must be >= 1")
    if args.sliding_window < 1:
        ap.error("--sliding-window must be >= 1")
    try:
        swa = None if args.swa_layers is None else parse_swa_layers(args.swa_layers, args.num_layers + args.mtp)
        dsa = None if args.dsa_layers is None else parse_swa_layers(args.dsa_layers, args.num_layers, "--dsa-layers")
        dense = args.first_k_dense_replace if args.first_k_dense_replace is not None else int(not args.mtp)
        make_tiny_model(
            args.out_dir, args.seed, args.num_layers, args.sliding_window, swa, dense, args.fp8, args.mtp, dsa,
            args.index_topk,
        )  # fmt: skip
    except ValueError as e:
        ap.error(str(e))
    if args.mtp:
        fit = fit_mtp(args.out_dir, args.seed)
        print(f"MTP layer fitted: first-draft acceptance {fit['acceptance_held_out']:.3f} on held-out continuations")
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
