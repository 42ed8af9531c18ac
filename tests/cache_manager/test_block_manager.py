"""Block pools per KV cache group: SWA release and its bound, reference counts while requests
share blocks, prefix hits across groups. Windows and bounds are written out here (W = 32,
block 16), not read from the code under test."""

import pytest

from fastdeploy.cache_manager.block_manager import BlockManager
from fastdeploy.request import Request
from fastdeploy.sampling_params import SamplingParams

W, BS = 32, 16


def bound(chunk: int) -> int:
    return -(-(W - 1 + chunk) // BS) + 1


def request(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams())


def step(bm: BlockManager, req: Request, n: int) -> None:
    """One engine step of n tokens for req: allocate, compute, register full blocks."""
    assert bm.allocate(req, n)
    req.num_computed_tokens += n
    bm.cache_full_blocks(req)


def held(req: Request, g: str) -> list[int]:
    return [b for b in req.block_tables[g] if b >= 0]


def visible_blocks(p0: int, n: int) -> set[int]:
    """Logical blocks any query at p0 .. p0 + n - 1 can see: positions max(0, p0 - W + 1) .. p0 + n - 1."""
    return set(range(max(0, p0 - W + 1) // BS, (p0 + n - 1) // BS + 1))


@pytest.mark.parametrize("chunk", [7, 32, 45])  # below, equal to and above W
def test_release_keeps_only_the_window_over_20w(chunk):
    bm = BlockManager({"full": 200, "swa": 12}, BS, sliding_window=W)
    req = request(range(5 * W))
    peak = 0
    while req.num_computed_tokens < req.num_tokens:  # chunked prefill
        p0, n = req.num_computed_tokens, min(chunk, req.num_tokens - req.num_computed_tokens)
        assert bm.allocate(req, n)
        swa = req.block_tables["swa"]
        kept = {j for j, b in enumerate(swa) if b >= 0}
        assert kept == visible_blocks(p0, n)  # exactly the blocks some query of the step can see
        assert all(b == -1 for j, b in enumerate(swa) if j not in kept)
        assert len(req.block_tables["full"]) == -(-(p0 + n) // BS)  # full blocks grow with L
        peak = max(peak, len(kept))
        req.num_computed_tokens += n
    while req.num_tokens < 20 * W:  # decode to 20W
        req.output_token_ids.append(1)
        p0 = req.num_computed_tokens
        assert bm.allocate(req, 1)
        assert {j for j, b in enumerate(req.block_tables["swa"]) if b >= 0} == visible_blocks(p0, 1)
        peak = max(peak, len(held(req, "swa")))
        req.num_computed_tokens += 1
    assert peak <= bound(chunk) and len(req.block_tables["full"]) == 20 * W // BS
    assert bm.swa_blocks_released == len(req.block_tables["swa"]) - len(held(req, "swa"))
    assert bm.pools["swa"].num_used == len(held(req, "swa")) <= bound(1)
    bm.free_request(req)
    assert bm.pools["full"].num_free == 200 and bm.pools["swa"].num_free == 12


def test_allocate_is_all_or_nothing_across_pools():
    bm = BlockManager({"full": 3, "swa": 2}, BS, sliding_window=W)
    req = request(range(40))
    assert not bm.allocate(req, 40)  # 3 full blocks fit, 3 SWA blocks do not
    assert req.block_tables == {"full": [], "swa": []}
    assert bm.pools["full"].num_free == 3 and bm.pools["swa"].num_free == 2
    assert bm.allocate(req, 32)


def test_shared_prefix_reference_counts_with_release():
    bm = BlockManager({"full": 40, "swa": 40}, BS, enable_prefix_caching=True, sliding_window=W)
    shared = list(range(100, 164))  # 4 blocks
    a = request(shared + [1, 2, 3], "a")
    step(bm, a, a.num_tokens)
    b = request(shared + [7] * 40, "b")
    assert bm.match_prefix(b) == 64
    b.num_computed_tokens = 64
    full, swa = bm.pools["full"], bm.pools["swa"]
    # b needs positions 64 - W + 1 = 33 .. 63 before its own: SWA blocks 2, 3 of a, not 0, 1
    assert b.block_tables["full"] == a.block_tables["full"][:4]
    assert b.block_tables["swa"] == [-1, -1] + a.block_tables["swa"][2:4]
    assert [full.ref_cnt[x] for x in a.block_tables["full"]] == [2, 2, 2, 2, 1]
    assert [swa.ref_cnt[x] for x in a.block_tables["swa"]] == [1, 1, 2, 2, 1]
    step(bm, b, 20)
    assert b.block_tables["swa"][:4] == [-1, -1] + a.block_tables["swa"][2:4]  # released before a step, not after
    assert bm.release(b) == 1  # before b's next step: queries from 84 see 84 - 31 = 53 on, not block 2
    assert b.block_tables["swa"][:3] == [-1, -1, -1]
    assert [swa.ref_cnt[x] for x in a.block_tables["swa"]] == [1, 1, 1, 2, 1]
    used_before = full.num_used, swa.num_used
    bm.free_request(a)
    assert [full.ref_cnt[x] for x in b.block_tables["full"]] == [1, 1, 1, 1, 1, 1]
    assert full.num_used == used_before[0] - 1 and swa.num_used == used_before[1] - 4
    step(bm, b, 20)
    bm.free_request(b)
    assert full.num_free == 40 and swa.num_free == 40
    assert all(c == 0 for c in full.ref_cnt + swa.ref_cnt)


def test_same_block_after_different_prefixes_is_not_a_hit():
    bm = BlockManager({"full": 20, "swa": 20}, BS, enable_prefix_caching=True, sliding_window=W)
    block = list(range(16))
    a = request([1] * 16 + block + [5], "a")
    step(bm, a, a.num_tokens)
    b = request([2] * 16 + block + [5], "b")  # the same second block after another first block
    assert bm.match_prefix(b) == 0
    assert b.block_tables == {"full": [], "swa": []}


@pytest.mark.parametrize("prefix_blocks", [1, 2, 3])  # 16, 32, 48 tokens: shorter than, equal to, longer than W
def test_prefix_hit_lengths_and_window_blocks(prefix_blocks):
    bm = BlockManager({"full": 40, "swa": 40}, BS, enable_prefix_caching=True, sliding_window=W)
    a = request(range(200, 260), "a")
    step(bm, a, a.num_tokens)
    b = request(list(range(200, 200 + prefix_blocks * BS)) + [9] * 5, "b")
    hit = bm.match_prefix(b)
    assert hit == prefix_blocks * BS
    first = max(0, hit - W + 1) // BS  # the window before the hit point starts in this block
    assert b.block_tables["swa"] == [-1] * first + a.block_tables["swa"][first:prefix_blocks]
    assert bm.prefix_hit_blocks == {"full": prefix_blocks, "swa": prefix_blocks - first}


def test_hit_shortened_when_window_blocks_were_evicted():
    bm = BlockManager({"full": 40, "swa": 8}, BS, enable_prefix_caching=True, sliding_window=W)
    a = request(range(300, 380), "a")  # 5 blocks; the SWA window of its end is blocks 2..4
    step(bm, a, a.num_tokens)
    swa_a = list(a.block_tables["swa"])
    bm.free_request(a)
    # another request takes (and so evicts) a's SWA block 3: hit points 4 and 5 lose their window
    swa = bm.pools["swa"]
    swa.free.move_to_end(swa_a[3], last=False)
    assert swa.take() == swa_a[3]
    b = request(list(range(300, 380)) + [1], "b")
    assert bm.match_prefix(b) == 3 * BS  # the window of position 48 (blocks 1, 2) is still cached
    assert b.block_tables["swa"] == [-1, swa_a[1], swa_a[2]]
    assert len(b.block_tables["full"]) == 3


def test_released_blocks_keep_their_hash_until_reused():
    bm = BlockManager({"full": 40, "swa": 40}, BS, enable_prefix_caching=True, sliding_window=W)
    a = request(range(400, 500), "a")
    step(bm, a, 48)
    a0 = a.block_tables["swa"][0]
    step(bm, a, 52)  # before it, queries from 48 on see 48 - 31 = 17 on: SWA block 0 is released
    assert a.block_tables["swa"][0] == -1 and bm.pools["swa"].ref_cnt[a0] == 0 and a0 in bm.pools["swa"].free
    b = request(list(range(400, 432)) + [3], "b")  # a hit at 32 needs positions 1..31: SWA blocks 0, 1
    assert bm.match_prefix(b) == 32
    assert b.block_tables["swa"][0] == a0 and a0 not in bm.pools["swa"].free
    assert [bm.pools["swa"].ref_cnt[x] for x in b.block_tables["swa"]] == [1, 2]


def test_all_swa_model_has_no_full_pool():
    bm = BlockManager({"swa": 6}, BS, enable_prefix_caching=True, sliding_window=W)
    req = request(range(10 * W))
    for _ in range(10 * W // 16):
        step(bm, req, 16)
    assert len(held(req, "swa")) <= bound(16) and "full" not in req.block_tables
    with pytest.raises(ValueError, match="^an SWA block pool needs the sliding_window$"):
        BlockManager({"swa": 6}, BS)


def finished(bm: BlockManager, tokens, rid: str) -> Request:
    """A request that computed all of ``tokens`` (registered for prefix reuse), then freed."""
    req = request(tokens, rid)
    bm.match_prefix(req)
    step(bm, req, req.num_tokens - req.num_computed_tokens)
    bm.free_request(req)
    return req


def test_a_fully_cached_block_multiple_prompt_leaves_its_last_token_to_compute():
    """A prompt of exactly 3 blocks, all cached: hits are whole blocks and the last token must be
    computed (it produces the logits), so 2 blocks hit and the third is computed again."""
    bm = BlockManager({"full": 20, "swa": 20}, BS, enable_prefix_caching=True, sliding_window=W)
    tokens = list(range(100, 100 + 3 * BS))
    finished(bm, tokens, "a")
    again = request(tokens, "b")
    hit = bm.match_prefix(again)
    assert hit == 2 * BS and again.num_tokens - hit == BS
    longer = request(tokens + [7], "c")  # one token past the blocks: all 3 blocks hit
    assert bm.match_prefix(longer) == 3 * BS


def test_freed_blocks_are_evicted_full_tail_first_and_swa_head_first():
    """free_request puts a request's full blocks on the free list tail first and its SWA blocks
    head first, so the next takes evict the full tail and the SWA head before anything else."""
    bm = BlockManager({"full": 4, "swa": 4}, BS, enable_prefix_caching=True, sliding_window=10 * BS)
    req = request(range(1, 1 + 4 * BS), "a")  # 4 full blocks, registered; W keeps every SWA block
    step(bm, req, req.num_tokens)
    full, swa = list(req.block_tables["full"]), list(req.block_tables["swa"])
    assert all(b >= 0 for b in full + swa) and len(full) == len(swa) == 4
    bm.free_request(req)
    assert [bm.pools["full"].take() for _ in range(4)] == full[::-1]  # tail first
    assert [bm.pools["swa"].take() for _ in range(4)] == swa  # head first


def test_a_partial_last_block_is_never_registered():
    """Only whole computed blocks get a hash: 2.5 blocks computed register 2 in each group."""
    bm = BlockManager({"full": 10, "swa": 10}, BS, enable_prefix_caching=True, sliding_window=W)
    req = request(range(1, 1 + 2 * BS + BS // 2))
    step(bm, req, req.num_tokens)
    for g, pool in bm.pools.items():
        hashed = [b for b in req.block_tables[g] if b >= 0 and pool.block_hash[b] is not None]
        assert len(hashed) == 2 and req.block_tables[g][2] not in hashed, g
    other = request(list(range(1, 1 + 2 * BS + BS // 2)) + [9], "b")
    assert bm.match_prefix(other) == 2 * BS  # never the half-written third block


def test_prefix_lookups_are_counted_only_when_caching_is_on():
    """prefix_queries (the metrics' prefix_cache_queries) adds each looked-up prompt's tokens;
    with caching off nothing is looked up, and a request that already holds blocks (or asks
    for prompt logprobs) is not looked up again."""
    off = BlockManager({"full": 20, "swa": 20}, BS, sliding_window=W)
    finished(off, range(50, 90), "a")
    assert off.match_prefix(request(range(50, 90), "b")) == 0 and off.prefix_queries == 0
    on = BlockManager({"full": 20, "swa": 20}, BS, enable_prefix_caching=True, sliding_window=W)
    finished(on, range(50, 90), "a")  # 40 tokens looked up (no hit)
    b = request(list(range(50, 90)) + [3], "b")
    assert on.match_prefix(b) == 32 and on.prefix_queries == 40 + 41
    tables, refs = {g: list(t) for g, t in b.block_tables.items()}, list(on.pools["full"].ref_cnt)
    assert on.match_prefix(b) == 0  # it holds blocks: no second lookup, no second reference
    assert b.block_tables == tables and on.pools["full"].ref_cnt == refs and on.prefix_queries == 81
    c = Request("c", list(range(50, 90)), SamplingParams(prompt_logprobs=0))
    assert on.match_prefix(c) == 0 and c.block_tables == {"full": [], "swa": []} and on.prefix_queries == 81


def test_a_hit_needs_the_full_blocks_even_where_the_swa_blocks_are_cached():
    """Full blocks evicted while the SWA blocks of the same prefix stay cached: the hit stops at
    the first evicted full block."""
    bm = BlockManager({"full": 5, "swa": 20}, BS, enable_prefix_caching=True, sliding_window=W)
    finished(bm, range(600, 664), "a")  # 4 full blocks, all registered and freed
    other = request(range(700, 740), "o")
    step(bm, other, other.num_tokens)  # 3 full blocks taken: the free one, then a's tail (3, 2)
    b = request(list(range(600, 664)) + [1], "b")
    assert bm.match_prefix(b) == 2 * BS
    assert len(b.block_tables["full"]) == 2
    bm.free_request(b)
    bm.free_request(other)
    assert bm.pools["full"].num_free == 5 and bm.pools["swa"].num_free == 20


def test_two_copies_of_a_block_keep_the_first_registered_until_it_is_evicted():
    """Two requests compute the same prompt at once (neither hits): the first to register its
    blocks serves later hits, and handing out the other copy's blocks loses no hit."""
    bm = BlockManager({"full": 4, "swa": 4}, BS, enable_prefix_caching=True, sliding_window=W)
    tokens = list(range(800, 800 + 2 * BS))
    a, b = request(tokens, "a"), request(tokens, "b")
    step(bm, a, a.num_tokens)
    step(bm, b, b.num_tokens)  # the same two blocks' content in other blocks
    full_a, full_b = list(a.block_tables["full"]), list(b.block_tables["full"])
    bm.free_request(b)  # b's copies first: they are handed out first
    bm.free_request(a)
    filler = request(range(1, 1 + 2 * BS), "f")
    step(bm, filler, filler.num_tokens)
    assert sorted(filler.block_tables["full"]) == sorted(full_b)
    c = request(tokens + [5], "c")
    assert bm.match_prefix(c) == 2 * BS and c.block_tables["full"] == full_a


def test_a_full_attention_model_releases_nothing():
    """No SWA pool (or release switched off): allocate grows the tables, release returns 0."""
    bm = BlockManager({"full": 10}, BS)
    req = request(range(5 * BS))
    for _ in range(5):
        step(bm, req, BS)
        assert bm.release(req) == 0
    assert req.block_tables == {"full": req.block_tables["full"]} and len(held(req, "full")) == 5
    kept = BlockManager({"full": 20, "swa": 20}, BS, sliding_window=W)
    kept.release_swa = False
    r = request(range(8 * BS))
    for _ in range(8):
        step(kept, r, BS)
        assert kept.release(r) == 0
    assert len(held(r, "swa")) == 8 and kept.swa_blocks_released == 0


def test_first_visible_block_at_block_size_one():
    bm = BlockManager({"swa": 8}, 1, sliding_window=4)
    assert [bm.first_visible_block(p) for p in range(8)] == [0, 0, 0, 0, 1, 2, 3, 4]  # p - W + 1, floor 0


def test_hit_counters_add_up_over_requests():
    """prefix_hits (tokens) and prefix_hit_blocks (per group) sum over every hit."""
    bm = BlockManager({"full": 40, "swa": 40}, BS, enable_prefix_caching=True, sliding_window=W)
    finished(bm, range(900, 980), "a")  # 5 blocks
    assert bm.prefix_hits == 0 and bm.prefix_hit_blocks == {"full": 0, "swa": 0}
    finished(bm, list(range(900, 948)) + [1], "b")  # 3 blocks hit; the window of 48 is blocks 1, 2
    assert bm.prefix_hits == 48 and bm.prefix_hit_blocks == {"full": 3, "swa": 2}
    finished(bm, list(range(900, 932)) + [2], "c")  # 2 blocks hit; the window of 32 is blocks 0, 1
    assert bm.prefix_hits == 80 and bm.prefix_hit_blocks == {"full": 5, "swa": 4}


def _evict(pool, b: int) -> None:
    """Hand out block b (the next take evicts it), as another request's allocation would."""
    pool.free.move_to_end(b, last=False)
    assert pool.take() == b


def test_a_hit_needs_only_the_window_before_it():
    """Evicted SWA blocks before the window of the hit point do not shorten the hit; one evicted
    block inside it shortens the hit by exactly as much as it must."""
    bm = BlockManager({"full": 40, "swa": 40}, BS, enable_prefix_caching=True, sliding_window=W)
    tokens = list(range(1000, 1080))  # 5 blocks
    a = request(tokens, "a")
    step(bm, a, a.num_tokens)
    swa_a = list(a.block_tables["swa"])
    bm.free_request(a)
    _evict(bm.pools["swa"], swa_a[0])  # before the window of 64 and of 80
    _evict(bm.pools["swa"], swa_a[1])
    b = request(tokens + [1], "b")
    assert bm.match_prefix(b) == 5 * BS  # the window of 80 is blocks 3, 4
    assert b.block_tables["swa"] == [-1, -1, -1, swa_a[3], swa_a[4]]
    bm.free_request(b)
    _evict(bm.pools["swa"], swa_a[4])  # the hit at 80 loses its window; the one at 64 keeps blocks 2, 3
    c = request(tokens + [1], "c")
    assert bm.match_prefix(c) == 4 * BS


def test_no_hit_when_the_first_swa_block_is_gone():
    """A prompt whose full blocks are cached but whose SWA block 0 was handed out: the hit at one
    block needs SWA block 0 (positions 0..15), so there is no hit at all."""
    bm = BlockManager({"full": 40, "swa": 40}, BS, enable_prefix_caching=True, sliding_window=W)
    tokens = list(range(1100, 1132))  # 2 blocks
    a = request(tokens, "a")
    step(bm, a, a.num_tokens)
    swa0 = a.block_tables["swa"][0]
    bm.free_request(a)
    _evict(bm.pools["swa"], swa0)
    b = request(tokens[:16] + [5, 6], "b")  # one block to hit
    assert bm.match_prefix(b) == 0 and b.block_tables == {"full": [], "swa": []}


def test_a_handed_out_block_is_cached_again_under_its_new_content():
    """A block evicted from the cache and reused registers its new content for later hits."""
    bm = BlockManager({"full": 2, "swa": 2}, BS, enable_prefix_caching=True, sliding_window=W)
    finished(bm, range(1200, 1232), "a")
    finished(bm, range(1300, 1332), "b")  # takes (evicts) a's two blocks, registers its own content
    c = request(list(range(1300, 1332)) + [1], "c")
    assert bm.match_prefix(c) == 2 * BS
    assert bm.match_prefix(request(list(range(1200, 1232)) + [1], "d")) == 0
