"""Continuous batching: each step runs every running request (decodes first, then continuing
prefill chunks), then admits waiting requests (samples 2..n of one prompt wait for the first to
compute the prompt), all within ``max_num_batched_tokens`` and ``max_num_seqs``. Admission is
fair between groups (``Request.group``: the API call a sequence belongs to): the next admitted is
the head of the group with the fewest running sequences, ties by arrival, so one call's prompts x
n sequences cannot hold back a later small call; within a group, arrival order. When blocks run
out, the newest running request is preempted: its blocks are freed and it is requeued at the
front of the waiting queue, to be recomputed later.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from fastdeploy.cache_manager.block_manager import BlockManager
from fastdeploy.config import SchedulerConfig
from fastdeploy.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """Requests of one step and how many new tokens each computes."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, lookahead: int = 0) -> None:
        self.config = config
        self.lookahead = lookahead  # blocks for the draft model's extra positions (k - 1; §4.16)
        self.bm = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.bm.free_request(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt_newest(self, out: SchedulerOutput) -> Request:
        victim = self.running.pop()
        self.bm.free_request(victim)
        victim.num_computed_tokens = 0
        victim.draft_token_ids = []
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.scheduled = [(r, n) for r, n in out.scheduled if r is not victim]
        out.preempted.append(victim)
        return victim

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes_first = sorted(self.running, key=lambda r: r.num_tokens_to_compute > 1)
        for req in decodes_first:
            if req.status != RequestStatus.RUNNING or budget == 0:  # preempted above, or no budget
                continue
            n = min(req.num_tokens_to_compute, budget)
            if req.num_tokens_to_compute == 1 and req.draft_token_ids:  # verify drafts (docs/design.md §4.16)
                m = min(len(req.draft_token_ids), req.draft_room(self.config.max_model_len), budget - 1)
                del req.draft_token_ids[m:]
                n += m
            extra = self.lookahead and min(self.lookahead, self.config.max_model_len - req.num_computed_tokens - n)
            while not (extra > 0 and self.bm.allocate(req, n + extra)) and not self.bm.allocate(req, n):
                if self._preempt_newest(out) is req:
                    break
            else:
                out.scheduled.append((req, n))
                budget -= n
        budget = self.config.max_num_batched_tokens - out.num_tokens
        admitted = False
        can_admit = budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted
        for req in self._fair_order() if can_admit else ():
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self._waits_for_sibling(req):
                continue
            cached = self.bm.match_prefix(req)
            req.num_computed_tokens = cached
            req.num_cached_tokens = max(req.num_cached_tokens, cached)
            n = req.num_tokens_to_compute
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    self.bm.free_request(req)
                    break
                n = budget
            if not self.bm.allocate(req, n):
                self.bm.free_request(req)
                req.num_computed_tokens = 0
                break
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted = True
            out.scheduled.append((req, n))
            budget -= n
        if admitted:
            self.waiting = deque(r for r in self.waiting if r.status == RequestStatus.WAITING)
        return out

    def _fair_order(self) -> list[Request]:
        """The waiting requests in admission order. The k-th waiting request (from 0) of a group
        with r running sequences ranks r + k, ties by arrival: admitting them in that order always
        takes the next from a group with the fewest running, and keeps each group's own order.
        Requests without a group rank 0, so with none grouped this is arrival order."""
        waiting = list(self.waiting)
        if all(r.group is None for r in waiting):
            return waiting
        running = Counter(r.group_key for r in self.running)
        seen: Counter = Counter()
        ranks = []
        for i, r in enumerate(waiting):
            g = r.group_key
            ranks.append((running[g] + seen[g], i))
            seen[g] += 1
        return [waiting[i] for _, i in sorted(ranks)]

    @staticmethod
    def _waits_for_sibling(req: Request) -> bool:
        """A sample of an n > 1 request starts once its first sample has computed the prompt (its
        first token taken: the step that computed it has run), so the prefix cache gives it the
        prompt's blocks instead of computing them again."""
        first = req.prefill_after
        return first is not None and not first.is_finished and not first.output_token_ids

    def finish(self, req: Request) -> None:
        """A request is done (it may be waiting: preempted after the step that finished it was
        launched)."""
        req.status = RequestStatus.FINISHED
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.bm.free_request(req)
