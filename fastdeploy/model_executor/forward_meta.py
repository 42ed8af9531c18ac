"""ForwardMeta and its builder: everything a step's layers read about the batch (docs/design.md §3).

The runner builds one ForwardMeta per step with ``ForwardMetaBuilder.build``; layers read it and
never compute, memoise or change batch metadata. The builder makes the data common to every
layer (ids, positions, lengths, per KV cache group block tables and slots), then asks each
attention kind's planner (its backend's ``plan_step``) for that kind's plan, kept in
``attn[kind]``. This module imports nothing from ``layers/``: what a plan holds is the
backend's own business.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import paddle

from fastdeploy.config import KernelConfig


@dataclass
class ForwardMeta:
    """One step over the flattened tokens of B requests (T tokens).

    Device (paddle): input_ids, positions int64 [T]; batch_id_per_token int32 [T]; per KV cache
    group g ("full", "swa"): block_tables[g] int32 [B, max_blocks] (-1 unused or released) and
    slot_mapping[g] int32 [T].
    Host (numpy, so planners and per-request loops need no device sync): seq_lens_encoder,
    seq_lens_decoder, seq_lens_this_time int32 [B]; cu_seqlens_q int32 [B + 1]; host_batch_id
    int32 [T]; host_block_tables[g] int32 [B, max_blocks].
    kernels: the implementations the step was planned for. attn: each attention kind's plan of
    the step, by the kind's name (a backend's ``kind``), made by that kind's backend.
    captured: a pure-decode step built for a CUDA graph (``build_decode``, docs/design.md §4.11):
    the host arrays then hold only what is the same at every replay of its bucket (B decodes,
    seq_lens_decoder each row's bound max_model_len - 1, no host block tables); a row's real
    position and blocks are on the device only.
    layer_done: a prefill instance's layer-wise KV push (docs/design.md §4.20), called with a
    decoder layer's index once its forward (its cache write included) is queued.
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
    host_batch_id: np.ndarray
    host_block_tables: dict[str, np.ndarray]
    block_size: int
    kernels: KernelConfig
    attn: dict[str, object] = field(default_factory=dict)
    captured: bool = False
    layer_done: Callable[[int], None] | None = None  # called as each layer's cache is written (§4.20)


class StepPlanner(Protocol):
    """What the builder asks of an attention kind: its name and its plan of a step."""

    kind: str

    def plan_step(self, meta: ForwardMeta) -> object: ...


class ForwardMetaBuilder:
    """Builds each step's ForwardMeta: the common data, then one plan per attention kind from
    ``planners`` (one backend of each kind the model has)."""

    def __init__(self, block_size: int, planners: Sequence[StepPlanner], kernels: KernelConfig) -> None:
        self.block_size = block_size
        self.planners = list(planners)
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
        host_tables, tables, slots = {}, {}, {}
        for g, rows in block_tables.items():
            bt = np.full((B, max([len(r) for r in rows] + [1])), -1, np.int32)
            for b, row in enumerate(rows):
                bt[b, : len(row)] = row
            blk = bt[bid, pos // bs] if len(pos) else np.zeros(0, np.int32)
            if (blk < 0).any():
                raise ValueError(f"block_tables[{g!r}] do not cover every token of the step")
            host_tables[g], tables[g] = bt, paddle.to_tensor(bt)
            slots[g] = paddle.to_tensor((blk.astype(np.int64) * bs + pos % bs).astype(np.int32))
        ids = np.asarray(input_ids, np.int64)
        if ids.shape[0] != cu[-1]:
            raise ValueError(f"{ids.shape[0]} input ids for {cu[-1]} scheduled tokens")
        meta = ForwardMeta(
            input_ids=paddle.to_tensor(ids),
            positions=paddle.to_tensor(pos),
            batch_id_per_token=paddle.to_tensor(bid),
            block_tables=tables,
            slot_mapping=slots,
            seq_lens_encoder=enc,
            seq_lens_decoder=dec,
            seq_lens_this_time=this,
            cu_seqlens_q=cu,
            host_batch_id=bid,
            host_block_tables=host_tables,
            block_size=bs,
            kernels=self.kernels,
        )
        return self.plan(meta)

    def build_decode(
        self, input_ids: paddle.Tensor, positions: paddle.Tensor, block_tables: dict[str, paddle.Tensor], bound: int
    ) -> ForwardMeta:
        """A captured pure-decode step of B rows from device tensors only (no host read, no
        upload): input_ids, positions int64 [B], block_tables[g] int32 [B, width]; ``bound`` is
        max_model_len, the most tokens any row's context reaches. Slots come from the tables on
        the device; the host arrays are the bucket's constants (``ForwardMeta.captured``)."""
        B, bs = input_ids.shape[0], self.block_size
        col = (positions // bs).unsqueeze(1)
        slots = {
            g: (
                paddle.take_along_axis(t, col.astype(t.dtype), 1).squeeze(1).astype("int64") * bs + positions % bs
            ).astype("int32")
            for g, t in block_tables.items()
        }
        rows = np.arange(B, dtype=np.int32)
        meta = ForwardMeta(
            input_ids=input_ids,
            positions=positions,
            batch_id_per_token=paddle.arange(B, dtype="int32"),
            block_tables=block_tables,
            slot_mapping=slots,
            seq_lens_encoder=np.zeros(B, np.int32),
            seq_lens_decoder=np.full(B, bound - 1, np.int32),
            seq_lens_this_time=np.ones(B, np.int32),
            cu_seqlens_q=np.arange(B + 1, dtype=np.int32),
            host_batch_id=rows,
            host_block_tables={g: np.zeros((B, 0), np.int32) for g in block_tables},
            block_size=bs,
            kernels=self.kernels,
            captured=True,
        )
        return self.plan(meta)

    def plan(self, meta: ForwardMeta) -> ForwardMeta:
        """Each attention kind's plan of the step, into ``meta.attn``."""
        for planner in self.planners:
            meta.attn[planner.kind] = planner.plan_step(meta)
        return meta
