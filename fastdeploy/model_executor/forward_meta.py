"""ForwardMeta and its builder: everything a step's layers read about the batch (docs/design.md §3).

The runner builds one ForwardMeta per step with ``ForwardMetaBuilder.build``; layers read it and
never compute, memoise or change batch metadata. Everything derived from the batch alone is
made here, once: slots, the SWA window indices per distinct window, the sparse-attention token
groups the provider needs, FlashMLA's schedule.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import paddle

from fastdeploy.config import SWA_GROUP, KernelConfig
from fastdeploy.model_executor.layers.attention.sparse_mla_providers import flashmla_schedule, step_topk_multiple
from fastdeploy.model_executor.ops.triton_ops.swa_indexer import get_swa_indexer_top_k


@dataclass
class SparseTokenGroup:
    """Tokens that go to one sparse-attention call: ``tokens`` int64 [n] (None: the whole step)
    and whether they are prefill tokens (FlashMLA's prefill kernel) or decodes."""

    tokens: paddle.Tensor | None
    is_prefill: bool


@dataclass
class ForwardMeta:
    """One step over the flattened tokens of B requests (T tokens).

    Device (paddle): input_ids, positions int64 [T]; batch_id_per_token int32 [T] (-1 padding);
    per KV cache group g ("full", "swa"): block_tables[g] int32 [B, max_blocks] (-1 unused or
    released) and slot_mapping[g] int32 [T] (-1 skips).
    Host (numpy int32, so per-request loops need no device sync): seq_lens_encoder,
    seq_lens_decoder, seq_lens_this_time [B]; cu_seqlens_q [B + 1].
    Derived once by the builder: swa_indices {W: int32 [T, topk]} with topk = W rounded up to the
    provider's multiple; sparse_groups, the token groups of the sparse provider's calls;
    flashmla_schedule, FlashMLA's decode schedule (None unless FlashMLA decodes this step).
    """

    input_ids: paddle.Tensor
    positions: paddle.Tensor
    batch_id_per_token: paddle.Tensor
    block_tables: dict[str, paddle.Tensor]
    slot_mapping: dict[str, paddle.Tensor]
    seq_lens_encoder: np.ndarray
    seq_lens_decoder: np.ndarray
    seq_lens_this_time: np.ndarray
    cu_seqlens_q: np.ndarray
    block_size: int
    swa_indices: dict[int, paddle.Tensor]
    sparse_groups: list[SparseTokenGroup]
    flashmla_schedule: object | None = None

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens_this_time.shape[0])


class ForwardMetaBuilder:
    """Builds each step's ForwardMeta for a model whose SWA layers use ``sliding_windows``.

    ``kernels`` says whether the window indexer runs as a Triton kernel and which sparse MLA
    provider the step's groups and padding are made for."""

    def __init__(self, block_size: int, sliding_windows: Iterable[int], kernels: KernelConfig) -> None:
        self.block_size = block_size
        self.sliding_windows = sorted(set(sliding_windows))
        self.kernels = kernels

    def build(
        self,
        input_ids: list[int] | np.ndarray,
        seq_lens_encoder: list[int],
        seq_lens_decoder: list[int],
        block_tables: dict[str, list[list[int]]],
    ) -> ForwardMeta:
        """From host lists: request b contributes seq_lens_this_time[b] tokens at positions
        seq_lens_decoder[b] .. + n - 1 (its prefill chunk, or 1 for a decode); block_tables[g][b]
        is its table in KV cache group g."""
        bs = self.block_size
        enc = np.asarray(seq_lens_encoder, np.int32)
        dec = np.asarray(seq_lens_decoder, np.int32)
        this = np.where(enc > 0, enc, 1).astype(np.int32)
        cu = np.concatenate([[0], np.cumsum(this)]).astype(np.int32)
        B = len(enc)
        bid = np.repeat(np.arange(B, dtype=np.int32), this)
        pos = (np.arange(cu[-1]) - np.repeat(cu[:-1], this) + np.repeat(dec, this)).astype(np.int64)
        tables, slots = {}, {}
        for g, rows in block_tables.items():
            bt = np.full((B, max([len(r) for r in rows] + [1])), -1, np.int32)
            for b, row in enumerate(rows):
                bt[b, : len(row)] = row
            blk = bt[bid, pos // bs] if len(pos) else np.zeros(0, np.int32)
            if (blk < 0).any():
                raise ValueError(f"block_tables[{g!r}] do not cover every token of the step")
            tables[g] = paddle.to_tensor(bt)
            slots[g] = paddle.to_tensor((blk.astype(np.int64) * bs + pos % bs).astype(np.int32))
        ids = np.asarray(input_ids, np.int64)
        if ids.shape[0] != cu[-1]:
            raise ValueError(f"{ids.shape[0]} input ids for {cu[-1]} scheduled tokens")

        positions, batch_id = paddle.to_tensor(pos), paddle.to_tensor(bid)
        provider = self.kernels.sparse_mla_provider
        multiple = step_topk_multiple(provider)
        swa_indices = {
            W: get_swa_indexer_top_k(
                positions, batch_id, tables[SWA_GROUP], bs, W, -(-W // multiple) * multiple, triton=self.kernels.triton
            )
            for W in self.sliding_windows
        }
        groups, schedule = [SparseTokenGroup(None, False)], None
        if provider == "flashmla":  # a decode kernel on the FP8 cache and a prefill kernel on a bf16 gather
            prefill_tok = np.repeat(enc > 0, this)
            groups = [
                SparseTokenGroup(paddle.to_tensor(np.nonzero(sel)[0]), is_prefill)
                for sel, is_prefill in ((~prefill_tok, False), (prefill_tok, True))
                if sel.any()
            ]
            if self.sliding_windows and (~prefill_tok).any():
                schedule = flashmla_schedule()
        return ForwardMeta(
            input_ids=paddle.to_tensor(ids),
            positions=positions,
            batch_id_per_token=batch_id,
            block_tables=tables,
            slot_mapping=slots,
            seq_lens_encoder=enc,
            seq_lens_decoder=dec,
            seq_lens_this_time=this,
            cu_seqlens_q=cu,
            block_size=bs,
            swa_indices=swa_indices,
            sparse_groups=groups,
            flashmla_schedule=schedule,
        )
