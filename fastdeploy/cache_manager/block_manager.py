"""Paged KV cache blocks per KV cache group: reference counts, prefix caching, SWA release.

Each group (``full``: full-attention layers, ``swa``: sliding-window layers) has its own pool,
and a request holds one block table per group, indexed by logical block (position // block_size).
A full block's hash chains its parent's hash with its token ids, so equal hashes mean equal
prefixes; both groups key their cached blocks by the same hashes. A freed block keeps its hash
and can serve a prefix hit until it is handed out again (least recently freed first).

SWA release (docs/design.md §4.2): before a step in which a request computes from position p0
on, its SWA blocks j with (j + 1) * block_size <= p0 - W + 1 hold nothing any later query can see;
their table entries become -1 and they return to the pool. A request's SWA blocks are so bounded
by ``swa_blocks_per_request`` however long it grows.

Prefix hit: the longest run of n blocks (leaving at least one token to compute) whose full-group
blocks 0..n-1 are cached and whose SWA blocks covering positions [n * bs - W + 1, n * bs - 1] are
cached. Hit blocks are only read: the request computes from n * bs on, into blocks of its own.
"""

from __future__ import annotations

from collections import OrderedDict

from fastdeploy.config import FULL_GROUP, SWA_GROUP
from fastdeploy.request import Request


