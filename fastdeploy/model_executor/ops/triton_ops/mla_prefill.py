"""MLA prefill in MHA form: the paddle wrapper of ``mla_prefill_kernel.py`` and the paddle
reference beside it (docs/design.md §4.7). Shapes and the window rule are in the kernel's module
docstring."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

from fastdeploy.model_executor.ops.triton_ops.mla_prefill_kernel import D_NOPE, D_ROPE, D_V, launch_mla_prefill


def _check(q: paddle.Tensor, k: paddle.Tensor, k_rope: paddle.Tensor, v: paddle.Tensor) -> int:
    """-> the nope width (128 for DeepSeek-V3)."""
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or k_rope.ndim != 2:
        raise ValueError(
            f"mla_prefill: want q [T, H, {D_NOPE + D_ROPE}], k [S, H, {D_NOPE}], k_rope [S, {D_ROPE}], "
            f"v [S, H, {D_V}]; got {list(q.shape)}, {list(k.shape)}, {list(k_rope.shape)}, {list(v.shape)}"
        )
    H, S, nope = q.shape[1], k.shape[0], k.shape[2]
    for name, x, want in (
        ("q", q, [q.shape[0], H, nope + D_ROPE]),
        ("k", k, [S, H, nope]),
        ("k_rope", k_rope, [S, D_ROPE]),
        ("v", v, [S, H, v.shape[2]]),
    ):
        if list(x.shape) != want:
            raise ValueError(f"mla_prefill: {name} must be {want}, got {list(x.shape)}")
    return nope


@dataclass(frozen=True)
class PrefillBatch:
    """The varlen layout of B prefill requests, host int32 arrays: cu_seqlens_q / cu_seqlens_k
    [B + 1], q_start / k_start [B] (absolute position of each request's first query / key), and
    ``device``, the same four as paddle int32 tensors for the kernel, made once (by ``of``) so a
    step's layers do not copy them again."""

    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    q_start: np.ndarray
    k_start: np.ndarray
    device: tuple[paddle.Tensor, ...]

    @classmethod
    def of(cls, cu_seqlens_q, cu_seqlens_k, q_start, k_start) -> PrefillBatch:
        host = [np.asarray(a, np.int32) for a in (cu_seqlens_q, cu_seqlens_k, q_start, k_start)]
        return cls(*host, device=tuple(paddle.to_tensor(a) for a in host))

    @property
    def max_q(self) -> int:
        return int(np.diff(self.cu_seqlens_q).max()) if len(self.cu_seqlens_q) > 1 else 0


def mla_prefill_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    k_rope: paddle.Tensor,
    v: paddle.Tensor,
    batch: PrefillBatch,
    softmax_scale: float,
    window: int = 0,
) -> paddle.Tensor:
    """The Triton kernel: out [T, H, 128] in q's dtype."""
    _check(q, k, k_rope, v)
    out = paddle.empty([q.shape[0], q.shape[1], v.shape[2]], dtype=q.dtype)
    launch_mla_prefill(
        q.contiguous(),
        k.contiguous(),
        k_rope.contiguous(),
        v.contiguous(),
        out,
        *batch.device,
        softmax_scale,
        window,
        batch.max_q,
    )
    return out


def mla_prefill_ref(
    q: paddle.Tensor,
    k: paddle.Tensor,
    k_rope: paddle.Tensor,
    v: paddle.Tensor,
    batch: PrefillBatch,
    softmax_scale: float,
    window: int = 0,
) -> paddle.Tensor:
    """Paddle reference in float32, one request at a time (keys a query may not see are never read)."""
    nope = _check(q, k, k_rope, v)
    cu_seqlens_q, cu_seqlens_k, q_start, k_start = batch.cu_seqlens_q, batch.cu_seqlens_k, batch.q_start, batch.k_start
    outs = []
    for b in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = (int(x) for x in (cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]))
        qpos = paddle.arange(qe - qs, dtype="int64") + int(q_start[b])
        kpos = paddle.arange(ke - ks, dtype="int64") + int(k_start[b])
        seen = kpos.unsqueeze(0) <= qpos.unsqueeze(1)
        if window > 0:
            seen = seen & (kpos.unsqueeze(0) > qpos.unsqueeze(1) - window)
        qb = q[qs:qe].astype("float32")
        kb, rb, vb = k[ks:ke].astype("float32"), k_rope[ks:ke].astype("float32"), v[ks:ke].astype("float32")
        ok = seen.any(axis=0)  # keys no query of the request sees are zeroed, so NaN there cannot leak
        kb, rb, vb = (
            paddle.where(ok.reshape([-1] + [1] * (x.ndim - 1)), x, paddle.zeros_like(x)) for x in (kb, rb, vb)
        )
        s = paddle.einsum("thd,shd->hts", qb[:, :, :nope], kb) + paddle.einsum("thd,sd->hts", qb[:, :, nope:], rb)
        s = paddle.where(seen.unsqueeze(0), s * softmax_scale, paddle.full_like(s, float("-inf")))
        p = paddle.nn.functional.softmax(s, axis=-1)
        outs.append(paddle.einsum("hts,shd->thd", p, vb).astype(q.dtype))
    return paddle.concat(outs) if outs else paddle.empty([0, q.shape[1], v.shape[2]], q.dtype)
