"""Captured draft passes (docs/design.md §4.16, §4.11): after a step that ran captured (a decode
or a verify step of bucket B), the acceptance of its drafts and the MTP layer's k passes run as
one graph of that bucket too, so nothing between the step's draw and its drafts waits for the
host.

A bucket's draft body reads nothing but ``staging``, an int32 device buffer allocated once, and
the decode step's own outputs (its ForwardMeta and hidden states, tensors the decode graph owns).
For B rows and R = ``requests[B]`` requests (those of the step, then padding ones) it uses the
first 5B + 6R entries (``ROW_FIELDS``, then ``REQUEST_FIELDS``; ``slot`` says where each lies):

    token [B] | ok [B] | request [B] | index [B] | draft [B]
    | first [R] | drafts [R] | start [R] | left [R] | covered [R] | may_draft [R]

Per row: its drawn token, whether it was drawn and finite, its request, its index among the
request's rows and the draft its sample is compared with (-1 for a request's last row). Per
request: its first row, its drafts verified, the position of its first row, ``left`` (the tokens
max_tokens and max_model_len still allow before this step's, ``Request.draft_room``), the tokens
its tables cover and whether it may draft (a grammar waiting for its start token may not).
Padding rows: index past any acceptance; padding requests: zeros. The body accepts each request's
leading rows whose sample equals their draft, plus the row after (``verify_drafts`` on the
device), then does what ``MTPProposer.plan`` does on the host: pass 1 runs the MTP layer over
every row, each reading the accepted token after it (0 past them), and arg-maxes at the row of
each request's last accepted token; passes 2..k run one row a request at positions pos + 1, ...,
with the request's tables (gathered from the decode step's staging), as deep as k, its room and
its blocks allow. A request past its depth (and a padding one) runs those passes at position 0
over the null block, as padding rows do. Out: int64 [R, k + 2], each request's accepted tokens,
its depth and its drafts, copied back once.

The tokens come from the step's draw on the device when every row was drawn at once (the usual
case; then the host uploads the rest and nothing waits), or from the host's own verification
(requests with penalties draw depth by depth), written as drawn tokens with ok 0 where the host
drew none.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import paddle

from fastdeploy.model_executor.forward_meta import ForwardMeta, ForwardMetaBuilder
from fastdeploy.model_executor.models.deepseek_mtp import DeepseekV3MTP
from fastdeploy.worker.decode_graphs import DecodeGraphs

logger = logging.getLogger("fastdeploy")

ROW_FIELDS = ("token", "ok", "request", "index", "draft")  # B entries each, in staging's order
REQUEST_FIELDS = ("first", "drafts", "start", "left", "covered", "may_draft")  # R entries each, after them


@dataclass(frozen=True)
class Chain:
    """A chained verify step's inputs, made on the device from the step before (``DraftGraphs.chain``):
    ``ids_pos`` int64 [2T] its rows' tokens then positions; ``draft`` int64 [T] the draft each
    row's sample is checked against (-1: none); per request ``start`` (its first position) and the
    step before's ``accepted`` tokens [R]; ``shift`` int64 [T] each row's draw step past its
    position were only one token accepted before (``DeviceSampler.draw``)."""

    ids_pos: paddle.Tensor
    draft: paddle.Tensor
    start: paddle.Tensor
    accepted: paddle.Tensor
    shift: paddle.Tensor


class DraftGraphs:
    """The acceptance and draft passes of each of ``decode``'s buckets. ``requests[B]``: the
    requests a bucket of B rows holds (B for a decode bucket, B / (k + 1) for a verify bucket
    only); a step with more runs its passes eagerly."""

    def __init__(
        self,
        mtp: DeepseekV3MTP,
        cache: paddle.Tensor,
        builder: ForwardMetaBuilder,
        decode: DecodeGraphs,
        decode_buckets: tuple[int, ...],
        k: int,
    ) -> None:
        self.mtp, self.cache, self.builder, self.decode, self.k = mtp, cache, builder, decode, k
        self.requests = {B: B if B in decode_buckets else B // (k + 1) for B in decode.buckets}
        self.staging = paddle.zeros([max(self.size(B) for B in decode.buckets)], "int32")
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, paddle.Tensor] = {}
        self.replays = 0  # draft passes run captured

    def size(self, B: int) -> int:
        """The staging entries a step of bucket B uses."""
        return len(ROW_FIELDS) * B + len(REQUEST_FIELDS) * self.requests[B]

    def slot(self, B: int, name: str, n: int | None = None) -> slice:
        """Where field ``name`` (``ROW_FIELDS`` or ``REQUEST_FIELDS``) of bucket B lies in
        ``staging``: its first ``n`` entries (default all: B of a row field, R of a request one)."""
        if name in ROW_FIELDS:
            at, size = ROW_FIELDS.index(name) * B, B
        else:
            size = self.requests[B]
            at = len(ROW_FIELDS) * B + REQUEST_FIELDS.index(name) * size
        return slice(at, at + (size if n is None else n))

    def takes(self, rows: int, requests: int) -> bool:
        """Whether the draft passes over a captured step of ``rows`` rows and ``requests``
        requests run captured."""
        return rows in self.requests and requests <= self.requests[rows]

    def host_buffer(
        self,
        B: int,
        drafts: list[list[int]],
        start: list[int],
        left: list[int],
        covered: list[int],
        may_draft: list[bool],
        verified: list | None = None,
    ) -> np.ndarray:
        """int32 [5B + 6R] in ``staging``'s layout for the step's requests (each one's verified
        ``drafts``, first position, room, covered tokens and whether it may draft). Tokens and ok
        are 0 unless ``verified`` (the host's results, a list of samples or an exception a
        request) gives them."""
        rows = {f: np.zeros(B, np.int64) for f in ROW_FIELDS}
        rows["index"][:] = self.k + 2  # padding rows: past any acceptance
        reqs = {f: np.zeros(self.requests[B], np.int64) for f in REQUEST_FIELDS}
        at = 0
        for b, d in enumerate(drafts):
            n = len(d) + 1
            rows["request"][at : at + n] = b
            rows["index"][at : at + n] = np.arange(n)
            rows["draft"][at : at + n] = d + [-1]
            if verified is not None and isinstance(verified[b], list):
                got = [r.token_id for r in verified[b]]
                rows["token"][at : at + len(got)] = got
                rows["ok"][at : at + len(got)] = 1
            per = (at, len(d), start[b], left[b], covered[b], may_draft[b])
            for f, v in zip(REQUEST_FIELDS, per, strict=True):
                reqs[f][b] = v
            at += n
        return np.concatenate([*rows.values(), *reqs.values()]).astype(np.int32)

    def load(
        self, B: int, buf: np.ndarray, tokens: paddle.Tensor | None = None, ok: paddle.Tensor | None = None
    ) -> None:
        """One copy of ``host_buffer``'s array for bucket B into ``staging``; then, when the step
        drew every row at once, its ``tokens`` int64 [T] and ``ok`` bool [T] over the first T
        rows (device copies)."""
        self.staging[: buf.shape[0]] = paddle.to_tensor(buf, place=self.staging.place)
        if tokens is not None:
            T = tokens.shape[0]
            self.staging[self.slot(B, "token", T)] = tokens.astype("int32")
            self.staging[self.slot(B, "ok", T)] = ok.astype("int32")

    def chain(self, tokens: paddle.Tensor, out: paddle.Tensor, first: list[int], start: list[int]) -> Chain:
        """The verify step chained behind a step (docs/design.md §4.18) from that step's drawn
        ``tokens`` int64 [T'] and its draft graph's ``out`` int64 [R', k + 2] on the device, with
        each of its R requests' ``first`` row and ``start`` position (host): per request k + 1
        rows, its bonus token (the sample of its last accepted row) then its drafts (0 past its
        depth) at the positions after its accepted tokens."""
        R, n = len(first), self.k + 1
        accepted, depth, drafts = out[:R, 0], out[:R, 1], out[:R, 2:]
        last = paddle.to_tensor(first, dtype="int64") + paddle.clip(accepted - 1, min=0)
        within = paddle.arange(self.k, dtype="int64").unsqueeze(0) < depth.unsqueeze(1)
        checked = paddle.where(within, drafts, paddle.full_like(drafts, -1))  # never equal past the depth
        ids = paddle.concat([paddle.gather(tokens, last).unsqueeze(1), paddle.clip(checked, min=0)], 1)
        first_pos = paddle.to_tensor(start, dtype="int64") + accepted
        pos = first_pos.unsqueeze(1) + paddle.arange(n, dtype="int64").unsqueeze(0)
        column = paddle.concat([checked, paddle.full([R, 1], -1, "int64")], 1).reshape([-1])
        shift = (accepted - 1).unsqueeze(1).expand([R, n]).reshape([-1])
        return Chain(paddle.concat([ids.reshape([-1]), pos.reshape([-1])]), column, first_pos, accepted, shift)

    def load_chained(self, B: int, chain: Chain) -> None:
        """After ``load`` of a chained step's host buffer (its drafts, start and room as if none
        were accepted): its drafts checked, first positions and rooms from ``chain`` (device ops)."""
        n, s = chain.start.shape[0], self.staging
        s[self.slot(B, "draft", chain.draft.shape[0])] = chain.draft.astype("int32")
        s[self.slot(B, "start", n)] = chain.start.astype("int32")
        left = self.slot(B, "left", n)
        s[left] = s[left] - chain.accepted.astype("int32")  # the room after them

    def accept(self, B: int) -> tuple[paddle.Tensor, ...]:
        """From ``staging`` (bucket B): next_ids [B] (the accepted token after each row, 0 past
        them), and per request its accepted tokens, row, position and depth [R], int64."""
        s = self.staging
        tok, ok, req, index, draft = (s[self.slot(B, f)].astype("int64") for f in ROW_FIELDS)
        first, m, start, left, covered, may = (s[self.slot(B, f)].astype("int64") for f in REQUEST_FIELDS)
        eq = (tok == draft).astype("int64") * ok
        zero = paddle.zeros([1], "int64")
        missed = paddle.concat([zero, paddle.cumsum(1 - eq)])  # missed[t]: rows before t whose draft missed
        # reached: no row of its request before it missed (then its sample is kept when finite)
        reached = (missed[:B] == paddle.gather(paddle.gather(missed, first), req)).astype("int64")
        kept = paddle.concat([zero, paddle.cumsum(reached * ok)])
        accepted = paddle.gather(kept, first + m + 1) - paddle.gather(kept, first)
        next_ids = paddle.where(index < paddle.gather(accepted, req), tok, paddle.zeros_like(tok))
        last = paddle.clip(accepted - 1, min=0)
        pos = start + last
        room = paddle.minimum(left - accepted - 1, covered - pos)
        depth = paddle.clip(room, 0, self.k) * may * (accepted > 0).astype("int64")
        return next_ids, accepted, first + last, pos, depth

    def body(self, B: int, meta: ForwardMeta, hidden: paddle.Tensor) -> paddle.Tensor:
        """Bucket B's acceptance and k passes over the decode step's ``meta`` and ``hidden``
        [B, hidden] (device ops only): int64 [R, k + 2], accepted tokens, depth, then drafts."""
        R = self.requests[B]
        ids, accepted, rows, pos, depth = self.accept(B)
        x = self.mtp(ids, hidden, meta, self.cache)
        drafts = [paddle.argmax(self.mtp.compute_logits(x, rows), axis=1)]
        x = paddle.gather(x, rows)
        views = zip(self.decode.null_block, self.decode.table_views(B), strict=True)
        tables = {g: paddle.gather(t, rows) for g, t in views}  # each request's row's tables [R, width]
        for j in range(1, self.k):
            live = depth > j
            at = paddle.where(live, pos + j, paddle.zeros_like(pos))
            held = live.unsqueeze(1).expand([R, self.decode.width])
            tabs = {g: paddle.where(held, t, paddle.full_like(t, self.decode.null_block[g])) for g, t in tables.items()}
            step = self.builder.build_decode(drafts[-1], at, tabs, self.decode.max_model_len)
            x = self.mtp(drafts[-1], x, step, self.cache)
            drafts.append(paddle.argmax(self.mtp.compute_logits(x, paddle.arange(R)), axis=1))
        return paddle.concat([accepted.unsqueeze(1), depth.unsqueeze(1), paddle.stack(drafts, axis=1)], axis=1)

    def capture(self) -> None:
        """Each bucket, over padding (no request) and the decode graph's outputs: run once, then
        captured on a CUDA device."""
        for B in reversed(self.decode.buckets):
            started = time.monotonic()
            self.load(B, self.host_buffer(B, [], [], [], [], []))
            # the decode graph's outputs (on CPU, where nothing is kept, a run of its body over padding)
            meta, hidden, _ = self.decode.outputs[B] if B in self.decode.outputs else self.decode.padding(B)
            self.body(B, meta, hidden)  # warm-up
            if self.decode.cuda:
                graph = paddle.device.cuda.graphs.CUDAGraph()
                graph.capture_begin()
                self.outputs[B] = self.body(B, meta, hidden)
                graph.capture_end()
                self.graphs[B] = graph
                paddle.device.synchronize()
            how = "captured" if B in self.graphs else "prepared (no CUDA: re-run at each step)"
            logger.info("draft passes of bucket %d %s in %.2f s", B, how, time.monotonic() - started)

    def run(self, B: int, meta: ForwardMeta, hidden: paddle.Tensor) -> paddle.Tensor:
        """Bucket B's replay (or its body) over what ``staging`` holds: int64 [R, k + 2] on the
        device (``body``)."""
        self.replays += 1
        if B in self.graphs:
            self.graphs[B].replay()
            return self.outputs[B]
        return self.body(B, meta, hidden)
