"""Speculative decoding with DeepSeek-V3's MTP layer (docs/design.md §4.16): the draft model's
proposals after each step (``MTPProposer``) and the target's verification of them
(``verify_drafts``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import paddle

from fastdeploy.config import FDConfig
from fastdeploy.distributed.parallel import TPGroup
from fastdeploy.model_executor.forward_meta import ForwardMeta, ForwardMetaBuilder
from fastdeploy.model_executor.layers.device_sampler import DeviceSampler
from fastdeploy.model_executor.layers.sampler import SampleResult
from fastdeploy.model_executor.load_weight_utils import load_weights
from fastdeploy.model_executor.models.deepseek_mtp import DeepseekV3MTP
from fastdeploy.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
from fastdeploy.request import Request, sampling_batch
from fastdeploy.sampling_params import SamplingBatch
from fastdeploy.worker.draft_graphs import DraftGraphs
from fastdeploy.worker.step_inputs import DraftStep, StepInputs

Results = list[list[SampleResult] | Exception | None]


def rows_batch(
    reqs: list[Request], drafts: list[list[int]], outputs: Sequence[list[int]], rows: list[tuple[int, int]]
) -> SamplingBatch:
    """The sampler's view of verify rows (b, j): request b's row after its drafts[b][:j], those
    drafts counted as its output after ``outputs[b]`` (each row samples as the request's next
    token would without speculation)."""
    return sampling_batch([reqs[b] for b, _ in rows], [drafts[b][:j] for b, j in rows], [outputs[b] for b, _ in rows])


def all_rows(drafts: list[list[int]]) -> list[tuple[int, int]]:
    """Every verify row (b, j) of a step, in the step's order."""
    return [(b, j) for b, d in enumerate(drafts) for j in range(len(d) + 1)]


def verify_drafts(
    sampler: DeviceSampler,
    logits: paddle.Tensor,
    reqs: list[Request],
    first: Sequence[int],
    drafts: list[list[int]],
    outputs: Sequence[list[int]] | None = None,
) -> list[list[SampleResult] | Exception]:
    """Sample each request's rows in order (row j of request b is logits[first[b] + j], the
    target's distribution after its j-th draft), accepting while the sample equals the draft
    (docs/design.md §4.16). Drafts are the draft model's arg-max, a one-hot proposal, so this is
    rejection sampling (Leviathan et al.): a draft d is kept with probability p(d), and a
    rejected one's replacement is drawn from p without d, renormalised. Each row samples as
    the request's next token would without speculation (seed step, penalties, min_tokens);
    ``outputs[b]``: request b's output ids as this step sees them (``sampling_batch``). Row j
    samples as if drafts 0..j-1 were accepted (only then is it used), so the rows of requests
    without penalty counts are drawn at once, one copy back a step; a request with penalties
    draws depth by depth (its count slot holds one history at a time)."""
    out: list[list[SampleResult] | Exception] = [[] for _ in reqs]
    outs = outputs if outputs is not None else [r.output_token_ids for r in reqs]

    def draw(rows: list[tuple[int, int]]) -> list[SampleResult | Exception]:
        at = [int(first[b]) + j for b, j in rows]
        picked = logits if at == list(range(logits.shape[0])) else logits[paddle.to_tensor(at, dtype="int64")]
        return sampler.sample(picked, rows_batch(reqs, drafts, outs, rows))

    def accept(b: int, j: int, r: SampleResult | Exception) -> bool:
        """Take row j's sample; whether row j + 1 is needed (the sample is its draft)."""
        if isinstance(r, Exception):
            if not out[b]:  # else the tokens accepted before it stand
                out[b] = r
            return False
        out[b].append(r)
        return j < len(drafts[b]) and r.token_id == drafts[b][j]

    at_once = [(b, j) for b, j in all_rows(drafts) if not reqs[b].sampling_state.penalized]
    got = dict(zip(at_once, draw(at_once), strict=True)) if at_once else {}
    for b in {b for b, _ in at_once}:
        j = 0
        while accept(b, j, got[b, j]):
            j += 1
    live = [b for b, r in enumerate(reqs) if r.sampling_state.penalized]
    for j in range(1 + max(len(d) for d in drafts)):
        if not live:
            break
        rows = [(b, j) for b in live]
        live = [b for (b, _), r in zip(rows, draw(rows), strict=True) if accept(b, j, r)]
    return out


