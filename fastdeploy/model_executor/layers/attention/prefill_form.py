"""Which form a prefill request's attention runs in (docs/design.md §4.7): a cost model.

A request computing ``chunk`` tokens from position ``start`` sees, with window W (0: full layer),
``keys = chunk + min(start, W - 1)`` keys and ``pairs`` (query, key) pairs in all. Per head:
- MHA form: QK 192 wide + PV 128 wide on the pairs, plus decompressing every key in view through
  W_UK and W_UV (512 -> 128 + 128): 2 * H * (pairs * 320 + keys * 512 * 256) FLOPs;
- absorbed form: QK 576 + PV 512 on the pairs: 2 * H * pairs * 1088 FLOPs.
Each is divided by the rate our kernels reached on an H200 (benchmarks/README.md, MLA prefill,
2026-12-03, 128 heads, C = W = 4096), and the MHA form pays a fixed cost for its extra launches
(cache gather and de-quantization, two matmuls). So short chunks (a few tokens over a long
context) stay absorbed and long chunks go MHA whenever the decompression is paid back.
"""

from __future__ import annotations

MHA_ATTENTION_FLOPS = 435e12  # the MHA-form prefill kernel, 3.158 ms
DECOMPRESS_FLOPS = 586e12  # the W_UK / W_UV matmuls, bf16 (3.627 - 3.158 ms for 8191 keys)
ABSORBED_FLOPS = 222e12  # our sparse MLA kernel on prefill (20.99 ms)
MHA_FIXED_SECONDS = 30e-6  # the MHA path's four extra launches, small shapes


def attended_pairs(chunk: int, start: int, window: int) -> int:
    """Sum over the chunk's queries p = start .. start + chunk - 1 of min(W, p + 1) (W 0: p + 1)."""
    first, last = start + 1, start + chunk  # keys seen by the first and last query without a window
    full = (first + last) * chunk // 2
    if window <= 0 or last <= window:
        return full
    capped = last - max(first, window) + 1  # queries that see exactly W keys
    uncapped = chunk - capped
    return (first + first + uncapped - 1) * uncapped // 2 + capped * window


def prefill_seconds(chunk: int, start: int, window: int, heads: int) -> dict[str, float]:
    """Modelled H200 seconds of both forms for one request's prefill chunk."""
    pairs = attended_pairs(chunk, start, window)
    keys = chunk + (min(start, window - 1) if window > 0 else start)
    mha = 2 * heads * pairs * 320 / MHA_ATTENTION_FLOPS + 2 * heads * keys * 512 * 256 / DECOMPRESS_FLOPS
    return {"mha": mha + MHA_FIXED_SECONDS, "absorbed": 2 * heads * pairs * 1088 / ABSORBED_FLOPS}


def choose_prefill_form(setting: str, chunk: int, start: int, window: int, heads: int) -> str:
    """ "mha" or "absorbed" for one request's prefill chunk; ``setting`` "auto" asks the model."""
    if setting != "auto":
        return setting
    cost = prefill_seconds(chunk, start, window, heads)
    return "mha" if cost["mha"] < cost["absorbed"] else "absorbed"
