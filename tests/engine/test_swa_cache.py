"""The engine with KV cache groups: releasing out-of-window SWA blocks changes no output (tokens
and logprobs bit for bit), a request's SWA blocks stay within the window bound at every step,
both pools empty after every request, preemption when either pool is short, prefix hits across
groups. W = 32 (hybrid tiny preset: layers 0, 2 SWA) or 8 (all-SWA), block 16."""

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.request import Request
from fastdeploy.tools.make_tiny_model import make_tiny_model

BS = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def bound(W: int, chunk: int) -> int:
    return -(-(W - 1 + chunk) // BS) + 1


@pytest.fixture(scope="module")
def all_swa_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("allswa8")), seed=5, sliding_window=8, swa_layers=[0, 1, 2, 3])


def prompts(rng, lens):
    return [{"prompt_token_ids": [int(x) for x in rng.integers(2, 500, n)]} for n in lens]


class StepWatch:
    """Wraps the runner: before each step, checks the step's token budget and every scheduled
    request's SWA blocks against the window bound; records the peaks and every violation (an
    assertion raised inside ``prepare`` would only make the engine retry the requests one by one,
    so violations are recorded and ``assert_all_free`` fails on them)."""

    def __init__(self, llm: LLM, W: int) -> None:
        eng = llm.engine
        self.bm, self.W, self.budget = eng.block_manager, W, eng.config.scheduler_config.max_num_batched_tokens
        self.peak_swa, self.peak_full, self.steps = 0, 0, 0
        self.violations: list[str] = []
        inner = eng.runner.prepare

        def check(ok: bool, what: str) -> None:
            if not ok:
                self.violations.append(f"step {self.steps}: {what}")

        def prepare(scheduled):
            check(sum(n for _, n in scheduled) <= self.budget, "token budget")
            for req, n in scheduled:
                swa = [b for b in req.block_tables.get("swa", []) if b >= 0]
                if self.bm.release_swa:  # released entries are -1, exactly those out of every query's sight
                    # overlapped, the window of a running step's first token stays until it is taken
                    span = n + req.inflight_tokens
                    check(len(swa) <= bound(self.W, span), f"{len(swa)} SWA blocks for a chunk of {n}")
                    lo = max(0, req.num_computed_tokens - req.inflight_tokens - self.W + 1) // BS
                    check(all(b == -1 for b in req.block_tables["swa"][:lo]), "a block out of sight kept")
                    check(all(b >= 0 for b in req.block_tables["swa"][lo:]), "a block in sight released")
                self.peak_swa = max(self.peak_swa, len(swa))
                self.peak_full = max(self.peak_full, len(req.block_tables.get("full", [])))
            self.steps += 1
            return inner(scheduled)

        eng.runner.prepare = prepare

    def assert_all_free(self) -> None:
        assert not self.violations, self.violations
        assert all(p.num_free == p.num_blocks for p in self.bm.pools.values())
        assert all(c == 0 for p in self.bm.pools.values() for c in p.ref_cnt)


def run(llm, ps, sp, release: bool, W: int):
    llm.engine.block_manager.release_swa = release
    watch = StepWatch(llm, W)
    out = llm.generate(ps, sp)
    watch.assert_all_free()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out], watch


@pytest.mark.parametrize("chunk", [7, 32, 45])  # below, equal to and above W = 32
def test_release_changes_no_output_hybrid(chunk, rng):
    """Prompts of 3W + 5 and shorter ones together (mixed prefill / decode steps), generating past
    2W; tokens and top-3 logprobs are equal bit for bit with release on and off."""
    ps = prompts(rng, [3 * 32 + 5, 40, 9])
    sp = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True, logprobs=3)
    kw = dict(block_size=BS, num_gpu_blocks_override=64, swa_full_tokens_ratio=1.0, max_model_len=256)
    llm = LLM(model="tiny-mla-swa", max_num_batched_tokens=chunk, **kw)
    off, _ = run(llm, ps, sp, release=False, W=32)
    on, watch = run(llm, ps, sp, release=True, W=32)
    assert on == off
    assert llm.engine.block_manager.swa_blocks_released > 0
    span = llm.engine.config.scheduler_config.swa_chunk_tokens  # overlapped: two chunks (design §4.18)
    assert watch.peak_swa <= bound(32, span) < watch.peak_full


def test_release_changes_no_output_all_swa(all_swa_dir, rng):
    ps = prompts(rng, [3 * 8 + 5, 20, 100])
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=3)
    llm = LLM(model=all_swa_dir, block_size=BS, num_gpu_blocks_override=64, max_model_len=256, max_num_batched_tokens=9)
    assert list(llm.engine.block_manager.pools) == ["swa"]
    off, _ = run(llm, ps, sp, release=False, W=8)
    on, watch = run(llm, ps, sp, release=True, W=8)
    assert on == off and watch.peak_swa <= bound(8, llm.engine.config.scheduler_config.swa_chunk_tokens)


