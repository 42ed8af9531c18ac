"""One attention kind's plan of a step (docs/design.md §3): which tokens attend together, in
which form, over which cache slots.

Each backend builds its kind's ``StepPlan`` once a step (``plan_step``) from the common step data
in ForwardMeta; every layer of that kind reads it from ``meta.attn[kind]``. ``plan_groups`` is the
token grouping both kinds share: prefill requests in MHA form together, the rest absorbed
(decodes apart from prefills for FlashMLA, which has one kernel for each).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.prefill_form import choose_prefill_form
from fastdeploy.model_executor.layers.attention.sparse_mla_providers import DenseDecode, SparseMLAProvider
from fastdeploy.model_executor.ops.triton_ops.mla_prefill import PrefillBatch
from fastdeploy.model_executor.ops.triton_ops.swa_indexer import swa_window_indices


@dataclass
class MHAKeys:
    """The keys in view of a group of prefill requests in MHA form (docs/design.md §4.7), in the
    layer kind's cache: ``slots`` int64 [S], each request's keys ascending from ``k_start[b]``
    (the window's first position, or 0), its chunk's own tokens last; ``batch`` their varlen
    layout (host arrays and their device copies)."""

    slots: paddle.Tensor
    batch: PrefillBatch


@dataclass
class TokenGroup:
    """Tokens of whole requests that attend in one call. ``tokens`` int64 [n] into the step's
    tokens (None: the whole step); ``requests`` the host request ids; ``form``: "mha" (prefill in
    MHA form, with ``mha`` its keys), "prefill" or "decode" (absorbed, FlashMLA's two kernels), or
    "absorbed" (both, for the providers that take them in one call). An absorbed group of a full
    layer has ``indices`` int32 [n, topk], its whole-context slots, or, for FlashMLA's dense
    decode, ``dense_decode``; an SWA layer's absorbed rows are in ``StepPlan.indices``."""

    tokens: paddle.Tensor | None
    requests: np.ndarray
    form: str
    mha: MHAKeys | None = None
    indices: paddle.Tensor | None = None
    dense_decode: DenseDecode | None = None

    @property
    def is_prefill(self) -> bool:
        return self.form != "decode"


@dataclass
class StepPlan:
    """One attention kind's step: its token groups, the sparse MLA ``provider`` they were made
    for, an SWA kind's window ``indices`` int32 [T, topk] (topk = W rounded up to the provider's
    multiple; None when no token attends absorbed, and for full layers), and the provider's decode
    ``schedule`` for the kind (None unless it has one and the step decodes). A DSA kind's
    ``index_rows``: where its queries find their indexer keys (None when none attends absorbed)."""

    groups: list[TokenGroup]
    provider: SparseMLAProvider
    indices: paddle.Tensor | None = None
    schedule: object | None = None
    index_rows: list[IndexRows] | None = None


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_groups(
    meta: ForwardMeta,
    window: int,
    group: str,
    provider: SparseMLAProvider,
    form: str,
    num_heads: int,
    mha_max_end: int | None = None,
) -> list[TokenGroup]:
    """The calls of a kind with window W (0: full layers) reading KV cache group ``group``: prefill
    requests in MHA form together (with their keys in view; ``form`` the mla_prefill_form
    setting, priced at the provider's rates), the rest absorbed, decodes apart from prefills for
    a provider that splits them. ``mha_max_end``: only a request whose context ends there or
    before may go the MHA form (a DSA layer's index_topk: beyond it the indexer's pick decides)."""
    split_decode = provider.split_decode
    kinds = {"mha": [], "decode": [], "prefill": []} if split_decode else {"mha": [], "absorbed": []}
    for b in range(len(meta.seq_lens_encoder)):
        if meta.seq_lens_encoder[b] == 0:
            kind = "decode"
        else:
            chunk, start = int(meta.seq_lens_this_time[b]), int(meta.seq_lens_decoder[b])
            whole = mha_max_end is None or start + chunk <= mha_max_end
            mha = whole and choose_prefill_form(form, chunk, start, window, num_heads, provider.prefill_rates) == "mha"
            kind = "mha" if mha else "prefill"
        kinds[kind if kind == "mha" or split_decode else "absorbed"].append(b)
    cu, groups = meta.cu_seqlens_q, []
    for kind, reqs in kinds.items():
        if not reqs:
            continue
        reqs = np.asarray(reqs, np.int64)
        tok = np.concatenate([np.arange(cu[b], cu[b + 1]) for b in reqs])
        token_group = TokenGroup(None if tok.size == cu[-1] else paddle.to_tensor(tok), reqs, kind)
        if kind == "mha":
            token_group.mha = mha_keys(meta, window, reqs, meta.host_block_tables[group])
        groups.append(token_group)
    return groups


def mha_keys(meta: ForwardMeta, window: int, reqs: np.ndarray, host_table: np.ndarray) -> MHAKeys:
    """The keys in view of prefill requests ``reqs``: the window before each chunk (W > 0) or the
    whole context, then the chunk; a key in a released block is a ValueError naming the window."""
    bs = meta.block_size
    q_start = meta.seq_lens_decoder[reqs]
    k_start = np.maximum(q_start - window + 1, 0) if window > 0 else np.zeros_like(q_start)
    end = q_start + meta.seq_lens_this_time[reqs]
    kpos = [np.arange(k_start[i], end[i]) for i in range(len(reqs))]
    blk = np.concatenate([host_table[b, p // bs] for b, p in zip(reqs, kpos, strict=True)])
    if (blk < 0).any():
        raise ValueError(f"a prefill's keys in view (window {window}) lie in released or missing blocks")
    kslots = blk.astype(np.int64) * bs + np.concatenate(kpos) % bs
    n = end - q_start
    batch = PrefillBatch.of(
        np.concatenate([[0], np.cumsum(n)]), np.concatenate([[0], np.cumsum(end - k_start)]), q_start, k_start
    )
    return MHAKeys(slots=paddle.to_tensor(kslots), batch=batch)


@dataclass
class IndexRows:
    """Where some of a DSA step's queries find their indexer keys: ``tokens`` (t0, t1) of the
    step's tokens (None: all), ``key_slots`` int64 [L] (one request's context, positions 0..L-1)
    or [n, L] (each token its own request's table row, L its whole width: a decode row), ``ends``
    int64 [n] the keys each query sees (its position + 1). A slot of a key no query sees may be
    anything >= 0. The reference path's key gathers (the Triton kernel reads the tables)."""

    tokens: tuple[int, int] | None
    key_slots: paddle.Tensor
    ends: paddle.Tensor


def index_rows(meta: ForwardMeta, group: str) -> list[IndexRows]:
    """The step's queries and their keys in KV cache group ``group``: one entry for a step of
    single-token rows (decodes; from the device tables and positions alone, so a captured step
    needs no host data), else one a request (its context from the host table)."""
    bs = meta.block_size
    if (meta.seq_lens_this_time == 1).all():
        table = meta.block_tables[group].astype("int64")  # row t is token t's request
        j = paddle.arange(table.shape[1] * bs, dtype="int64")
        slots = (table[:, j // bs] * bs + j % bs).clip(min=0)  # -1 blocks lie past every row's end
        return [IndexRows(None, slots, meta.positions.astype("int64") + 1)]
    rows, cu = [], meta.cu_seqlens_q
    for b in range(len(cu) - 1):
        start, n = int(meta.seq_lens_decoder[b]), int(meta.seq_lens_this_time[b])
        pos = np.arange(start + n)
        slots = meta.host_block_tables[group][b, pos // bs].astype(np.int64) * bs + pos % bs
        ends = np.arange(start + 1, start + n + 1, dtype=np.int64)
        rows.append(IndexRows((int(cu[b]), int(cu[b + 1])), paddle.to_tensor(slots), paddle.to_tensor(ends)))
    return rows


def window_indices(
    meta: ForwardMeta, group: str, tokens: paddle.Tensor | None, window: int, topk: int, triton: bool
) -> paddle.Tensor:
    """int32 [n, topk]: the window slots of the step's ``tokens`` (None: every token), from the
    step's device positions and batch ids, by the kernel under ``get_swa_indexer_top_k``."""
    positions, batch_ids = meta.positions, meta.batch_id_per_token
    if tokens is not None:
        positions, batch_ids = positions[tokens], batch_ids[tokens]
    return swa_window_indices(
        positions, batch_ids, meta.block_tables[group], meta.block_size, window, topk, triton=triton
    )
