"""DeepSeek's rotary embedding as one Triton launch (docs/design.md §4.8), paddle-free: the
rotary columns of q [T, H, *] and of the latent row k [T, *] (the last 2 * HALF columns of each)
de-interleaved and rotated by the cos / sin tables at each token's position. The paddle form
(``layers/rotary_embedding.py``) is about twenty elementwise launches for the same math."""

from __future__ import annotations

import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops.launcher import launch, stride


@triton.jit
def _rope_kernel(Q, K, Pos, Cos, Sin, QOut, KOut, H, max_pos, q_off, k_off, sq_t, sq_h, sk_t, HALF: tl.constexpr):
    """Program (t, h): q head h of token t for h < H, the k row of token t for h == H. out[i] =
    x[2i] cos - x[2i+1] sin, out[HALF + i] = x[2i+1] cos + x[2i] sin; positions clipped to the
    table (padding rows sit at -1 or 0)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.minimum(tl.maximum(tl.load(Pos + t), 0), max_pos - 1).to(tl.int64)
    i = tl.arange(0, HALF)
    c = tl.load(Cos + pos * HALF + i)
    s = tl.load(Sin + pos * HALF + i)
    if h < H:
        src = Q + t * sq_t + h * sq_h + q_off
        dst = QOut + (t * H + h) * (2 * HALF)
    else:
        src = K + t * sk_t + k_off
        dst = KOut + t * (2 * HALF)
    even = tl.load(src + 2 * i).to(tl.float32)
    odd = tl.load(src + 2 * i + 1).to(tl.float32)
    tl.store(dst + i, (even * c - odd * s).to(QOut.dtype.element_ty))
    tl.store(dst + HALF + i, (odd * c + even * s).to(QOut.dtype.element_ty))


def launch_rope(positions, q, k, cos, sin, q_out, k_out) -> None:
    """positions int64 [T]; q [T, H, n + 2h] and k [T, m + 2h] (rows may be strided; their last
    2h columns are rotated); cos / sin float32 [P, h] -> q_out [T, H, 2h], k_out [T, 2h]
    (contiguous, q's dtype)."""
    T, H, half = int(q.shape[0]), int(q.shape[1]), int(cos.shape[1])
    if T == 0:
        return
    launch(
        _rope_kernel,
        (T, H + 1),
        q,
        k,
        positions,
        cos,
        sin,
        q_out,
        k_out,
        H,
        int(cos.shape[0]),
        int(q.shape[2]) - 2 * half,
        int(k.shape[1]) - 2 * half,
        stride(q, 0),
        stride(q, 1),
        stride(k, 0),
        HALF=half,
        num_warps=1,
    )
