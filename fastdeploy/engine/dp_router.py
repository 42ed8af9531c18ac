"""Which data-parallel engine core a request goes to (docs/design.md §4.19; SGLang's cache-aware
router, in small): the core that holds the longest prefix of its tokens, as far as the front
knows (the blocks of the prompts it sent there and of their outputs), unless that core is
loaded more than ``balance`` requests above the lightest; else the least loaded core."""

from __future__ import annotations

from collections import OrderedDict


class Router:
    """``num_ranks`` cores; ``block_size`` tokens a hashed block (the prefix cache's); each core
    remembers at most ``capacity`` block hashes (least recently routed forgotten first)."""

    def __init__(self, num_ranks: int, block_size: int, balance: int, capacity: int = 1 << 16) -> None:
        self.block_size, self.balance, self.capacity = block_size, balance, capacity
        self.load = [0] * num_ranks  # requests routed to each core and not finished
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_ranks)]

    def hashes(self, tokens: list[int]) -> list[int]:
        """Chained hashes of the full blocks of ``tokens`` (a block's hash covers all before it)."""
        out, h, bs = [], 0, self.block_size
        for i in range(0, len(tokens) - bs + 1, bs):
            h = hash((h, tuple(tokens[i : i + bs])))
            out.append(h)
        return out

    def matched(self, rank: int, hashes: list[int]) -> int:
        """How many leading blocks of a prompt core ``rank`` was sent before."""
        n = 0
        while n < len(hashes) and hashes[n] in self.seen[rank]:
            n += 1
        return n

    def choose(self, tokens: list[int]) -> int:
        """The core for a prompt of ``tokens``."""
        hashes, least = self.hashes(tokens), min(self.load)
        fair = [r for r in range(len(self.load)) if self.load[r] - least <= self.balance]
        best = max((self.matched(r, hashes) for r in fair), default=0)
        pool = [r for r in fair if self.matched(r, hashes) == best] if best else fair
        return min(pool, key=lambda r: (self.load[r], r))

    def sent(self, rank: int, tokens: list[int]) -> None:
        """A request of ``tokens`` went to core ``rank``."""
        self.load[rank] += 1
        self.remember(rank, tokens)

    def finished(self, rank: int, tokens: list[int]) -> None:
        """A request on core ``rank`` ended; ``tokens``: its prompt and output, now cached there."""
        self.load[rank] -= 1
        self.remember(rank, tokens)

    def remember(self, rank: int, tokens: list[int]) -> None:
        seen = self.seen[rank]
        for h in self.hashes(tokens):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
