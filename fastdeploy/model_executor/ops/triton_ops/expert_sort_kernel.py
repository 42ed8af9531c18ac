"""The fused MoE's expert sort (docs/design.md §4.8) as Triton kernels, paddle-free: the routed
(token, k) entries, N = T x top_k of them (ids int64 [N], expert of each), sorted by expert on the
device with no host sync, each expert's run padded to BLOCK_M. Outputs: ``sorted_ids`` int32 [P]
(entry ids, N for padding) and ``block_expert`` int32 [P / BLOCK_M] (the expert of each BLOCK_M
block, -1 past the last run), where P is the bound ``fused_moe_kernel.aligned_rows`` gives. Up to
ALIGN_KERNEL_MAX entries one program sorts them (``_moe_align_kernel``); above, four chunked
launches count, scan, place the starts and scatter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops.launcher import launch

# Routed entries up to which one program sorts them (``_moe_align_kernel``), the chunked launches
# above: on the H200, as graph replays (h200_2026-12-04_moe_parts_chunked.json), one program takes
# 11.6 / 13.1 us at 8 / 64 entries against 11.7 / 14.3 for the chunks, and 23 / 38 / 66 us at 256 /
# 512 / 1024 against 14 / 16 / 16, since its chunks run one after another.
ALIGN_KERNEL_MAX = 64


@triton.jit
def _experts_one_hot(Ids, i, N, ex, E):
    """Entries i's experts e (-1 past N) and their one-hot [len(i), len(ex)] int32 over this
    rank's experts ex < E (other ranks' ids have no column)."""
    e = tl.load(Ids + i, mask=i < N, other=-1)
    return e, ((e[:, None] == ex[None, :]) & (ex < E)[None, :]).to(tl.int32)


@triton.jit
def _moe_align_kernel(
    Ids,
    SortedIds,
    BlockExpert,
    N,
    E,
    P,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
    FILL: tl.constexpr,
):
    """One program: the routed entries (Ids int64 [N]; ids outside 0..E-1 are other ranks' and
    skipped) sorted by expert, stable, each expert's run padded to BLOCK_M -> SortedIds int32 [P]
    (N marks padding), BlockExpert int32 [P / BLOCK_M] (-1 past the last run). Entries go in
    chunks of BLOCK against a one-hot [BLOCK, BLOCK_E]: a chunk entry's place is its expert's
    start, plus the expert's entries in earlier chunks, plus those before it in the chunk."""
    ex = tl.arange(0, BLOCK_E)
    ex_ok = ex < E
    counts = tl.zeros([BLOCK_E], tl.int32)
    for s in range(0, N, BLOCK):
        _, hot = _experts_one_hot(Ids, s + tl.arange(0, BLOCK), N, ex, E)
        counts += tl.sum(hot, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    for s in range(0, P, FILL):
        j = s + tl.arange(0, FILL)
        tl.store(SortedIds + j, N, mask=j < P)
    # each expert's blocks, [(ends - padded) / BLOCK_M, ends / BLOCK_M): at most N / BLOCK_M + 1 a
    # run, few at the sizes this program serves; then -1 from the last run's end
    nblk = padded // BLOCK_M
    first = ends // BLOCK_M - nblk
    for j in range(0, tl.max(nblk, 0)):
        tl.store(BlockExpert + first + j, ex, mask=(j < nblk) & ex_ok)
    used = tl.sum(nblk, 0)
    for s in range(0, P // BLOCK_M, FILL):
        b = s + tl.arange(0, FILL)
        tl.store(BlockExpert + b, -1, mask=(b >= used) & (b < P // BLOCK_M))
    tl.debug_barrier()  # the padding fill lands before any entry overwrites it
    off = ends - padded
    for s in range(0, N, BLOCK):
        i = s + tl.arange(0, BLOCK)
        e, hot = _experts_one_hot(Ids, i, N, ex, E)
        before = tl.cumsum(hot, 0) - hot
        dest = tl.sum(hot * (before + off[None, :]), 1)
        tl.store(SortedIds + dest, i, mask=(i < N) & (e >= 0) & (e < E))
        off += tl.sum(hot, 0)


@triton.jit
def _align_count_kernel(
    Ids, Counts, SortedIds, N, E, P, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, FILL: tl.constexpr
):
    """Chunk c (BLOCK entries): Counts[c, e] = its entries of expert e (Counts int32 [C, BLOCK_E]);
    and its share of SortedIds' padding fill (FILL slots a chunk; N marks padding)."""
    c = tl.program_id(0)
    ex = tl.arange(0, BLOCK_E)
    _, hot = _experts_one_hot(Ids, c * BLOCK + tl.arange(0, BLOCK), N, ex, E)
    tl.store(Counts + c * BLOCK_E + ex, tl.sum(hot, 0))
    j = c * FILL + tl.arange(0, FILL)
    tl.store(SortedIds + j, N, mask=j < P)


@triton.jit
def _align_scan_kernel(Counts, Totals, C, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, COLS: tl.constexpr):
    """COLS experts a program: Counts[c, e] becomes the entries of expert e in chunks before c (an
    exclusive scan down the chunks, BLOCK_C at a time, in place); Totals[e] its entries."""
    ex = tl.program_id(0) * COLS + tl.arange(0, COLS)
    carry = tl.zeros([COLS], tl.int32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        ptr = Counts + c[:, None] * BLOCK_E + ex[None, :]
        n = tl.load(ptr, mask=(c < C)[:, None], other=0)
        tl.store(ptr, tl.cumsum(n, 0) - n + carry[None, :], mask=(c < C)[:, None])
        carry += tl.sum(n, 0)
    tl.store(Totals + ex, carry)


@triton.jit
def _align_starts_kernel(Totals, Starts, BlockExpert, E, P, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program: each expert's run padded to BLOCK_M, Starts[e] its first row; BlockExpert[b]
    the expert of each BLOCK_M block (-1 past the last run)."""
    ex = tl.arange(0, BLOCK_E)
    ex_ok = ex < E
    counts = tl.load(Totals + ex, mask=ex_ok, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(Starts + ex, ends - padded)
    for s in range(0, P // BLOCK_M, 64):
        b = s + tl.arange(0, 64)
        eb = tl.sum((((ends // BLOCK_M)[None, :] <= b[:, None]) & ex_ok[None, :]).to(tl.int32), 1)
        tl.store(BlockExpert + b, tl.where(eb < E, eb, -1), mask=b < P // BLOCK_M)


@triton.jit
def _align_scatter_kernel(Ids, Counts, Starts, SortedIds, N, E, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Chunk c: an entry's place is its expert's start, plus the expert's entries in earlier
    chunks (Counts after the scan), plus those before it in the chunk."""
    c = tl.program_id(0)
    ex = tl.arange(0, BLOCK_E)
    i = c * BLOCK + tl.arange(0, BLOCK)
    e, hot = _experts_one_hot(Ids, i, N, ex, E)
    off = tl.load(Starts + ex) + tl.load(Counts + c * BLOCK_E + ex)
    dest = tl.sum(hot * (tl.cumsum(hot, 0) - hot + off[None, :]), 1)
    tl.store(SortedIds + dest, i, mask=(i < N) & (e >= 0) & (e < E))


def align_tiles(num_experts: int, num_entries: int) -> tuple[int, int]:
    """(BLOCK_E, BLOCK): the expert axis padded to a power of two and the entries a chunk takes,
    so that a chunk's one-hot [BLOCK, BLOCK_E] stays within 8192 values."""
    block_e = max(16, triton.next_power_of_2(num_experts))
    return block_e, max(16, min(64, triton.next_power_of_2(max(num_entries, 1)), 8192 // block_e))


def launch_moe_align_chunks(ids, num_experts: int, block_m: int, sorted_ids, block_expert, scratch) -> None:
    """``launch_moe_align``'s result for any N, in four launches over chunks of entries (count,
    scan, starts, scatter; no host sync). scratch int32 >= C * BLOCK_E + 2 * BLOCK_E
    (``align_scratch_size``)."""
    N, P = int(ids.shape[0]), int(sorted_ids.shape[0])
    block_e, block = align_tiles(num_experts, N)
    C = triton.cdiv(N, block)
    counts, totals, starts = (
        scratch[: C * block_e],
        scratch[C * block_e : C * block_e + block_e],
        scratch[C * block_e + block_e : C * block_e + 2 * block_e],
    )
    fill = triton.next_power_of_2(triton.cdiv(P, C))
    launch(
        _align_count_kernel, (C,), ids, counts, sorted_ids, N, num_experts, P, BLOCK=block, BLOCK_E=block_e, FILL=fill
    )
    cols = 16
    launch(_align_scan_kernel, (block_e // cols,), counts, totals, C, BLOCK_C=64, BLOCK_E=block_e, COLS=cols)
    launch(_align_starts_kernel, (1,), totals, starts, block_expert, num_experts, P, BLOCK_M=block_m, BLOCK_E=block_e)
    launch(_align_scatter_kernel, (C,), ids, counts, starts, sorted_ids, N, num_experts, BLOCK=block, BLOCK_E=block_e)


def align_scratch_size(num_experts: int, num_entries: int) -> int:
    """int32 values of ``launch_moe_align_chunks``' scratch."""
    block_e, block = align_tiles(num_experts, num_entries)
    return (triton.cdiv(num_entries, block) + 2) * block_e


def launch_moe_align(ids, num_experts: int, block_m: int, sorted_ids, block_expert, num_warps: int = 4) -> None:
    """ids int64 [N] -> sorted_ids int32 [P], block_expert int32 [P / block_m], as
    ``_moe_align_kernel`` says; one launch, no host sync (``launch_expert_sort`` takes it up to
    ALIGN_KERNEL_MAX entries)."""
    N, P = int(ids.shape[0]), int(sorted_ids.shape[0])
    block_e, block = align_tiles(num_experts, N)
    launch(
        _moe_align_kernel,
        (1,),
        ids,
        sorted_ids,
        block_expert,
        N,
        num_experts,
        P,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        BLOCK=block,
        FILL=4096,
        num_warps=num_warps,
    )


def launch_expert_sort(ids, num_experts: int, block_m: int, sorted_ids, block_expert, scratch=None) -> None:
    """The expert sort ``fused_moe.moe_align`` runs: one program up to ALIGN_KERNEL_MAX entries,
    the chunked launches above (scratch: ``align_scratch_size`` int32 values)."""
    if int(ids.shape[0]) <= ALIGN_KERNEL_MAX:
        launch_moe_align(ids, num_experts, block_m, sorted_ids, block_expert)
    else:
        launch_moe_align_chunks(ids, num_experts, block_m, sorted_ids, block_expert, scratch)
