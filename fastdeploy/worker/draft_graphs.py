"""Captured draft passes (docs/design.md §4.16, §4.11): after a step that ran captured (a decode
or a verify step of bucket B), the MTP layer's k passes run as one graph of that bucket too.

A bucket's draft body reads nothing but ``staging``, an int32 device buffer allocated once, and
the decode step's own outputs (its ForwardMeta and hidden states, tensors the decode graph owns).
For B rows and R = ``requests[B]`` drafting requests, a step uses its first B + 3R entries:

    next_ids [B] | rows [R] | pos [R] | depth [R]

(``DraftStep``'s fields: the token after each row; per drafting request its row, that row's
position and how many drafts it takes; padding requests: row 0, depth 0). Pass 1 runs the MTP
layer over every row of the step with the step's meta and arg-maxes at each request's row;
passes 2..k run one row a request at positions pos + 1, ..., with the request's tables (its
row's, gathered from the decode step's staging). A request past its depth (and a padding one)
runs those passes at position 0 over the null block, as padding rows do, and its drafts there
are dropped on the host. The drafts [R, k] come back in one copy, as the eager passes' do.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import paddle

from fastdeploy.model_executor.forward_meta import ForwardMeta, ForwardMetaBuilder
from fastdeploy.model_executor.models.deepseek_mtp import DeepseekV3MTP
from fastdeploy.worker.decode_graphs import DecodeGraphs
from fastdeploy.worker.step_inputs import DraftStep

logger = logging.getLogger("fastdeploy")


class DraftGraphs:
    """The draft passes of each of ``decode``'s buckets. ``requests[B]``: the drafting requests a
    bucket of B rows holds (B for a decode bucket, B / (k + 1) for a verify bucket only); a step
    with more runs its passes eagerly."""

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
        top = decode.buckets[-1]
        self.staging = paddle.zeros([top + 3 * max(self.requests.values())], "int32")
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, paddle.Tensor] = {}
        self.replays = 0  # draft passes run captured

    def takes(self, msg: DraftStep, rows: int) -> bool:
        """Whether the draft passes over a captured step of ``rows`` rows run captured."""
        return (
            rows in self.requests
            and 0 < len(msg.rows) <= self.requests[rows]
            and len(msg.next_ids) <= rows
            and not msg.write_cache
        )

    def host_buffer(self, msg: DraftStep, B: int) -> np.ndarray:
        """int32 [B + 3R]: next_ids, rows, pos, depth, each padded (``staging``'s layout)."""
        pad = self.requests[B] - len(msg.rows)
        parts = [msg.next_ids + [0] * (B - len(msg.next_ids))]
        parts += [v + [0] * pad for v in (msg.rows, msg.pos, msg.depth)]
        return np.concatenate([np.asarray(p, np.int32) for p in parts])

    def body(self, B: int, meta: ForwardMeta, hidden: paddle.Tensor) -> paddle.Tensor:
        """The k passes of bucket B over the decode step's ``meta`` and ``hidden`` [B, hidden]:
        arg-max drafts int64 [R, k] (device ops only)."""
        R, s = self.requests[B], self.staging
        ids = s[:B].astype("int64")
        rows, pos, depth = (s[B + i * R : B + (i + 1) * R].astype("int64") for i in range(3))
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
        return paddle.stack(drafts, axis=1)

    def capture(self) -> None:
        """Each bucket, over padding (no drafting request) and the decode graph's outputs: run
        once, then captured on a CUDA device."""
        for B in reversed(self.decode.buckets):
            started = time.monotonic()
            empty = DraftStep([], [], [], [], [])
            self.staging[: B + 3 * self.requests[B]] = paddle.to_tensor(self.host_buffer(empty, B))
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

    def run(self, msg: DraftStep, meta: ForwardMeta, hidden: paddle.Tensor) -> np.ndarray:
        """The drafts of a step ``takes`` accepted: int64 [D, k], -1 past a request's depth (as
        ``MTPProposer.draft``'s). One copy in, the replay (or the body), one copy back."""
        B = hidden.shape[0]
        buf = self.host_buffer(msg, B)
        self.staging[: buf.shape[0]] = paddle.to_tensor(buf, place=self.staging.place)
        self.replays += 1
        if B in self.graphs:
            self.graphs[B].replay()
            drafts = self.outputs[B]
        else:
            drafts = self.body(B, meta, hidden)
        got = drafts[: len(msg.rows)].numpy()
        out = np.full((len(msg.rows), self.k), -1, np.int64)
        for i, d in enumerate(msg.depth):
            out[i, :d] = got[i, :d]
        return out
