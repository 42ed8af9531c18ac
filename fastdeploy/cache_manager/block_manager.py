"""Paged KV cache blocks: reference counts and prefix caching by hashed full blocks.

A full block's hash chains its parent's hash with its token ids, so equal hashes mean equal
prefixes. A freed block keeps its hash and stays reusable until it is handed out again (least
recently freed first). SWA layers keep their cache in the same blocks, so a hit serves them too.
"""

from __future__ import annotations

from collections import OrderedDict

from fastdeploy.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0  # tokens served from the prefix cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes(self, token_ids: list[int], n_blocks: int) -> list[int]:
        out, h = [], 0
        bs = self.block_size
        for i in range(n_blocks):
            h = hash((h, tuple(token_ids[i * bs : (i + 1) * bs])))
            out.append(h)
        return out

    def match_prefix(self, req: Request) -> int:
        """Take the longest cached run of the request's full blocks (keeping at least one token
        to compute); returns the number of cached tokens. Blocks are referenced by ``req``."""
        if not self.enable_prefix_caching or req.block_table:
            return 0
        tokens = req.all_token_ids
        n_full = (len(tokens) - 1) // self.block_size
        self.prefix_queries += len(tokens)
        for h in self._hashes(tokens, n_full):
            b = self.hash_to_block.get(h)
            if b is None:
                break
            self._ref(b)
            req.block_table.append(b)
        hit = len(req.block_table) * self.block_size
        self.prefix_hits += hit
        return hit

    def _ref(self, b: int) -> None:
        if self.ref_cnt[b] == 0:
            del self.free[b]
        self.ref_cnt[b] += 1

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Make ``req.block_table`` cover num_computed_tokens + num_new_tokens; False (nothing
        changed) when the pool is short."""
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_table)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        for _ in range(need):
            b, _ = self.free.popitem(last=False)
            if self.block_hash[b] is not None:  # evict its cached content
                self.hash_to_block.pop(self.block_hash[b], None)
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            req.block_table.append(b)
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's computed full blocks for prefix reuse."""
        if not self.enable_prefix_caching:
            return
        n_full = req.num_computed_tokens // self.block_size
        for b, h in zip(req.block_table[:n_full], self._hashes(req.all_token_ids, n_full), strict=True):
            if self.block_hash[b] is None and h not in self.hash_to_block:
                self.block_hash[b] = h
                self.hash_to_block[h] = b

    def free_request(self, req: Request) -> None:
        """Drop the request's references; tail blocks first, so they are evicted first."""
        for b in reversed(req.block_table):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free[b] = None
        req.block_table = []