class BlockPool:
    """One group's blocks: reference counts, the free list in eviction order (least recently
    freed first) and the cached blocks by hash."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def take(self) -> int:
        """A free block for new content (its cached content, if any, is evicted); reference 1."""
        b, _ = self.free.popitem(last=False)
        if self.block_hash[b] is not None:
            self.hash_to_block.pop(self.block_hash[b], None)
            self.block_hash[b] = None
        self.ref_cnt[b] = 1
        return b

    def ref(self, b: int) -> None:
        if self.ref_cnt[b] == 0:
            del self.free[b]
        self.ref_cnt[b] += 1

    def unref(self, b: int) -> None:
        self.ref_cnt[b] -= 1
        if self.ref_cnt[b] == 0:
            self.free[b] = None  # most recently freed: evicted last

    def cache(self, b: int, h: int) -> None:
        if self.block_hash[b] is None and h not in self.hash_to_block:
            self.block_hash[b] = h
            self.hash_to_block[h] = b


class BlockManager:
    """Block pools of the groups in ``num_blocks`` ({group: blocks}); ``sliding_window`` is the
    SWA group's W. ``release_swa`` False keeps every SWA block (a test hook: outputs must not change)."""

    def __init__(
        self,
        num_blocks: dict[str, int],
        block_size: int,
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        if SWA_GROUP in num_blocks and not sliding_window:
            raise ValueError("an SWA block pool needs the sliding_window")
        self.pools = {g: BlockPool(n) for g, n in num_blocks.items()}
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.release_swa = True
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens served from the cache
        self.prefix_hit_blocks = dict.fromkeys(self.pools, 0)  # blocks reused, per group
        self.swa_blocks_released = 0

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free for p in self.pools.values())

    @property
    def num_used_blocks(self) -> int:
        return sum(p.num_used for p in self.pools.values())

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _tables(self, req: Request) -> dict[str, list[int]]:
        for g in self.pools:
            req.block_tables.setdefault(g, [])
        return req.block_tables

    def first_visible_block(self, p0: int) -> int:
        """The first logical SWA block a query at position >= p0 can see."""
        return max(0, p0 - self.sliding_window + 1) // self.block_size

    def block_hashes(self, req: Request, n_blocks: int) -> list[int]:
        """Chained hashes of the request's first n full blocks (memoised on the request)."""
        bs, hs, tokens = self.block_size, req.block_hashes, req.all_token_ids
        h = hs[-1] if hs else 0
        for i in range(len(hs), n_blocks):
            h = hash((h, tuple(tokens[i * bs : (i + 1) * bs])))
            hs.append(h)
        return hs[:n_blocks]

    def match_prefix(self, req: Request) -> int:
        """Reference the longest cached prefix of a new request (leaving at least one token to
        compute); returns the number of cached tokens. A request that asks for prompt logprobs
        reads no cached block (a cached prefix has no logits): it computes its whole prompt, and
        its blocks are registered for later requests as any other's."""
        tables = self._tables(req)
        if not self.enable_prefix_caching or any(tables.values()) or req.prompt_logprobs is not None:
            return 0
        tokens, bs = req.all_token_ids, self.block_size
        self.prefix_queries += len(tokens)
        hashes = self.block_hashes(req, (len(tokens) - 1) // bs)
        full, swa = self.pools.get(FULL_GROUP), self.pools.get(SWA_GROUP)
        n = len(hashes)
        if full is not None:
            n = next((i for i, h in enumerate(hashes) if h not in full.hash_to_block), n)
        if swa is not None:  # shorten until the window before the hit point is cached too
            while n > 0 and any(
                h not in swa.hash_to_block for h in hashes[self.first_visible_block(n * self.block_size) : n]
            ):
                n -= 1
        for g, pool in self.pools.items():
            lo = self.first_visible_block(n * bs) if g == SWA_GROUP else 0
            tables[g] += [-1] * lo
            for h in hashes[lo:n]:
                b = pool.hash_to_block[h]
                pool.ref(b)
                tables[g].append(b)
            self.prefix_hit_blocks[g] += n - lo
        hit = n * bs
        self.prefix_hits += hit
        return hit

    def release(self, req: Request) -> int:
        """Return the SWA blocks no query from the request's next position on can see, counting
        from its first token whose step has not been taken (that step may fail and be retried;
        its blocks get their hashes when it is taken); returns how many. Their table entries
        become -1; the blocks keep their hashes."""
        swa = self.pools.get(SWA_GROUP)
        if swa is None or not self.release_swa:
            return 0
        table = self._tables(req)[SWA_GROUP]
        released, end = 0, min(self.first_visible_block(req.num_computed_tokens - req.inflight_tokens), len(table))
        for j in range(req.swa_released_upto, end):
            if table[j] >= 0:
                swa.unref(table[j])
                table[j] = -1
                released += 1
        req.swa_released_upto = max(req.swa_released_upto, end)
        self.swa_blocks_released += released
        return released

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Release the request's out-of-window SWA blocks, then make every table cover
        num_computed_tokens + num_new_tokens; False (no block taken) when a pool is short."""
        self.release(req)
        tables = self._tables(req)
        target = self.blocks_needed(req.num_computed_tokens + num_new_tokens)
        if all(len(t) >= target for t in tables.values()):  # most decode steps: the last block has room
            return True
        need = {g: max(0, target - len(tables[g])) for g in self.pools}
        if any(need[g] > pool.num_free for g, pool in self.pools.items()):
            return False
        for g, pool in self.pools.items():
            tables[g] += [pool.take() for _ in range(need[g])]
        return True

    def allocate_remote(self, req: Request) -> dict[str, list[tuple[int, int]]] | None:
        """A request whose prompt another instance computes (docs/design.md §4.20): its cached
        prefix referenced (``match_prefix``), then blocks taken for the rest of the prompt, in
        an SWA group only from the window the first generated position sees. Returns, per group,
        (logical index, block) of each block to fill; None (nothing kept) when a pool is short."""
        hit = self.match_prefix(req)
        tables, bs, n = self._tables(req), self.block_size, len(req.prompt_token_ids)
        target = self.blocks_needed(n)
        lo = {g: self.first_visible_block(n) if g == SWA_GROUP else 0 for g in self.pools}
        need = {g: target - max(len(tables[g]), lo[g]) for g in self.pools}
        if any(need[g] > pool.num_free for g, pool in self.pools.items()):
            self.free_request(req)
            return None
        fill: dict[str, list[tuple[int, int]]] = {}
        for g, pool in self.pools.items():
            table = tables[g]
            for j in range(len(table), target):
                table.append(pool.take() if j >= lo[g] else -1)
            fill[g] = [(j, table[j]) for j in range(hit // bs, target) if table[j] >= 0]
        return fill

    def cache_full_blocks(self, req: Request, num_computed: int | None = None) -> None:
        """Register the request's full blocks among its first ``num_computed`` tokens (default:
        its computed tokens; steps still running do not count) for prefix reuse, in every group."""
        if not self.enable_prefix_caching:
            return
        n_full = (req.num_computed_tokens if num_computed is None else num_computed) // self.block_size
        hashes = self.block_hashes(req, n_full)
        for g, pool in self.pools.items():
            for b, h in zip(self._tables(req)[g][:n_full], hashes, strict=True):
                if b >= 0:
                    pool.cache(b, h)

    def free_request(self, req: Request) -> None:
        """Drop the request's references. Full blocks go tail first (evicted first: a tail is the
        least shared part); SWA blocks head first, so the window at the end, which the next turn
        of a conversation needs for a prefix hit, is evicted last."""
        for g, table in self._tables(req).items():
            order = table if g == SWA_GROUP else reversed(table)
            for b in order:
                if b >= 0:
                    self.pools[g].unref(b)
            req.block_tables[g] = []
        req.swa_released_upto = 0
