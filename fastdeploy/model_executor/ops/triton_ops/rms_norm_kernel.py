"""RMSNorm as one Triton launch (docs/design.md §4.8), paddle-free: y = x / sqrt(mean(x^2) + eps)
* weight, in float32, stored in y's dtype. The paddle form (``layers/normalization.py``) runs
five to seven elementwise launches for the same math, which a decode step pays four times a
layer."""

from __future__ import annotations

import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops.launcher import launch, stride


@triton.jit
def _rms_norm_kernel(X, W, Y, N, sx, sy, eps, BLOCK: tl.constexpr):
    """One program a row of N <= BLOCK columns. The row is scaled by its largest magnitude a
    before squaring, so rows past 1e19 do not overflow: x / sqrt(mean(x^2) + eps) =
    (x / a) / sqrt(mean((x / a)^2) + eps / a^2)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
    a = tl.maximum(tl.max(tl.abs(x), 0), 1e-30)
    xs = x / a
    r = 1.0 / (a * tl.sqrt(tl.sum(xs * xs, 0) / N + eps / (a * a)))
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * sy + cols, (x * r * w).to(Y.dtype.element_ty), mask=ok)


def launch_rms_norm(x, weight, out, eps: float) -> None:
    """x [M, N] (rows may be strided, columns contiguous), weight [N] -> out [M, N]."""
    M, N = int(x.shape[0]), int(x.shape[1])
    if M == 0:
        return
    block = triton.next_power_of_2(N)
    launch(
        _rms_norm_kernel,
        (M,),
        x,
        weight,
        out,
        N,
        stride(x, 0),
        stride(out, 0),
        eps,
        BLOCK=block,
        num_warps=4 if block <= 2048 else 8,
    )
