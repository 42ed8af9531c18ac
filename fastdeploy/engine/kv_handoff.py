"""Prefill on one instance, decode on another (docs/design.md §4.20, ``../shared/DESIGN.md`` §V):
the engine's side of the KV handoff, over a ``kv_transfer.Transport``.

The decode instance (consumer) ``reserve``s a request: its cached prefix is kept, blocks are taken
for the rest of the prompt (in an SWA group only the last window's), and a ``KVTarget`` names
them with the addresses of its cache tensors. The prefill instance (producer) runs the prompt
with the target attached and ``max_tokens`` 1; when the request finishes, before its blocks are
freed, ``push`` writes exactly the target's blocks, every layer, in one batch (``kv_push`` end),
or waits for the layers' writes started as the prompt's last step finished each layer
(``layer_hook``, ``kv_push`` layer) and writes the rest. The decode instance then ``commit``s
the request with the first token: its prompt counts as computed and it decodes on as if it had
computed the prompt itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import paddle

from fastdeploy.config import FDConfig
from fastdeploy.kv_transfer.transport import TransferError, Transport
from fastdeploy.model_executor.layers.sampler import SampleResult
from fastdeploy.worker.kv_sizing import on_gpu

logger = logging.getLogger("fastdeploy")


Region = tuple[str, int, int, int]  # a cache tensor: its KV cache group, address, bytes a block, blocks


@dataclass(frozen=True)
class KVTarget:
    """Where a request's prompt KV goes: the consumer's transport ``session`` and cache tensors
    (``regions``), per group the (logical block, physical block) pairs to fill, and ``more``:
    the (session, regions) of the consumer's other tensor-parallel ranks (each holds the whole
    latent cache, so each gets the same blocks)."""

    request_id: str
    session: str
    regions: list[Region]
    fill: dict[str, list[tuple[int, int]]]
    more: list[tuple[str, list[Region]]] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "session": self.session,
            "regions": [list(r) for r in self.regions],
            "fill": {g: [list(p) for p in ps] for g, ps in self.fill.items()},
            "more": [[s, [list(r) for r in rs]] for s, rs in self.more],
        }

    @classmethod
    def from_json(cls, d: dict) -> KVTarget:
        """ValueError naming what is malformed."""

        def regions(rs) -> list[Region]:
            return [(str(g), int(a), int(b), int(n)) for g, a, b, n in rs]

        try:
            fill = {str(g): [(int(j), int(b)) for j, b in ps] for g, ps in d["fill"].items()}
            more = [(str(s), regions(rs)) for s, rs in d.get("more", [])]
            return cls(str(d["request_id"]), str(d["session"]), regions(d["regions"]), fill, more)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"kv_transfer_params: not a KV target ({type(e).__name__}: {e})") from None


@dataclass
class PrefillResult:
    """What a prefill instance hands a decode instance for one sequence with its KV
    (``first_tokens[i]``): the first token's sample, the prompt tokens its prefix cache held
    (what usage reports), its MTP drafts after the token, and when asked the prompt's logprobs
    and ranks (``RequestOutput``'s)."""

    first: SampleResult
    cached_tokens: int = 0
    drafts: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None

    def to_json(self) -> dict:
        def ids(d: dict | None) -> dict | None:
            return {str(k): v for k, v in d.items()} if d is not None else None

        return {
            "token_id": self.first.token_id,
            "logprob": self.first.logprob,
            "top_logprobs": ids(self.first.top_logprobs),
            "cached_tokens": self.cached_tokens,
            "draft_token_ids": self.drafts,
            "prompt_logprobs": [ids(e) for e in self.prompt_logprobs] if self.prompt_logprobs is not None else None,
            "prompt_ranks": self.prompt_ranks,
        }

    @classmethod
    def from_json(cls, d: dict, vocab_size: int, prompt_len: int) -> PrefillResult:
        """ValueError (or KeyError, TypeError) naming what is malformed: a token id outside the
        vocabulary, prompt logprobs not one entry a prompt token."""

        def ids(e: dict | None) -> dict[int, float] | None:
            return {int(k): float(v) for k, v in e.items()} if e is not None else None

        tok, drafts = int(d["token_id"]), [int(t) for t in d.get("draft_token_ids") or []]
        if not all(0 <= t < vocab_size for t in [tok, *drafts]):
            raise ValueError(f"a token id outside the vocabulary [0, {vocab_size})")
        lps, ranks = d.get("prompt_logprobs"), d.get("prompt_ranks")
        if lps is not None:
            lps = [ids(e) for e in lps]
            ranks = [int(r) if r is not None else None for r in ranks]
            if not len(lps) == len(ranks) == prompt_len:
                raise ValueError(f"prompt_logprobs and prompt_ranks: one entry a prompt token ({prompt_len})")
        first = SampleResult(tok, float(d.get("logprob", 0.0)), ids(d.get("top_logprobs")))
        return cls(first, int(d.get("cached_tokens", 0)), drafts, lps, ranks if lps is not None else None)


Batch = tuple[str, list[int], list[int], list[int]]  # one write: peer session, sources, destinations, lengths


def device_event() -> object | None:
    """An event recorded behind the device work queued so far; None on CPU, where that work is
    done by the time the host gets here."""
    if not on_gpu():
        return None
    event = paddle.device.Event()
    event.record()
    return event


class KVHandoff:
    """The driver's side of the handoff over its runner's transport: ``peers`` every
    tensor-parallel rank's (session, cache regions), this rank's first; ``layers`` the decoder
    layer whose forward writes each region (the MTP layer's: ``num_hidden_layers``, written by
    the draft pass)."""

    def __init__(
        self, fd: FDConfig, transport: Transport, peers: list[tuple[str, list[Region]]], layers: list[int]
    ) -> None:
        self.timeout = fd.kv_transfer_config.kv_timeout
        self.transport, self.peers = transport, peers
        self.regions, self.layers = peers[0][1], layers
        self.bytes_sent = 0
        self.blocks_sent: dict[str, int] = {}
        self.by_layer = fd.kv_transfer_config.kv_push == "layer"
        self.sender = ThreadPoolExecutor(1, "kv-push") if self.by_layer else None
        self.started: dict[str, list[tuple[Future, list[int]]]] = {}  # request id -> (write, its regions)
        self.layer_writes = 0  # writes started as a layer finished (kv_push layer), a request's each

    def target(self, request_id: str, fill: dict[str, list[tuple[int, int]]]) -> KVTarget:
        (session, regions), *more = self.peers
        return KVTarget(request_id, session, regions, fill, more)

    def layer_hook(self, done: list[tuple[dict[str, list[int]], KVTarget]]) -> Callable[[int], None] | None:
        """With ``kv_push`` layer, for a step that completes the prompts of ``done`` (each
        one's block tables and target): the ``ForwardMeta.layer_done`` that starts writing a
        layer's blocks of each once that layer's work is done (a device event, waited for on the
        sender thread, so the forward is not held up). None when there is nothing to start."""
        if not (self.by_layer and done):
            return None

        def layer_done(layer: int) -> None:
            regions = [r for r, at in enumerate(self.layers) if at == layer]
            event = device_event()
            for tables, target in done:
                try:  # the addresses now: the tables change as the engine goes on
                    write = self.sender.submit(self._write, self._batches(tables, target, regions), event)
                except ValueError as e:  # the push raises it: that request fails, not the step
                    write = Future()
                    write.set_exception(e)
                self.started.setdefault(target.request_id, []).append((write, regions))
                self.layer_writes += 1

        return layer_done

    def forget(self, request_id: str) -> None:
        """Drop the layer writes started for a request that will not be pushed (it failed or was
        aborted); they finish or fail on their own."""
        self.started.pop(request_id, None)

    def push(self, tables: dict[str, list[int]], target: KVTarget) -> int:
        """Write the target's blocks from this request's ``tables`` (logical -> physical, per
        group) into the caches of each of the consumer's ranks, every layer (those started layer
        by layer waited for, the rest in one batch a rank); returns the bytes sent. ValueError
        when the target does not match this model or names a block this request does not hold;
        TransferError when a write fails or the whole push outlasts ``kv_timeout``."""
        deadline = time.monotonic() + self.timeout
        started = self.started.pop(target.request_id, [])
        done = {r for _, regions in started for r in regions}
        rest = [r for r in range(len(self.regions)) if r not in done]
        writes, n = [], 0
        for write, _ in started:
            try:
                handles, sent = write.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise TransferError(f"a layer's KV write did not start in {self.timeout:g} s") from None
            writes += handles
            n += sent
        handles, sent = self._write(self._batches(tables, target, rest), None)
        writes += handles
        n += sent
        for peer, handle in writes:
            self.transport.wait(peer, handle, deadline)
        self.bytes_sent += n
        for g, pairs in target.fill.items():
            self.blocks_sent[g] = self.blocks_sent.get(g, 0) + len(pairs)
        return n

    def _write(self, batches: list[Batch], event: object | None) -> tuple[list[tuple[str, object]], int]:
        """Start each write once ``event`` is done: the (peer, handle) of each, and the bytes."""
        if event is not None:
            event.synchronize()
        return [(b[0], self.transport.write(*b)) for b in batches if b[1]], sum(sum(b[3]) for b in batches)

    def _batches(self, tables: dict[str, list[int]], target: KVTarget, regions: list[int]) -> list[Batch]:
        """One write a consumer rank of the target's blocks of ``regions`` (indices into this
        model's cache regions); ValueError when the target's caches are not this model's or it
        names a block the request does not hold."""
        out = []
        for session, theirs in [(target.session, target.regions), *target.more]:
            if [(g, b) for g, _, b, _ in theirs] != [(g, b) for g, _, b, _ in self.regions]:
                raise ValueError("kv_transfer_params: the decode instance's caches differ from this model's")
            src, dst, lengths = [], [], []
            for r in regions:
                (g, addr, per_block, _), (_, raddr, _, rblocks) = self.regions[r], theirs[r]
                table = tables.get(g, [])
                for j, block in target.fill.get(g, []):
                    if not (0 <= j < len(table) and table[j] >= 0 and 0 <= block < rblocks):
                        raise ValueError(f"kv_transfer_params: block {j} of group {g} is not one to send")
                    src.append(addr + table[j] * per_block)
                    dst.append(raddr + block * per_block)
                    lengths.append(per_block)
            out.append((session, src, dst, lengths))
        return out
