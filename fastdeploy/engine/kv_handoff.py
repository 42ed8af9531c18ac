"""Prefill on one instance, decode on another (docs/design.md §4.20, ``../shared/DESIGN.md`` §V):
the engine's side of the KV handoff, over a ``kv_transfer.Transport``.

The decode instance (consumer) ``reserve``s a request: its cached prefix is kept, blocks are taken
for the rest of the prompt (in an SWA group only the last window's), and a ``KVTarget`` names
them with the addresses of its cache tensors. The prefill instance (producer) runs the prompt
with the target attached and ``max_tokens`` 1; when the request finishes, before its blocks are
freed, ``push`` writes exactly the target's blocks, every layer, in one batch. The decode
instance then ``commit``s the request with the first token: its prompt counts as computed and it
decodes on as if it had computed the prompt itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fastdeploy.config import FDConfig
from fastdeploy.kv_transfer.transport import Transport

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


class KVHandoff:
    """The driver's side of the handoff over its runner's transport: ``peers`` every
    tensor-parallel rank's (session, cache regions), this rank's first."""

    def __init__(self, fd: FDConfig, transport: Transport, peers: list[tuple[str, list[Region]]]) -> None:
        self.timeout = fd.kv_transfer_config.kv_timeout
        self.transport, self.peers = transport, peers
        self.regions = peers[0][1]
        self.bytes_sent = 0
        self.blocks_sent: dict[str, int] = {}

    def target(self, request_id: str, fill: dict[str, list[tuple[int, int]]]) -> KVTarget:
        (session, regions), *more = self.peers
        return KVTarget(request_id, session, regions, fill, more)

    def push(self, tables: dict[str, list[int]], target: KVTarget) -> int:
        """Write the target's blocks from this request's ``tables`` (logical -> physical, per
        group) into the caches of each of the consumer's ranks, every layer, one batch a rank;
        returns the bytes sent. ValueError when the target does not match this model or names a
        block this request does not hold; TransferError when a write fails or outlasts
        ``kv_timeout``."""
        n = 0
        for session, regions in [(target.session, target.regions), *target.more]:
            if [(g, b) for g, _, b, _ in regions] != [(g, b) for g, _, b, _ in self.regions]:
                raise ValueError("kv_transfer_params: the decode instance's caches differ from this model's")
            src, dst, lengths = [], [], []
            for (g, addr, per_block, _), (_, raddr, _, rblocks) in zip(self.regions, regions, strict=True):
                table = tables.get(g, [])
                for j, block in target.fill.get(g, []):
                    if not (0 <= j < len(table) and table[j] >= 0 and 0 <= block < rblocks):
                        raise ValueError(f"kv_transfer_params: block {j} of group {g} is not one to send")
                    src.append(addr + table[j] * per_block)
                    dst.append(raddr + block * per_block)
                    lengths.append(per_block)
            if src:
                self.transport.write_all(session, src, dst, lengths, self.timeout)
            n += sum(lengths)
        self.bytes_sent += n
        for g, pairs in target.fill.items():
            self.blocks_sent[g] = self.blocks_sent.get(g, 0) + len(pairs)
        return n
