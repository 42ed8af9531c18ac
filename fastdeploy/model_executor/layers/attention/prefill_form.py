"""Which form a prefill request's attention runs in (docs/design.md §4.7): a cost model.

A request computing ``chunk`` tokens from position ``start`` sees, with window W (0: full layer),
``keys = chunk + min(start, W - 1)`` keys and ``pairs`` (query, key) pairs in all. Per head:
- MHA form: QK 192 wide + PV 128 wide on the pairs, plus decompressing every key in view through
  W_UK and W_UV (512 -> 128 + 128): 2 * H * (pairs * 320 + keys * 512 * 256) FLOPs;
- absorbed form: QK 576 + PV 512 on the pairs: 2 * H * pairs * 1088 FLOPs.
Each is divided by the rate the kernels that run it reach (``PrefillRates``; the sparse MLA
provider states its own, ``SparseMLAProvider.prefill_rates``), and the MHA form pays a fixed cost
for its extra launches (cache gather and de-quantization, two matmuls). So short chunks (a few
tokens over a long context) stay absorbed and long chunks go MHA whenever the decompression is
paid back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillRates:
    """FLOP/s of the MHA-form attention, of the W_UK / W_UV decompression, and of the absorbed
    form; seconds of the MHA form's extra launches."""

    mha_attention: float
    decompress: float
    absorbed: float
    mha_fixed: float


# our Triton kernels and FlashMLA on an H200 (benchmarks/README.md, MLA prefill, 2026-12-03,
# 128 heads, C = W = 4096): the MHA-form kernel 3.158 ms, the bf16 decompression 3.627 - 3.158 ms
# for 8191 keys, the sparse MLA kernel on prefill 20.99 ms
H200_RATES = PrefillRates(mha_attention=435e12, decompress=586e12, absorbed=222e12, mha_fixed=30e-6)
# paddle's CPU references on 2 cores (benchmarks/bench_prefill_form_cpu.py --fit, 2026-12-05: the
# tiny checkpoint at 64 / 256 / 1300 / 2048 tokens; MHA 0.02 / 0.07 / 0.80 / 2.34 s, absorbed
# 0.09 / 1.67 / 29.1 / 70.5 s): the MHA form's FLOPs at 9.0 GFLOP/s, the absorbed reference
# (a gathered, de-quantized row per query and key) at 0.53 GFLOP/s; the MHA form's fixed cost is
# not fitted: 1 ms a layer's chunk, below the 64-token run's 20 ms over its 4 layers
CPU_REFERENCE_RATES = PrefillRates(mha_attention=9.0e9, decompress=9.0e9, absorbed=0.53e9, mha_fixed=1e-3)


def attended_pairs(chunk: int, start: int, window: int) -> int:
    """Sum over the chunk's queries p = start .. start + chunk - 1 of min(W, p + 1) (W 0: p + 1)."""
    first, last = start + 1, start + chunk  # keys seen by the first and last query without a window
    full = (first + last) * chunk // 2
    if window <= 0 or last <= window:
        return full
    capped = last - max(first, window) + 1  # queries that see exactly W keys
    uncapped = chunk - capped
    return (first + first + uncapped - 1) * uncapped // 2 + capped * window


def prefill_seconds(
    chunk: int, start: int, window: int, heads: int, rates: PrefillRates = H200_RATES
) -> dict[str, float]:
    """Modelled seconds of both forms for one request's prefill chunk, at ``rates``."""
    pairs = attended_pairs(chunk, start, window)
    keys = chunk + (min(start, window - 1) if window > 0 else start)
    mha = 2 * heads * pairs * 320 / rates.mha_attention + 2 * heads * keys * 512 * 256 / rates.decompress
    return {"mha": mha + rates.mha_fixed, "absorbed": 2 * heads * pairs * 1088 / rates.absorbed}


def choose_prefill_form(
    setting: str, chunk: int, start: int, window: int, heads: int, rates: PrefillRates = H200_RATES
) -> str:
    """ "mha" or "absorbed" for one request's prefill chunk; ``setting`` "auto" asks the model."""
    if setting != "auto":
        return setting
    cost = prefill_seconds(chunk, start, window, heads, rates)
    return "mha" if cost["mha"] < cost["absorbed"] else "absorbed"