class MTPProposer:
    """The draft model on one rank. ``remember`` keeps the latest step (its host arrays, meta and
    hidden states); the driver's ``plan`` says which requests draft and how deep, every rank's
    ``draft`` runs the passes, and the driver's ``take`` gives each request its drafts."""

    def __init__(self, fd: FDConfig, target: DeepseekV3ForCausalLM, tp: TPGroup) -> None:
        mc = fd.model_config
        self.k, self.max_model_len = fd.speculative_config.k, fd.scheduler_config.max_model_len
        self.model = DeepseekV3MTP(fd, target, tp)
        self.model.eval()
        self.bytes_loaded = load_weights(self.model, mc.model_dir, None, tp.is_driver)
        self.last_step: tuple[StepInputs, ForwardMeta, paddle.Tensor] | None = None
        self.graphs: DraftGraphs | None = None  # the captured passes (set when decode steps are captured)

    def remember(self, step: StepInputs, meta: ForwardMeta, hidden: paddle.Tensor) -> None:
        self.last_step = (step, meta, hidden)

    def plan(
        self,
        scheduled: list[tuple[Request, int]],
        starts: list[int],
        results: Results,
        covered: Callable[[Request], int],
    ) -> tuple[DraftStep, list[Request]]:
        """The driver, after the latest step (``starts``: each request's computed tokens before
        it): the draft message every rank runs, and the requests that draft. A request drafts
        from the row of its last accepted token, as deep as ``k``, its room (max_tokens,
        max_model_len) and its blocks (``covered``: the tokens its tables hold) allow; a prompt
        whose KV another instance decodes drafts for it (that instance bounds them). Under a
        structured-output grammar the verify step masks each row with the grammar's state after
        the drafts before it (``token_bitmask``), so a draft the grammar refuses is rejected; not
        while a grammar waits for its start token (the rows after that token would need a mask
        the step cannot know)."""
        step = self.last_step[0]
        next_ids = [0] * len(step.input_ids)
        rows, batch, pos, depth, drafting = [], [], [], [], []
        row = 0
        for b, ((req, n), start, res) in enumerate(zip(scheduled, starts, results, strict=True)):
            seq = req.all_token_ids + ([r.token_id for r in res] if isinstance(res, list) else [])
            for i in range(n):  # the token after each row's position, where known
                if start + i + 1 < len(seq):
                    next_ids[row + i] = seq[start + i + 1]
            if isinstance(res, list) and (req.matcher is None or req.constrained):
                p = len(seq) - 2  # the last accepted token's position
                room = req.draft_room(self.max_model_len, len(res)) if req.kv_target is None else self.k
                d = min(self.k, room, covered(req) - p)
                if d > 0:
                    rows.append(row + p - start)
                    batch.append(b)
                    pos.append(p)
                    depth.append(d)
                    drafting.append(req)
            row += n
        return DraftStep(next_ids, rows, batch, pos, depth), drafting

    def staged(self, requests: int) -> bool:
        """Whether the draft passes over the latest step, of ``requests`` requests that all
        sample, run captured (``DraftGraphs``): the step ran captured and its bucket holds them."""
        _, meta, hidden = self.last_step
        return self.graphs is not None and meta.captured and self.graphs.takes(hidden.shape[0], requests)

    def stage(
        self,
        scheduled: list[tuple[Request, int]],
        starts: list[int],
        drafts: list[list[int]],
        covered: Callable[[Request], int],
        verified: Results | None = None,
    ) -> tuple[int, np.ndarray]:
        """The driver, for a step ``staged`` accepts: its bucket and the draft graph's host buffer
        (``DraftGraphs.host_buffer``), what ``plan`` reads, per request: the ``drafts`` it
        verifies, its first position, its room, its ``covered`` tokens and whether it may draft;
        ``verified``: the host's results, when the host verified the drafts."""
        B = self.last_step[2].shape[0]
        reqs = [r for r, _ in scheduled]
        left = [r.draft_room(self.max_model_len) + 1 if r.kv_target is None else 2 * self.k + 2 for r in reqs]
        may = [r.matcher is None or r.constrained for r in reqs]
        return B, self.graphs.host_buffer(B, drafts, starts, left, [covered(r) for r in reqs], may, verified)

    def run_staged(self) -> paddle.Tensor:
        """Every rank: the draft graph of the latest step's bucket over its staging (int64
        [R, k + 2] on the device: accepted tokens, depth, drafts; ``DraftGraphs.body``)."""
        _, meta, hidden = self.last_step
        return self.graphs.run(hidden.shape[0], meta, hidden)

    def draft(self, msg: DraftStep, cache: paddle.Tensor, builder: ForwardMetaBuilder) -> np.ndarray:
        """Every rank: the draft model over the latest step (its meta and the target's hidden
        states), each row reading the token after it (``next_ids``), which writes the MTP layer's
        cache of every row (also where no request drafts: later drafts read it); then for each
        drafting request (``rows``: its row of the step, ``pos``: that row's position) ``depth``
        - 1 more one-token passes on its own drafts at positions pos + 1, ... (their KV is
        rewritten when the target computes those positions). Each pass's drafts feed the next on
        the device; they come back in one copy at the end. Arg-max drafts int64 [D, k], -1 past a
        request's depth. (After a captured step the passes run as ``DraftGraphs``.)"""
        step, meta, hidden = self.last_step
        out = np.full((len(msg.rows), self.k), -1, np.int64)
        pad = [0] * (hidden.shape[0] - len(msg.next_ids))  # a captured step's padding rows (null blocks)
        x = self.model(paddle.to_tensor(msg.next_ids + pad, dtype="int64"), hidden, meta, cache)
        if not msg.rows:  # the cache written, nothing to draft
            return out
        rows = paddle.to_tensor(msg.rows, dtype="int64")
        drafts = paddle.argmax(self.model.compute_logits(x, rows), axis=1)
        x, live = x[rows], list(range(len(rows)))
        passes = [(live, drafts)]
        for j in range(1, max(msg.depth)):
            keep = [i for i, li in enumerate(live) if msg.depth[li] > j]
            live = [live[i] for i in keep]
            at = paddle.to_tensor(keep, dtype="int64")
            x, ids = x[at], drafts[at]
            tables = {g: [t[msg.batch[li]] for li in live] for g, t in step.block_tables.items()}
            meta = builder.build([0] * len(live), [0] * len(live), [msg.pos[li] + j for li in live], tables)
            meta.input_ids = ids  # the tokens stay on the device
            x = self.model(ids, x, meta, cache)
            drafts = paddle.argmax(self.model.compute_logits(x, paddle.arange(len(live))), axis=1)
            passes.append((live, drafts))
        got = paddle.concat([d for _, d in passes]).numpy()  # the one copy back
        at = 0
        for j, (rows_j, _) in enumerate(passes):
            out[rows_j, j] = got[at : at + len(rows_j)]
            at += len(rows_j)
        return out

    @staticmethod
    def take(
        scheduled: list[tuple[Request, int]], drafting: list[Request], depth: list[int], proposed: np.ndarray
    ) -> None:
        """The driver: each drafting request's first ``depth`` proposals become its drafts; every
        other scheduled request has none."""
        for req, _ in scheduled:
            req.draft_token_ids = []
        for req, d, toks in zip(drafting, depth, proposed, strict=True):
            req.draft_token_ids = [int(t) for t in toks[:d]]
