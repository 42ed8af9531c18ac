"""Captured decode steps (docs/design.md §4.11): one persistent step buffer, one graph a bucket.

A pure-decode step of a bucket's size reads nothing but ``staging``, an int32 device buffer
allocated once for the largest bucket. A step of B rows fills its first B * (2 + sum of table
widths) entries with one host-to-device copy, laid out as

    input_ids [B] | positions [B] | block_tables[g] [B, width[g]] for each group g in order

(padding rows: token 0 at position 0, the null block; tables padded with -1). The captured body
slices and casts its inputs out of ``staging``, builds the step's ForwardMeta on the device
(``ForwardMetaBuilder.build_decode``), runs the model and its LM head, and leaves the logits
[B, vocab] in a tensor the graph owns. On a CUDA build of paddle each bucket is run once eagerly
(warm-up: Triton compiles, lazily made weights) and then captured with
``paddle.device.cuda.graphs.CUDAGraph``; a replay reruns its kernels only. Elsewhere the body is
re-run in place of a replay: the host work it repeats gives the same values at every call (the
bucket's constants), so the step computes what a replay would, and the CPU tests check the
contract (device-only inputs, no host sync, no upload) through it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np
import paddle

from fastdeploy.model_executor.forward_meta import ForwardMeta, ForwardMetaBuilder

logger = logging.getLogger("fastdeploy")


class DecodeGraphs:
    """``forward``: ForwardMeta -> logits float32 [B, vocab] of every row. ``buckets`` ascending
    batch sizes; ``null_block`` each KV cache group's null block id (its order is the tables'
    order in ``staging``); ``max_model_len`` bounds a row's context (the table width is its blocks);
    ``cuda``: capture CUDA graphs (else re-run the body)."""

    def __init__(
        self,
        forward: Callable[[ForwardMeta], paddle.Tensor],
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
        self.outputs: dict[int, paddle.Tensor] = {}
        self.replays = 0  # steps run captured

    def takes(self, step: dict) -> bool:
        """Whether ``step`` runs captured: a pure-decode step already padded to a bucket whose
        every sampled row is its own (no drafts), with no prompt logprobs and tables that fit."""
        B = len(step["seq_lens_encoder"])
        return (
            B in self.buckets
            and not any(step["seq_lens_encoder"])
            and not (step.get("prompt_logprobs") or {}).get("rows")
            and all(len(r) == 1 for r in step["sample_rows"])
            and all(len(row) <= self.width for rows in step["block_tables"].values() for row in rows)
        )

    def host_buffer(self, ids: list[int], positions: list[int], tables: dict[str, list[list[int]]]) -> np.ndarray:
        """The int32 layout of ``staging``'s first B rows (module docstring)."""
        B = len(ids)
        parts = [np.asarray(ids, np.int32), np.asarray(positions, np.int32)]
        for g in self.null_block:
            t = np.full((B, self.width), -1, np.int32)
            for b, row in enumerate(tables[g]):
                t[b, : len(row)] = row
            parts.append(t.reshape(-1))
        return np.concatenate(parts)

    def body(self, B: int) -> paddle.Tensor:
        """The captured step of bucket B: inputs out of ``staging`` (device ops), the model, its
        logits [B, vocab]."""
        s = self.staging[: B * self.row_len]
        ids, pos, at = s[:B].astype("int64"), s[B : 2 * B].astype("int64"), 2 * B
        tables = {}
        for g in self.null_block:
            tables[g] = s[at : at + B * self.width].reshape([B, self.width])
            at += B * self.width
        return self.forward(self.builder.build_decode(ids, pos, tables, self.max_model_len))

    def fill(self, buf: np.ndarray) -> None:
        """The step's one host-to-device copy, into ``staging`` in place."""
        self.staging[: buf.shape[0]] = paddle.to_tensor(buf, place=self.staging.place)

    def capture(self) -> None:
        """Each bucket, over a step of padding rows only (they write the null block): run once,
        then capture; capture time and memory are logged."""
        for B in reversed(self.buckets):
            started = time.monotonic()
            before = paddle.device.cuda.memory_allocated() if self.cuda else 0
            pad = {g: [[n]] * B for g, n in self.null_block.items()}
            self.fill(self.host_buffer([0] * B, [0] * B, pad))
            self.body(B)  # warm-up: compiles kernels, makes lazy weights outside the capture
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

    def run(self, step: dict) -> paddle.Tensor:
        """Logits [B, vocab] of a step ``takes`` accepted: one copy into ``staging``, then the
        bucket's replay (or its body)."""
        B = len(step["seq_lens_encoder"])
        self.fill(self.host_buffer(step["input_ids"], step["seq_lens_decoder"], step["block_tables"]))
        self.replays += 1
        if B in self.graphs:
            self.graphs[B].replay()
            return self.outputs[B]
        return self.body(B)
