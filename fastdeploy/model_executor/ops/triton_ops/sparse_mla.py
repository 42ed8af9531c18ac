"""Sparse MLA attention over the 656-byte FP8 cache: the paddle wrapper of the Triton kernel
(``sparse_mla_kernel.py``) and the paddle reference beside it (docs/design.md §4.5).

q [T, H, 576] (absorbed), kv_cache uint8 [num_blocks, block_size, 1, 656] (or a full layer's
bf16 [num_blocks, block_size, 1, 576], the kernel's CACHE_BF16 variant), indices int32
[T, topk] (-1 = none) -> out [T, H, 512] in q's dtype, lse float32 [T, H] (natural log); softmax
over the valid slots of (q . k) * scale times their first 512 values; a row with no valid slot
gives 0 and lse +inf.
"""

from __future__ import annotations

import paddle

from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache import dequant_mla_fp8_cache_ref
from fastdeploy.model_executor.ops.triton_ops.sparse_mla_kernel import (
    default_num_splits,
    launch_sparse_mla,
    tuned_config,
)


def sparse_mla_triton(
    q: paddle.Tensor,
    kv_cache: paddle.Tensor,
    indices: paddle.Tensor,
    softmax_scale: float,
    num_splits: int | None = None,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """The Triton provider; ``num_splits`` None picks split-KV for small batches."""
    T, H = q.shape[0], q.shape[1]
    out = paddle.empty([T, H, 512], dtype=q.dtype)
    lse = paddle.empty([T, H], dtype="float32")
    idx = indices.astype("int32").contiguous()
    if num_splits is None:
        cfg = tuned_config(T, H)
        num_splits = default_num_splits(T, H, idx.shape[1], cfg["block_h"], cfg["block_n"])
    partial = partial_lse = None
    if num_splits > 1:
        partial = paddle.empty([T, num_splits, H, 512], dtype="float32")
        partial_lse = paddle.empty([T, num_splits, H], dtype="float32")
    launch_sparse_mla(
        q.contiguous(),
        kv_cache,
        idx,
        out,
        lse,
        softmax_scale,
        num_splits=num_splits,
        partial=partial,
        partial_lse=partial_lse,
    )
    return out, lse


def sparse_mla_reference(
    q: paddle.Tensor, kv_cache: paddle.Tensor, indices: paddle.Tensor, softmax_scale: float, chunk: int | None = None
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Paddle reference in float32, ``chunk`` tokens at a time to bound the gathered memory (by
    default at most 128 tokens and 2^17 gathered slots, 288 MiB of float32 rows: a full layer's
    whole-context rows are long)."""
    chunk = chunk or max(1, min(128, 2**17 // max(1, indices.shape[1])))
    records = kv_cache.reshape([-1, kv_cache.shape[-1]])
    read = dequant_mla_fp8_cache_ref if kv_cache.dtype == paddle.uint8 else (lambda rows: rows)
    outs, lses = [], []
    for s in range(0, q.shape[0], chunk):
        idx = indices[s : s + chunk].astype("int64")
        ok = idx >= 0
        kv = read(records[idx.clip(min=0).flatten()]).astype("float32")
        kv = kv.reshape(list(idx.shape) + [576])
        kv = paddle.where(ok.unsqueeze(-1), kv, paddle.zeros_like(kv))  # never let a masked slot's bytes in
        qf = q[s : s + chunk].astype("float32")
        logits = paddle.einsum("thd,tkd->thk", qf, kv) * softmax_scale
        logits = paddle.where(ok.unsqueeze(1), logits, paddle.full_like(logits, float("-inf")))
        lse = paddle.logsumexp(logits, axis=-1)
        has = ok.any(axis=-1, keepdim=True)
        p = paddle.where(has.unsqueeze(-1), paddle.exp(logits - lse.unsqueeze(-1)), paddle.zeros_like(logits))
        outs.append(paddle.einsum("thk,tkd->thd", p, kv[..., :512]).astype(q.dtype))
        lses.append(paddle.where(has, lse, paddle.full_like(lse, float("inf"))))
    if not outs:
        return paddle.empty([0, q.shape[1], 512], q.dtype), paddle.empty([0, q.shape[1]], "float32")
    return paddle.concat(outs), paddle.concat(lses)
