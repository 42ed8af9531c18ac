"""ForwardMeta: everything a step's layers read about the batch (DESIGN.md §3)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle


@dataclass
class ForwardMeta:
    """One step over the flattened tokens of B requests (T tokens).

    Tensors (paddle): input_ids, positions [T] int64; batch_id_per_token [T] int32 (-1 padding);
    seq_lens_encoder / seq_lens_decoder / seq_lens_this_time [B] int32; cu_seqlens_q [B+1] int32;
    block_tables [B, max_blocks] int32 (-1 unused); slot_mapping [T] int32 (-1 skips).
    ``host`` holds numpy copies of the [B] / [B+1] vectors so per-request loops need no device sync.
    ``cache`` memoises values derived from the batch alone (e.g. SWA window indices), shared by
    every layer of the step.
    """

    input_ids: paddle.Tensor
    positions: paddle.Tensor
    batch_id_per_token: paddle.Tensor
    seq_lens_encoder: paddle.Tensor
    seq_lens_decoder: paddle.Tensor
    seq_lens_this_time: paddle.Tensor
    cu_seqlens_q: paddle.Tensor
    block_tables: paddle.Tensor
    slot_mapping: paddle.Tensor
    block_size: int
    host: dict[str, np.ndarray] = field(default_factory=dict)
    cache: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens_this_time.shape[0])

    @classmethod
    def build(
        cls,
        input_ids: list[int] | np.ndarray,
        seq_lens_encoder: list[int],
        seq_lens_decoder: list[int],
        block_tables: list[list[int]],
        block_size: int,
    ) -> ForwardMeta:
        """From host lists: request b contributes seq_lens_this_time[b] tokens at positions
        seq_lens_decoder[b] .. + n - 1 (its prefill chunk, or 1 for a decode)."""
        enc = np.asarray(seq_lens_encoder, np.int32)
        dec = np.asarray(seq_lens_decoder, np.int32)
        this = np.where(enc > 0, enc, 1).astype(np.int32) if len(enc) else enc
        cu = np.concatenate([[0], np.cumsum(this)]).astype(np.int32)
        B = len(enc)
        bid = np.repeat(np.arange(B, dtype=np.int32), this)
        pos = (np.arange(cu[-1]) - np.repeat(cu[:-1], this) + np.repeat(dec, this)).astype(np.int64)
        width = max([len(r) for r in block_tables] + [1])
        bt = np.full((B, width), -1, np.int32)
        for b, row in enumerate(block_tables):
            bt[b, : len(row)] = row
        blk = bt[bid, pos // block_size] if len(pos) else np.zeros(0, np.int32)
        if (blk < 0).any():
            raise ValueError("block_tables do not cover every token of the step")
        slots = (blk.astype(np.int64) * block_size + pos % block_size).astype(np.int32)
        ids = np.asarray(input_ids, np.int64)
        if ids.shape[0] != cu[-1]:
            raise ValueError(f"{ids.shape[0]} input ids for {cu[-1]} scheduled tokens")
        t = paddle.to_tensor
        return cls(
            input_ids=t(ids),
            positions=t(pos),
            batch_id_per_token=t(bid),
            seq_lens_encoder=t(enc),
            seq_lens_decoder=t(dec),
            seq_lens_this_time=t(this),
            cu_seqlens_q=t(cu),
            block_tables=t(bt),
            slot_mapping=t(slots),
            block_size=block_size,
            host={
                "seq_lens_encoder": enc,
                "seq_lens_decoder": dec,
                "seq_lens_this_time": this,
                "cu_seqlens_q": cu,
                "block_tables": bt,
                "positions": pos,
            },
        )
