"""Captured decode steps (docs/design.md §4.11): one persistent step buffer, one graph a bucket.

A step runs captured as decode rows: a pure-decode step (one row a request), or a verify step
(§4.16: one row a token, a request's last token and its drafts at consecutive positions, all
with its tables), padded to a bucket. A bucket's step reads nothing but ``staging``, an int32 device buffer
allocated once for the largest bucket. A step of B rows uses its first B * (2 + groups * width)
entries, laid out as

    input_ids [B] | positions [B] | block_tables[g] [B, width] for each group g in order

(padding rows: token 0 at position 0, the null block). One host-to-device copy a step brings the
ids, the positions and each table's first w columns (w: the step's longest row, -1 padded); the
columns past w keep what earlier steps wrote, which nothing reads (a row's kernels read its table
only up to its position's block). The captured body slices and casts its inputs out of
``staging``, builds the step's ForwardMeta on the device (``ForwardMetaBuilder.build_decode``),
runs the model and its LM head, and leaves the ForwardMeta, hidden states and logits [B, vocab]
in tensors the graph owns. On a
CUDA build of paddle each bucket is run once eagerly (warm-up: Triton compiles, lazily made
weights) and then captured with ``paddle.device.cuda.graphs.CUDAGraph``; a replay reruns its
kernels only. Elsewhere the body is re-run in place of a replay: the host work it repeats gives
the same values at every call (the bucket's constants), so the step computes what a replay would,
and the CPU tests check the contract (device-only inputs, no host sync, no upload) through it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np
import paddle

from fastdeploy.model_executor.forward_meta import ForwardMeta, ForwardMetaBuilder
from fastdeploy.worker.step_inputs import StepInputs

logger = logging.getLogger("fastdeploy")


class DecodeGraphs:
    """``forward``: ForwardMeta -> (hidden states [B, hidden], logits float32 [B, vocab]) of every
    row. ``buckets`` ascending row counts (decode batches; with speculation also verify steps'
    requests x (k + 1) rows); ``null_block`` each KV cache group's null block id (its order is the
    tables' order in ``staging``); ``max_model_len`` bounds a row's context (the table width is its
    blocks); ``cuda``: capture CUDA graphs (else re-run the body)."""

    def __init__(
        self,
        forward: Callable[[ForwardMeta], tuple[paddle.Tensor, paddle.Tensor]],
        builder: ForwardMetaBuilder,
        buckets: tuple[int, ...],
        null_block: dict[str, int],
        max_model_len: int,
        cuda: bool,
    ) -> None:
        self.forward, self.builder, self.buckets = forward, builder, tuple(buckets)
        self.null_block, self.max_model_len, self.cuda = dict(null_block), max_model_len, cuda
        self.width = math.ceil(max_model_len / builder.block_size)
        self.row_len = 2 + self.width * len(self.null_block)
        self.staging = paddle.zeros([self.buckets[-1] * self.row_len], "int32")
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, tuple[ForwardMeta, paddle.Tensor, paddle.Tensor]] = {}
        self.replays = 0  # steps run captured

    def takes(self, step: StepInputs) -> bool:
        """Whether ``step`` runs captured: every token of the step samples, in order (a pure
        decode, padded to its bucket; or a verify step, each request's last token and its drafts,
        run as one decode row a token), within the largest bucket, with no prompt logprobs and
        tables that fit."""
        T = len(step.input_ids)
        if step.is_decode:
            ok = step.batch_size in self.buckets and all(len(r) == 1 for r in step.sample_rows)
        else:  # each request samples at every one of its tokens
            spans, row = [], 0
            for enc in step.seq_lens_encoder:
                spans.append(list(range(row, row + max(enc, 1))))
                row += max(enc, 1)
            ok = row == T <= self.buckets[-1] and step.sample_rows == spans
            ok = ok and step.samples_at == list(range(step.batch_size))
        return (
            ok
            and not step.prompt_logprobs.rows
            and all(len(row) <= self.width for rows in step.block_tables.values() for row in rows)
        )

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket of at least ``rows`` rows (None: more than the largest)."""
        return next((b for b in self.buckets if b >= rows), None)

    def rows_of(self, step: StepInputs) -> tuple[int, list[int], list[int], dict[str, list[list[int]]]]:
        """A step ``takes`` accepted as decode rows padded to a bucket: the bucket B, and per row
        its token, position and tables (a verify request's rows share its tables; padding rows:
        token 0 at position 0, the null block)."""
        pos, tables = [], {g: [] for g in self.null_block}
        for b, (enc, dec) in enumerate(zip(step.seq_lens_encoder, step.seq_lens_decoder, strict=True)):
            for j in range(max(enc, 1)):
                pos.append(dec + j)
                for g, rows in tables.items():
                    rows.append(step.block_tables[g][b])
        B = self.bucket(len(pos))
        pad = B - len(pos)
        for g, rows in tables.items():
            rows += [[self.null_block[g]]] * pad
        return B, list(step.input_ids) + [0] * pad, pos + [0] * pad, tables

    def host_buffer(self, ids: list[int], positions: list[int], tables: dict[str, list[list[int]]]) -> np.ndarray:
        """int32: ids [B], positions [B], then each group's tables [B, w] (w: the longest row),
        -1 padded."""
        w = max(len(row) for rows in tables.values() for row in rows)
        parts = [np.asarray(ids, np.int32), np.asarray(positions, np.int32)]
        for g in self.null_block:
            parts.append(np.asarray([row + [-1] * (w - len(row)) for row in tables[g]], np.int32).reshape(-1))
        return np.concatenate(parts)

    def table_views(self, B: int) -> list[paddle.Tensor]:
        """Views of ``staging``'s block tables [B, width] for bucket B, in the groups' order."""
        at = 2 * B
        views = []
        for _ in self.null_block:
            views.append(self.staging[at : at + B * self.width].reshape([B, self.width]))
            at += B * self.width
        return views

    def body(self, B: int) -> tuple[ForwardMeta, paddle.Tensor, paddle.Tensor]:
        """The captured step of bucket B: inputs out of ``staging`` (device ops), its ForwardMeta,
        the model's hidden states [B, hidden] and its logits [B, vocab]."""
        ids, pos = self.staging[:B].astype("int64"), self.staging[B : 2 * B].astype("int64")
        tables = dict(zip(self.null_block, self.table_views(B), strict=True))
        meta = self.builder.build_decode(ids, pos, tables, self.max_model_len)
        return meta, *self.forward(meta)

    def fill(self, buf: np.ndarray, B: int) -> None:
        """The step's one host-to-device copy (``host_buffer``'s layout for B rows), then its
        parts into ``staging`` in place: ids and positions, each table's first w columns."""
        dev = paddle.to_tensor(buf, place=self.staging.place)
        w = (buf.shape[0] - 2 * B) // (B * len(self.null_block))
        self.staging[: 2 * B] = dev[: 2 * B]
        for i, view in enumerate(self.table_views(B)):
            view[:, :w] = dev[2 * B + i * B * w : 2 * B + (i + 1) * B * w].reshape([B, w])

    def padding(self, B: int) -> tuple[ForwardMeta, paddle.Tensor, paddle.Tensor]:
        """Bucket B's body over a step of padding rows only (they write the null block)."""
        pad = {g: [[n]] * B for g, n in self.null_block.items()}
        self.fill(self.host_buffer([0] * B, [0] * B, pad), B)
        return self.body(B)

    def capture(self) -> None:
        """Each bucket, over a step of padding rows only (they write the null block): run once,
        then capture; capture time and memory are logged."""
        for B in reversed(self.buckets):
            started = time.monotonic()
            before = paddle.device.cuda.memory_allocated() if self.cuda else 0
            self.padding(B)  # warm-up: compiles kernels, makes lazy weights outside the capture
            if self.cuda:
                graph = paddle.device.cuda.graphs.CUDAGraph()
                graph.capture_begin()
                self.outputs[B] = self.body(B)
                graph.capture_end()
                self.graphs[B] = graph
                paddle.device.synchronize()
            mem = (paddle.device.cuda.memory_allocated() - before) / 2**20 if self.cuda else 0.0
            logger.info(
                "decode bucket %d %s in %.2f s (%.1f MiB)",
                B,
                "captured" if self.cuda else "prepared (no CUDA: re-run at each step)",
                time.monotonic() - started,
                mem,
            )

    def run(
        self, step: StepInputs, at: paddle.Tensor | None = None, filled: paddle.Tensor | None = None
    ) -> tuple[ForwardMeta, paddle.Tensor, paddle.Tensor]:
        """ForwardMeta, hidden states and logits [B, vocab] of a step ``takes`` accepted, its
        tokens as the bucket's first rows: one copy into ``staging`` (then, for placeholder rows
        ``at`` int64 [P], their tokens ``filled`` int64 [P] from the device; for a chained step,
        ``filled`` int64 [2T] its tokens then its positions), then the bucket's replay (or its
        body)."""
        B, ids, pos, tables = self.rows_of(step)
        self.fill(self.host_buffer(ids, pos, tables), B)
        if step.chained:
            T = len(step.input_ids)
            self.staging[:T] = filled[:T].astype("int32")
            self.staging[B : B + T] = filled[T:].astype("int32")
        elif at is not None:
            self.staging[:B] = paddle.scatter(self.staging[:B], at, filled.astype("int32"))
        self.replays += 1
        if B in self.graphs:
            self.graphs[B].replay()
            return self.outputs[B]
        return self.body(B)