def test_20w_generation_stays_within_the_bound(rng):
    """A request decoding to 20W holds at most bound SWA blocks at any step while its full-layer
    blocks grow with its length; every block of both pools is free when it ends."""
    W, chunk = 32, 48
    llm = LLM(
        model="tiny-mla-swa",
        block_size=BS,
        num_gpu_blocks_override=48,
        max_model_len=20 * W + 8,
        max_num_batched_tokens=chunk,
        max_num_seqs=2,
    )
    pools = llm.engine.block_manager.pools
    assert pools["swa"].num_blocks == 2 * bound(W, chunk) == 2 * 6  # max_num_seqs requests' windows
    watch = StepWatch(llm, W)
    (p,) = prompts(rng, [3 * W + 5])
    out = llm.generate([p], SamplingParams(max_tokens=20 * W - 3 * W - 5, temperature=0.0, ignore_eos=True))
    assert len(p["prompt_token_ids"]) + len(out[0].outputs[0].token_ids) == 20 * W
    assert watch.peak_swa <= bound(W, chunk) and watch.peak_full == 20 * W // BS
    watch.assert_all_free()


@pytest.mark.parametrize(
    "lens, full, ratio, chunk, pools",
    [
        # full pool roomy; SWA pool 5 blocks: all four are admitted with a block each, and a
        # decode past position 32 holds 3
        ([16, 16, 16, 16], 100, 0.05, 16, {"full": 100, "swa": 5}),
        # both short: 12 full blocks for 4 x 100 tokens, 6 SWA blocks (a request alone holds at
        # most 5: W + the two chunks of 16 of a running step and the one launched behind it)
        ([40, 35, 45, 40], 12, 0.5, 16, {"full": 12, "swa": 6}),
    ],
)
def test_preemption_when_pools_are_short(rng, lens, full, ratio, chunk, pools):
    ps = prompts(rng, lens)
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    big = LLM(model="tiny-mla-swa", block_size=BS, num_gpu_blocks_override=200, max_model_len=150)
    want = [o.outputs[0].token_ids for o in big.generate(ps, sp)]
    kw = dict(num_gpu_blocks_override=full, swa_full_tokens_ratio=ratio, max_num_batched_tokens=chunk)
    small = LLM(model="tiny-mla-swa", block_size=BS, max_model_len=150, **kw)
    assert {g: p.num_blocks for g, p in small.engine.block_manager.pools.items()} == pools
    watch = StepWatch(small, 32)
    assert [o.outputs[0].token_ids for o in small.generate(ps, sp)] == want
    assert sum(r.num_preemptions for r in small.engine.preempted_log) > 0
    watch.assert_all_free()


def test_pool_that_cannot_hold_one_request_is_a_clear_error():
    with pytest.raises(ValueError, match="swa-full-tokens-ratio"):
        LLM(
            model="tiny-mla-swa",
            block_size=BS,
            num_gpu_blocks_override=20,
            swa_full_tokens_ratio=0.1,
            max_model_len=256,
        )


def test_prefix_hits_across_groups_same_tokens(rng):
    """Hits shorter than, equal to and longer than W, with release on; a hit whose window blocks
    were evicted is shortened and still gives the same tokens."""
    shared = [int(x) for x in rng.integers(2, 500, 80)]
    ps = [{"prompt_token_ids": shared[:n] + [int(x) for x in rng.integers(2, 500, 9)]} for n in (16, 32, 48, 80)]
    kw = dict(block_size=BS, num_gpu_blocks_override=100, max_model_len=512)
    want = [o.outputs[0].token_ids for o in LLM(model="tiny-mla-swa", **kw).generate(ps, GREEDY)]
    on = LLM(model="tiny-mla-swa", enable_prefix_caching=True, **kw)
    on.generate([{"prompt_token_ids": shared + [1, 2, 3]}], GREEDY)  # warm: 5 full blocks cached
    got = on.generate(ps, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == want
    assert [o.num_cached_tokens for o in got] == [16, 32, 48, 80]
    # evict the SWA block of positions 48..63: hits at 80 (needs 49..79) and 64 (33..63) lose their window
    bm, swa = on.engine.block_manager, on.engine.block_manager.pools["swa"]
    b3 = swa.hash_to_block[bm.block_hashes(Request("h", shared + [0], GREEDY), 4)[3]]
    swa.free.move_to_end(b3, last=False)
    assert swa.take() == b3 and b3 not in swa.hash_to_block.values()
    swa.unref(b3)
    got = on.generate(ps[3:], GREEDY)
    assert got[0].outputs[0].token_ids == want[3] and got[0].num_cached_tokens == 48
    assert all(p.num_free == p.num_blocks for p in bm.pools.values())
