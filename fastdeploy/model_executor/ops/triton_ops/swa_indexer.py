"""SWA window indexer (DESIGN.md §4): for each token, the cache slots of its window.

Token t of request b at position p gets n = min(W, p + 1) entries, slot(b, q) for
q = p - n + 1 .. p ascending, then -1 up to topk; a padding token (b < 0 or p < 0) gets all -1.
slot(b, q) = block_tables[b, q // block_size] * block_size + q % block_size (-1 if that block
id is negative).
"""

from __future__ import annotations

import paddle
import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops.launcher import launch


@triton.jit
def _swa_indexer_kernel(
    pos_ptr, bid_ptr, bt_ptr, out_ptr, T, topk, max_blocks,
    block_size, window,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program: a [BLOCK_T tokens, BLOCK_K entries] tile of the output."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    t_ok = t < T
    p = tl.load(pos_ptr + t, mask=t_ok, other=-1)
    b = tl.load(bid_ptr + t, mask=t_ok, other=-1)
    real = (p >= 0) & (b >= 0)
    n = tl.minimum(window, p + 1)
    q = (p - n + 1)[:, None] + j[None, :]  # [BLOCK_T, BLOCK_K] positions
    valid = real[:, None] & (j[None, :] < n[:, None])
    blk = tl.load(bt_ptr + b[:, None].to(tl.int64) * max_blocks + q // block_size, mask=valid, other=-1)
    slot = tl.where(valid & (blk >= 0), blk * block_size + q % block_size, -1)
    out_mask = t_ok[:, None] & (j[None, :] < topk)
    tl.store(out_ptr + t[:, None].to(tl.int64) * topk + j[None, :], slot, mask=out_mask)


def launch_swa_indexer(positions, batch_id_per_token, block_tables, out, block_size: int, sliding_window: int,
                       block_t: int = 16, block_k: int = 256) -> None:  # fmt: skip
    """Framework-neutral launch; out int32 [T, topk], block_tables int32 [B, max_blocks]."""
    T, topk = int(out.shape[0]), int(out.shape[1])
    if T == 0:
        return
    grid = (triton.cdiv(T, block_t), triton.cdiv(topk, block_k))
    launch(_swa_indexer_kernel, grid, positions, batch_id_per_token, block_tables, out, T, topk,
           int(block_tables.shape[1]), block_size, sliding_window, BLOCK_T=block_t, BLOCK_K=block_k)  # fmt: skip


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
        block_k=min(256, triton.next_power_of_2(topk)),
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
