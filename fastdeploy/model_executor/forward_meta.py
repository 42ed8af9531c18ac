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

from fastdeploy.config import FULL_GROUP, SWA_GROUP, KernelConfig
from fastdeploy.model_executor.layers.attention.prefill_form import choose_prefill_form
from fastdeploy.model_executor.layers.attention.sparse_mla_providers import flashmla_schedule, step_topk_multiple
from fastdeploy.model_executor.ops.triton_ops.mla_prefill import PrefillBatch
from fastdeploy.model_executor.ops.triton_ops.swa_indexer import get_swa_indexer_top_k


@dataclass
class MHAKeys:
    """The keys in view of a group of prefill requests in MHA form (docs/design.md §4.7), in the
    layer kind's cache: ``slots`` int64 [S], each request's keys ascending from ``k_start[b]``
    (the window's first position, or 0), its chunk's own tokens last; ``batch`` their varlen
    layout (host arrays and their device copies, made once a step)."""

    slots: paddle.Tensor
    batch: PrefillBatch


@dataclass
class DenseDecode:
    """A full layer's decodes for FlashMLA's dense kernel: block_table int32 [n, max_blocks] (the
    full group's rows of the group's requests) and cache_seqlens int32 [n] (tokens cached after
    this step's write)."""

    block_table: paddle.Tensor
    cache_seqlens: paddle.Tensor


@dataclass
class TokenGroup:
    """Tokens of whole requests that attend in one call. ``tokens`` int64 [n] into the step's
    tokens (None: the whole step); ``requests`` the host request ids; ``form``: "mha" (prefill in
    MHA form, with ``mha`` its keys), "prefill" or "decode" (absorbed; FlashMLA has one kernel for
    each, the other providers take both in one call). ``full_indices`` int32 [n, topk]: a full
    layer's whole-context slots for the absorbed kernels (None on the CPU reference path);
    ``dense_decode``: a full layer's decodes as FlashMLA's dense kernel takes them (provider
    flashmla only; the backend uses it for a bf16 cache)."""

    tokens: paddle.Tensor | None
    requests: np.ndarray
    form: str
    mha: MHAKeys | None = None
    full_indices: paddle.Tensor | None = None
    dense_decode: DenseDecode | None = None

    @property
    def is_prefill(self) -> bool:
        return self.form != "decode"


