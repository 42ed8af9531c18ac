"""SWA window indexer (docs/design.md §4.3): for each token, the cache slots of its window.

Token t of request b at position p gets n = min(W, p + 1) entries, slot(b, q) for
q = p - n + 1 .. p ascending, then -1 up to topk; a padding token (b < 0 or p < 0) gets all -1.
slot(b, q) = block_tables[b, q // block_size] * block_size + q % block_size (-1 if that block
id is negative).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import paddle
import triton

from fastdeploy.config import SWA_GROUP, CacheConfig
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


def swa_window_indices(
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


def _int_tensor(x) -> paddle.Tensor:
    return x if isinstance(x, paddle.Tensor) else paddle.to_tensor(np.asarray(x, np.int64))


def get_swa_indexer_top_k(
    indexer_top_k: paddle.Tensor,
    block_tables: paddle.Tensor | Mapping[str, paddle.Tensor],
    cu_seqlens_q,
    seq_lens_encoder,
    seq_lens_decoder,
    batch_id_per_token,
    *,
    block_size: int = CacheConfig.block_size,
    sliding_window: int | None = None,
    triton: bool | None = None,
) -> paddle.Tensor:
    """The seed PR's window indexer (``models/deepseek_v3.py`` exports it by that name), over the
    kernel the SWA step plan runs on the step's own device positions (``swa_window_indices``):
    fills ``indexer_top_k`` int32 [T, 1, K] in place with each token's window slots, ascending,
    then -1, and returns it.

    Token t belongs to request b = batch_id_per_token[t] (b < 0: a padding token, all -1) and sits
    at position seq_lens_decoder[b] + t - cu_seqlens_q[b]. block_tables int32 [B, max_blocks] (or
    ForwardMeta's tables by KV cache group, of which the "swa" one is read); cu_seqlens_q [B + 1],
    seq_lens_encoder / seq_lens_decoder [B], batch_id_per_token [T], as paddle tensors or host
    arrays; seq_lens_encoder is taken for the PR's signature (positions need only the decoder
    lengths). ``sliding_window`` defaults to K (W <= K: the row ends in -1s; W > K is an error);
    ``triton`` None runs the kernel on a CUDA build of paddle, the paddle reference otherwise."""
    del seq_lens_encoder
    if indexer_top_k.ndim != 3 or indexer_top_k.shape[1] != 1 or indexer_top_k.dtype != paddle.int32:
        raise ValueError(
            f"get_swa_indexer_top_k: indexer_top_k must be int32 [T, 1, K], got {indexer_top_k.dtype} "
            f"{list(indexer_top_k.shape)}"
        )
    T, K = indexer_top_k.shape[0], indexer_top_k.shape[2]
    W = K if sliding_window is None else sliding_window
    table = block_tables[SWA_GROUP] if isinstance(block_tables, Mapping) else block_tables
    bid = _int_tensor(batch_id_per_token)
    if bid.shape[0] != T:
        raise ValueError(f"get_swa_indexer_top_k: {bid.shape[0]} batch ids for {T} tokens")
    b = bid.clip(min=0)
    t = paddle.arange(T, dtype="int64")
    pos = _int_tensor(seq_lens_decoder).astype("int64")[b] + t - _int_tensor(cu_seqlens_q).astype("int64")[b]
    pos = paddle.where(bid >= 0, pos, paddle.full_like(pos, -1))
    use_triton = paddle.is_compiled_with_cuda() if triton is None else triton
    out = swa_window_indices(pos, bid, _int_tensor(table), block_size, W, K, triton=use_triton)
    paddle.assign(out.reshape([T, 1, K]), output=indexer_top_k)
    return indexer_top_k
