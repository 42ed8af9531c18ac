"""The step's sampling where the logits are (docs/design.md §4.11).

``DeviceSampler.sample`` packs the rows' parameters into a few [B]-row arrays (one upload for all),
runs ``sample_tokens`` over the logits on the device, and copies back only the chosen tokens,
their logprobs and the asked-for top logprobs (one [B, 3] copy, plus [B', N] when any row wants
top logprobs). Requests with repetition / presence / frequency penalties own a slot of the count
tables (``counts`` output occurrences, ``seen`` prompt tokens, [slots, vocab] on the device), kept
current by a counting kernel after each draw and rebuilt from the request's tokens whenever the
slot's tally and the request disagree (a new request, a slot taken by another, a failed step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

from fastdeploy.model_executor.layers.sampler import SampleResult
from fastdeploy.model_executor.ops.triton_ops import sampling
from fastdeploy.model_executor.ops.triton_ops.sampling_kernel import (
    F_FREQUENCY,
    F_MIN_P,
    F_PRESENCE,
    F_REPETITION,
    F_TEMPERATURE,
    F_TOP_P,
    I_NUM_BIAS,
    I_SLOT,
    I_TOP_K,
    NUM_F,
    NUM_I,
    launch_count,
)
from fastdeploy.sampling_params import SamplingBatch, SamplingState


def upload(host: dict[str, np.ndarray]) -> dict[str, paddle.Tensor]:
    """int32 / float32 host arrays on the device in one host-to-device copy: their words
    concatenated (float32 bit patterns as int32), then cut apart on the device, float32 ones
    viewed back as float32."""
    flat = np.concatenate([np.ascontiguousarray(v).view(np.int32).ravel() for v in host.values()])
    dev, out, at = paddle.to_tensor(flat), {}, 0
    for k, v in host.items():
        part = dev[at : at + v.size].reshape(list(v.shape))
        out[k] = part.view("float32") if v.dtype == np.float32 else part
        at += v.size
    return out


class HostCopy:
    """Device tensors on their way to the host. On a GPU each is copied into pinned host memory
    asynchronously, queued right behind the work that makes it, with an event: a step launched
    behind it does not delay it, and ``wait`` waits for that event only (a blocking copy made
    later would also wait for everything queued since). Elsewhere the tensors are already there."""

    def __init__(self, tensors: list[paddle.Tensor]) -> None:
        self.event = None
        if tensors and tensors[0].place.is_gpu_place():  # pragma: no cover - CUDA paddle only
            tensors = [t._copy_to(paddle.CUDAPinnedPlace(), False) for t in tensors]
            self.event = paddle.device.cuda.Event()
            self.event.record()
        self.tensors = tensors

    def wait(self) -> list[np.ndarray]:
        if self.event is not None:  # pragma: no cover - CUDA paddle only
            self.event.synchronize()
        return [t.numpy() for t in self.tensors]


@dataclass(frozen=True)
class Drawn:
    """A launched draw: the drawn tokens int64 [B] on the device (a step launched behind it takes
    its placeholders' tokens from them; captured speculation accepts drafts on them), whether each
    row's logits were finite (bool [B], on the device), the rows' states, the rows that want top
    logprobs, and the copy to the host of [B, 3] (token, logprob, not finite) and of those rows'
    top logprobs and ids [rows, N] (the logits need not outlive the draw)."""

    tokens: paddle.Tensor
    ok: paddle.Tensor
    states: list[SamplingState]
    top_rows: list[int]
    host: HostCopy


class DeviceSampler:
    """Samples one token per row of a [B, vocab] logits tensor for B requests."""

    def __init__(self, vocab_size: int, max_slots: int, triton: bool) -> None:
        self.vocab_size, self.max_slots, self.triton = vocab_size, max_slots, triton
        self.counts: paddle.Tensor | None = None  # int32 [max_slots, vocab], allocated on first use
        self.seen: paddle.Tensor | None = None  # uint8 [max_slots, vocab]
        # what the op reads while no request has a slot (no row points at them: slot -1)
        self.no_counts = paddle.zeros([1, vocab_size], "int32")
        self.no_seen = paddle.zeros([1, vocab_size], "uint8")
        self.owner: list[SamplingState | None] = [None] * max_slots  # the request's state
        self.owner_key: list[str | None] = [None] * max_slots
        self.tally: list[int] = [0] * max_slots  # output tokens counted in each slot
        self.slot_of: dict[str, int] = {}

    def _slot_for(self, batch: SamplingBatch, b: int, in_step: set[int]) -> int:
        """A slot whose tables hold row b's tokens (rebuilt if they may not)."""
        key, owner, out = batch.keys[b], batch.states[b], batch.output_ids[b]
        s = self.slot_of.get(key)
        if s is not None and self.owner[s] is owner and self.tally[s] == len(out):
            return s
        if s is None or self.owner[s] is not owner:  # a free slot, else one of a request not in this step
            s = next(s for s, r in enumerate(self.owner) if r is None or id(r) not in in_step)
            if self.owner[s] is not None:
                self.slot_of.pop(self.owner_key[s], None)
        if self.counts is None:
            self.counts = paddle.zeros([self.max_slots, self.vocab_size], "int32")
            self.seen = paddle.zeros([self.max_slots, self.vocab_size], "uint8")
        if any(t < 0 for t in out):  # never: a row with a pending token kept its slot from the step before
            raise RuntimeError("penalty counts cannot be rebuilt while a sampled token is pending")
        row = np.zeros(self.vocab_size, np.int32)
        np.add.at(row, np.asarray(out, np.int64), 1)
        seen = np.zeros(self.vocab_size, np.uint8)
        seen[np.asarray(batch.prompt_ids[b], np.int64)] = 1
        self.counts[s] = paddle.to_tensor(row)
        self.seen[s] = paddle.to_tensor(seen)
        self.owner[s], self.owner_key[s], self.tally[s] = owner, key, len(out)
        self.slot_of[key] = s
        return s

    def pack(self, batch: SamplingBatch, span: int = 1) -> dict[str, np.ndarray]:
        """The rows' host arrays: fparams float32 [B, 8], iparams int32 [B, 4], seeds int32
        [B, 2] (with ``span`` > 1: [B, span, 2], the keys of the span steps from the row's own),
        bias_ids int32 / bias_vals float32 [B, NB >= 1]. Each row samples after its
        ``output_ids`` (penalties, min_tokens, the seed's step), tokens accepted earlier in this
        step among them (speculative verification, docs/design.md §4.16)."""
        B, outs, states = len(batch), batch.output_ids, batch.states
        f = np.zeros((B, NUM_F), np.float32)
        i = np.zeros((B, NUM_I), np.int32)
        cols = [F_TEMPERATURE, F_TOP_P, F_MIN_P, F_REPETITION, F_PRESENCE, F_FREQUENCY]
        f[:, cols] = [
            (s.temperature, s.top_p, s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty)
            for s in states
        ]
        i[:, I_TOP_K] = [min(s.top_k, self.vocab_size) for s in states]  # above the vocabulary: all of it
        i[:, I_SLOT] = -1
        n_out = [len(o) for o in outs]
        in_step = {id(st) for st in states}
        biases = []
        for b, st in enumerate(states):
            if st.penalized:
                i[b, I_SLOT] = self._slot_for(batch, b, in_step)
            bias = list(st.logit_bias.items()) if st.logit_bias else []
            if n_out[b] < st.min_tokens:
                bias += [(t, -np.inf) for t in st.min_tokens_stop_ids]
            biases.append(bias)
        i[:, I_NUM_BIAS] = [len(x) for x in biases]
        seeds = np.array([s.seed for s in states], np.uint64)
        steps = np.array(n_out, np.uint64)
        nb = max([1] + [len(x) for x in biases])
        bias_ids = np.full((B, nb), -1, np.int32)
        bias_vals = np.zeros((B, nb), np.float32)
        for b, bias in enumerate(biases):
            if bias:
                bias_ids[b, : len(bias)], bias_vals[b, : len(bias)] = zip(*bias, strict=True)
        return {
            "fparams": f,
            "iparams": i,
            "seeds": (
                sampling.row_keys(seeds, steps)
                if span == 1
                else np.stack([sampling.row_keys(seeds, steps + np.uint64(j)) for j in range(span)], 1)
            ),
            "bias_ids": bias_ids,
            "bias_vals": bias_vals,
        }

    def sample(self, logits: paddle.Tensor, batch: SamplingBatch) -> list[SampleResult | Exception]:
        """logits [B, vocab] on the device, one row per request of ``batch`` -> a result per row
        (a ValueError for a row whose logits are not finite: it fails that request only)."""
        return self.collect(self.draw(logits, batch))

    def draw(
        self, logits: paddle.Tensor, batch: SamplingBatch, shift: paddle.Tensor | None = None, span: int = 1
    ) -> Drawn:
        """Launch the draw of one token per row (device work only; nothing is copied back): the
        drawn tokens stay on the device (``Drawn.out.tokens``) for a step launched behind this one.
        ``shift`` int64 [B] on the device, 0 <= shift < ``span``: a row draws as if that many more
        tokens preceded it (its seed's step; a count only the device knows: a chained verify step,
        docs/design.md §4.18). Rows with a shift may not have penalties or a min_tokens left."""
        host = self.pack(batch, span)
        dev = upload(host)
        if shift is not None:
            rows = paddle.arange(len(batch), dtype="int64") * span + shift
            dev["seeds"] = paddle.gather(dev["seeds"].reshape([len(batch) * span, 2]), rows)
        counts = self.counts if self.counts is not None else self.no_counts
        seen = self.seen if self.seen is not None else self.no_seen
        out = sampling.sample_tokens(
            logits,
            counts,
            seen,
            dev["fparams"],
            dev["iparams"],
            dev["seeds"],
            dev["bias_ids"],
            dev["bias_vals"],
            triton=self.triton,
        )
        slots = host["iparams"][:, I_SLOT]
        if (slots >= 0).any():
            self._count(out.tokens, dev["iparams"], slots)
        want = [st.logprobs or 0 for st in batch.states]
        top_rows, tops = self._top_logprobs(logits, out.lse, want)
        got = paddle.stack([out.tokens.astype("float32"), out.logprobs, out.bad.astype("float32")], 1)
        tokens, ok = out.tokens.astype("int64"), paddle.logical_not(out.bad)
        return Drawn(tokens, ok, list(batch.states), top_rows, HostCopy([got, *tops]))

    def collect(self, drawn: Drawn) -> list[SampleResult | Exception]:
        """The draw's results on the host: one [B, 3] copy (the step's sync point), plus the top
        logprobs of the rows that want them."""
        states = drawn.states
        got, *top = drawn.host.wait()
        tops = {}
        for r, b in enumerate(drawn.top_rows):
            k = states[b].logprobs
            tops[b] = {int(t): float(v) for t, v in zip(top[1][r, :k], top[0][r, :k], strict=True)}
        results: list[SampleResult | Exception] = []
        for b, st in enumerate(states):
            if got[b, 2]:
                results.append(ValueError("the model's logits for this request are not finite"))
                continue
            tok, lp = int(got[b, 0]), float(got[b, 1])
            top = None
            if st.logprobs is not None:
                top = tops.get(b, {})
                top[tok] = lp
            results.append(SampleResult(tok, lp, top))
        return results

    def _count(self, tokens: paddle.Tensor, iparams: paddle.Tensor, slots: np.ndarray) -> None:
        """Count each drawn token in its row's slot (on the device)."""
        if self.triton:
            launch_count(tokens, iparams, self.counts)
        else:
            rows = np.nonzero(slots >= 0)[0]
            s = paddle.to_tensor(slots[rows].astype(np.int64))
            t = tokens[paddle.to_tensor(rows)].astype("int64")
            self.counts[s, t] = self.counts[s, t] + 1
        for s in slots[slots >= 0]:
            self.tally[s] += 1

    @staticmethod
    def _top_logprobs(
        logits: paddle.Tensor, lse: paddle.Tensor, want: list[int]
    ) -> tuple[list[int], list[paddle.Tensor]]:
        """The rows that want top logprobs, and (when any does) their N most likely raw tokens'
        logprobs float32 and ids int64 [rows, N], a top-k on the device."""
        rows = [b for b, n in enumerate(want) if n > 0]
        if not rows:
            return [], []
        n = min(max(want), logits.shape[1])
        idx = paddle.to_tensor(np.asarray(rows, np.int64))
        vals, ids = paddle.topk(logits[idx].astype("float32"), n, axis=1)
        return rows, [vals - lse[idx].unsqueeze(1), ids]