@dataclass
class ForwardMeta:
    """One step over the flattened tokens of B requests (T tokens).

    Device (paddle): input_ids, positions int64 [T]; batch_id_per_token int32 [T] (-1 padding);
    per KV cache group g ("full", "swa"): block_tables[g] int32 [B, max_blocks] (-1 unused or
    released) and slot_mapping[g] int32 [T] (-1 skips).
    Host (numpy int32, so per-request loops need no device sync): seq_lens_encoder,
    seq_lens_decoder, seq_lens_this_time [B]; cu_seqlens_q [B + 1].
    Derived once by the builder: swa_indices {W: int32 [T, topk]} with topk = W rounded up to the
    provider's multiple; attn_groups {W: [TokenGroup]}, how the layers of window W (0: full
    layers) split the step's tokens into calls, each prefill request in the form the cost model
    (or the setting) picked; flashmla_schedule, FlashMLA's sparse decode schedule (None unless
    FlashMLA decodes SWA layers this step); flashmla_dense_schedule, its dense decode schedule for
    full layers' decodes.
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
    attn_groups: dict[int, list[TokenGroup]]
    flashmla_schedule: object | None = None
    flashmla_dense_schedule: object | None = None

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens_this_time.shape[0])


class ForwardMetaBuilder:
    """Builds each step's ForwardMeta for a model whose attention layers have ``windows`` (W of
    each SWA layer kind, 0 for full layers) and ``num_heads`` heads on this rank.

    ``kernels`` says whether the indexer runs as a Triton kernel, which sparse MLA provider the
    step's groups and padding are made for, and how prefill requests pick their form."""

    def __init__(self, block_size: int, windows: Iterable[int], kernels: KernelConfig, num_heads: int) -> None:
        self.block_size = block_size
        self.windows = sorted(set(windows))
        self.sliding_windows = [w for w in self.windows if w > 0]
        self.kernels = kernels
        self.num_heads = num_heads

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

        positions, batch_id = paddle.to_tensor(pos), paddle.to_tensor(bid)
        provider = self.kernels.sparse_mla_provider
        multiple = step_topk_multiple(provider)
        swa_indices = {
            W: get_swa_indexer_top_k(
                positions, batch_id, tables[SWA_GROUP], bs, W, -(-W // multiple) * multiple, triton=self.kernels.triton
            )
            for W in self.sliding_windows
        }
        step = _Step(enc, dec, this, cu, pos, bid, bs)
        attn_groups = {}
        flashmla = provider == "flashmla"
        for W in self.windows:
            g = SWA_GROUP if W > 0 else FULL_GROUP
            attn_groups[W] = self._groups(step, W, host_tables[g], tables[g], flashmla)
        schedule = dense_schedule = None
        if flashmla and self.sliding_windows and (enc == 0).any():
            schedule = flashmla_schedule()
        if flashmla and 0 in self.windows and (enc == 0).any():
            dense_schedule = flashmla_schedule()
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
            attn_groups=attn_groups,
            flashmla_schedule=schedule,
            flashmla_dense_schedule=dense_schedule,
        )

    def _groups(
        self, step: _Step, W: int, host_table: np.ndarray, table: paddle.Tensor, split_decode: bool
    ) -> list[TokenGroup]:
        """The calls of the layers with window W: prefill requests in MHA form together, the rest
        absorbed (decodes apart from prefills when ``split_decode``, for FlashMLA)."""
        kinds = {"mha": [], "decode": [], "prefill": []} if split_decode else {"mha": [], "absorbed": []}
        for b in range(len(step.enc)):
            if step.enc[b] == 0:
                kind = "decode"
            else:
                setting, heads = self.kernels.mla_prefill_form, self.num_heads
                mha = choose_prefill_form(setting, int(step.this[b]), int(step.dec[b]), W, heads) == "mha"
                kind = "mha" if mha else "prefill"
            kinds[kind if kind == "mha" or split_decode else "absorbed"].append(b)
        groups = []
        for kind, reqs in kinds.items():
            if not reqs:
                continue
            reqs = np.asarray(reqs, np.int64)
            tok = np.concatenate([np.arange(step.cu[b], step.cu[b + 1]) for b in reqs])
            whole = tok.size == step.cu[-1]
            group = TokenGroup(None if whole else paddle.to_tensor(tok), reqs, kind)
            if kind == "mha":
                group.mha = self._mha_keys(step, W, reqs, host_table)
            elif W == 0 and self.kernels.triton:
                top = int(step.pos[tok].max()) + 1  # whole-context rows: the indexer with W >= every context
                group.full_indices = get_swa_indexer_top_k(
                    paddle.to_tensor(step.pos[tok]),
                    paddle.to_tensor(step.bid[tok]),
                    table,
                    step.bs,
                    top,
                    top,
                    triton=True,
                )
            if W == 0 and kind == "decode" and split_decode:  # FlashMLA's dense decode, for a bf16 cache
                group.dense_decode = DenseDecode(
                    paddle.to_tensor(host_table[reqs]), paddle.to_tensor((step.dec[reqs] + 1).astype(np.int32))
                )
            groups.append(group)
        return groups

    @staticmethod
    def _mha_keys(step: _Step, W: int, reqs: np.ndarray, host_table: np.ndarray) -> MHAKeys:
        q_start = step.dec[reqs]
        k_start = np.maximum(q_start - W + 1, 0) if W > 0 else np.zeros_like(q_start)
        end = q_start + step.this[reqs]
        kpos = [np.arange(k_start[i], end[i]) for i in range(len(reqs))]
        blk = np.concatenate([host_table[b, p // step.bs] for b, p in zip(reqs, kpos, strict=True)])
        if (blk < 0).any():
            raise ValueError(f"a prefill's keys in view (window {W}) lie in released or missing blocks")
        kslots = blk.astype(np.int64) * step.bs + np.concatenate(kpos) % step.bs
        n = end - q_start
        batch = PrefillBatch.of(
            np.concatenate([[0], np.cumsum(n)]), np.concatenate([[0], np.cumsum(end - k_start)]), q_start, k_start
        )
        return MHAKeys(slots=paddle.to_tensor(kslots), batch=batch)


@dataclass
class _Step:
    """The host arrays of one step the group planner reads."""

    enc: np.ndarray
    dec: np.ndarray
    this: np.ndarray
    cu: np.ndarray
    pos: np.ndarray
    bid: np.ndarray
    bs: int
