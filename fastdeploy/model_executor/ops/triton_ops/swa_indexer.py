"""SWA window indexer (docs/design.md §4.3): for each token, the cache slots of its window.

Token t of request b at position p gets n = min(W, p + 1) entries, slot(b, q) for
q = p - n + 1 .. p ascending, then -1 up to topk; a padding token (b < 0 or p < 0) gets all -1.
slot(b, q) = block_tables[b, q // block_size] * block_size + q % block_size (-1 if that block
id is negative).
"""

from __future__ import annotations

import paddle
import triton

from fastdeploy.model_executor.ops.triton_ops.swa_indexer_kernel import launch_swa_indexer


def _check(topk: int, sliding_window: int) -> None:
    if sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if topk < sliding_window:
        raise ValueError(f"topk={topk} must be >= sliding_window={sliding_window}")


def swa_indexer_triton(
    positions: paddle.Tensor,
    batch_id_per_token: paddle.Tensor,
    block_tables: paddle.Tensor,
    block_size: int,
    sliding_window: int,
    topk: int,
) -> paddle.Tensor:
    """positions, batch_id_per_token int [T]; block_tables int32 [B, max_blocks] -> int32 [T, topk]."""
    _check(topk, sliding_window)
    out = paddle.empty([positions.shape[0], topk], dtype="int32")
    launch_swa_indexer(
        positions.astype("int32").contiguous(),
        batch_id_per_token.astype("int32").contiguous(),
        block_tables.astype("int32").contiguous(),
        out,
        block_size,
        sliding_window,
        block_k=min(2048, triton.next_power_of_2(topk)),
    )
    return out


def swa_indexer_ref(
    positions: paddle.Tensor,
    batch_id_per_token: paddle.Tensor,
    block_tables: paddle.Tensor,
    block_size: int,
    sliding_window: int,
    topk: int,
) -> paddle.Tensor:
    """Paddle reference of ``swa_indexer_triton`` (vectorised over tokens and entries)."""
    _check(topk, sliding_window)
    T = positions.shape[0]
    if T == 0:
        return paddle.empty([0, topk], dtype="int32")
    p = positions.astype("int64").unsqueeze(1)
    b = batch_id_per_token.astype("int64").unsqueeze(1)
    j = paddle.arange(topk, dtype="int64").unsqueeze(0)
    n = paddle.minimum(paddle.full_like(p, sliding_window), p + 1)
    q = p - n + 1 + j
    valid = (p >= 0) & (b >= 0) & (j < n)
    max_blocks = block_tables.shape[1]
    col = paddle.where(valid, q // block_size, paddle.zeros_like(q)).clip(max=max_blocks - 1)
    row = paddle.where(valid, b, paddle.zeros_like(b)).expand_as(col)
    blk = block_tables.astype("int64")[row, col]
    slot = blk * block_size + q % block_size
    return paddle.where(valid & (blk >= 0), slot, paddle.full_like(slot, -1)).astype("int32")


def get_swa_indexer_top_k(
    positions: paddle.Tensor,
    batch_id_per_token: paddle.Tensor,
    block_tables: paddle.Tensor,
    block_size: int,
    sliding_window: int,
    topk: int,
    *,
    triton: bool = False,
) -> paddle.Tensor:
    """int32 [T, topk]: each token's window slots in ascending position order, then -1
    (docs/design.md §4.3). The Triton kernel when ``triton``, else the paddle reference."""
    impl = swa_indexer_triton if triton else swa_indexer_ref
    return impl(positions, batch_id_per_token, block_tables, block_size, sliding_window, topk)
