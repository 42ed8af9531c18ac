"""The typed step: what the driver broadcasts and every rank builds ForwardMeta from.

``StepInputs`` is one scheduled step's host arrays (``build_step_inputs`` makes it from the
scheduler's output); ``DraftStep`` is the driver's draft-pass message (docs/design.md §4.16).
Both are frozen: the runner, ``DecodeGraphs`` and the MTP proposer read them, never write them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fastdeploy.request import Request
from fastdeploy.worker.prompt_logprobs import PromptLogprobRows, prompt_logprob_rows

PLACEHOLDER = -1  # a row's token before the step that samples it has run


@dataclass(frozen=True)
class StepInputs:
    """One step over B rows (requests, then padding rows of a bucketed decode). Per row:
    ``input_ids`` the step's tokens (all rows' chunks concatenated), ``seq_lens_encoder`` the
    chunk length (0 for a decode), ``seq_lens_decoder`` the tokens already cached,
    ``block_tables[g]`` its block ids in KV cache group g. ``samples_at``: the scheduled requests
    that sample (indices into the scheduled list); ``sample_rows[i]``: the token rows the i-th of
    them samples at (one, or m + 1 when it verifies m drafts). ``placeholders``: (row, request id)
    of each row whose token an earlier, still running step samples (the overlapped loop,
    docs/design.md §4.18); its ``input_ids`` entry is ``PLACEHOLDER``, its token is filled on the
    device from that step's draw. ``chained``: a verify step launched behind the running one
    with speculation (docs/design.md §4.18): every request verifies k drafts on k + 1 rows; its
    tokens and positions come from the running step's acceptance on the device (``input_ids``
    all placeholders, ``seq_lens_decoder`` each request's first position were none of its drafts
    accepted)."""

    input_ids: list[int]
    seq_lens_encoder: list[int]
    seq_lens_decoder: list[int]
    block_tables: dict[str, list[list[int]]]
    samples_at: list[int]
    sample_rows: list[list[int]]
    prompt_logprobs: PromptLogprobRows = field(default_factory=PromptLogprobRows)
    placeholders: tuple[tuple[int, str], ...] = ()
    chained: bool = False

    @property
    def first_logit_rows(self) -> list[int]:
        """Per sampling request, the first of its rows in the step's logits (its sample rows, in
        order, one logits row each)."""
        first, at = [], 0
        for rows in self.sample_rows:
            first.append(at)
            at += len(rows)
        return first

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_encoder)

    @property
    def is_decode(self) -> bool:
        """Every row computes one cached-context token (a bucketed decode step)."""
        return not any(self.seq_lens_encoder)


@dataclass(frozen=True)
class DraftStep:
    """The draft pass over the latest step (``MTPProposer.draft``): ``next_ids`` the token after
    each of its rows (0 where not known); per drafting request its row, batch index, the row's
    position and how many drafts it takes. ``staged``: none of these lists is sent; the driver
    computed them on the device after a captured step (``DraftGraphs.accept``) and broadcasts its
    draft staging buffer's first ``staged`` int32 entries next."""

    next_ids: list[int]
    rows: list[int]
    batch: list[int]
    pos: list[int]
    depth: list[int]
    staged: int = 0


def build_step_inputs(
    scheduled: list[tuple[Request, int]], null_block: dict[str, int], bucket_for: Callable[[int], int]
) -> StepInputs:
    """The step of ``scheduled`` (request, tokens this step). A request verifying m drafts
    (docs/design.md §4.16) computes its last token and the drafts as a chunk of m + 1 tokens and
    samples at each of them. A position whose token is pending (sampled by a step not yet taken,
    ``Request.pending_tokens``) gets a placeholder. A pure-decode step is padded to its bucket
    (``bucket_for``) with rows of one token at position 0 whose every table is the group's null
    block; they never sample."""
    ids, enc, dec, sample_rows, samples_at, holes, row = [], [], [], [], [], [], 0
    tables: dict[str, list[list[int]]] = {g: [] for g in null_block}
    for i, (req, n) in enumerate(scheduled):
        start, m = req.num_computed_tokens, req.num_drafts(n)
        known = req.all_token_ids[start : start + n - m]
        holes += [(row + j, req.request_id) for j in range(len(known), n - m)]
        ids.extend(known + [PLACEHOLDER] * (n - m - len(known)) + req.draft_token_ids[:m])
        total = req.num_tokens + req.pending_tokens
        is_decode = n == 1 and total > req.num_prompt_tokens and start == total - 1
        enc.append(0 if is_decode else n)
        dec.append(start)
        for g, rows in tables.items():
            rows.append(list(req.block_tables[g]))  # a copy: the next step's release edits the table
        if start + n - m == total:
            samples_at.append(i)
            sample_rows.append(list(range(row + n - m - 1, row + n)))
        row += n
    if not any(enc):
        pad = bucket_for(len(scheduled)) - len(scheduled)
        ids += [0] * pad
        enc += [0] * pad
        dec += [0] * pad
        for g, rows in tables.items():
            rows += [[null_block[g]]] * pad
    return StepInputs(ids, enc, dec, tables, samples_at, sample_rows, prompt_logprob_rows(scheduled), tuple(holes))


def chained_step_inputs(reqs: list[Request], k: int) -> StepInputs:
    """The verify step of ``reqs`` launched behind the running step they are all in (each request
    k + 1 rows at the positions after its accepted tokens, known on the device only;
    ``StepInputs.chained``): their tables as they are (they cover the longest acceptance)."""
    n = k + 1
    groups = reqs[0].block_tables if reqs else {}
    tables = {g: [list(r.block_tables[g]) for r in reqs] for g in groups}
    rows = [list(range(b * n, (b + 1) * n)) for b in range(len(reqs))]
    dec = [r.num_computed_tokens for r in reqs]
    ids = [PLACEHOLDER] * (n * len(reqs))
    return StepInputs(ids, [n] * len(reqs), dec, tables, list(range(len(reqs))), rows, chained=True)
