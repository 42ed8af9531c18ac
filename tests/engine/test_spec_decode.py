"""MTP speculative decoding (docs/design.md §4.16): greedy output identical with speculation on
and off for k = 1, 2, 3 over window crossings (sequences >= 2W + a block), chunked prefill,
prefix hits, preemption and n > 1; stop strings that end inside accepted drafts; seeded sampling
unchanged; rejection sampling keeps the target's distribution; and after every step the SWA
blocks and prefix hashes follow the accepted tokens only, all blocks free at the end."""

import itertools
import time

import numpy as np
import paddle
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor.layers.device_sampler import DeviceSampler
from fastdeploy.model_executor.layers.sampler import adjusted_logits, kept_mask
from fastdeploy.request import Request
from fastdeploy.worker.speculation import verify_drafts

W, BS = 32, 16


def spec(k: int) -> dict:
    return {"speculative_config": f'{{"method": "mtp", "num_speculative_tokens": {k}}}'} if k else {}


def engine(model_dir, k, **kw):
    common = dict(block_size=BS, max_num_seqs=6, enable_prefix_caching=True, max_model_len=224)
    return LLM(model_dir, **{**common, **kw}, **spec(k)).engine


class Watch:
    """Checks, before each step (once blocks are allocated) and after it, that a request's SWA
    table is released exactly below its first visible block of the accepted length, that its
    tables reach no further than its step plus the draft lookahead, and that every block
    registered for prefix reuse holds accepted tokens only (its hash is the chain of them)."""

    def __init__(self, eng, lookahead: int) -> None:
        self.eng, self.bm, self.la = eng, eng.block_manager, lookahead
        self.violations: list[str] = []
        self.results: dict[str, list[int]] = {}  # request -> tokens the runner returned, per step
        prepare, finish = eng.runner.prepare, eng.runner.finish

        def checked_prepare(scheduled):
            for req, n in scheduled:
                self.check_tables(req, n)
            return prepare(scheduled)

        def recorded_finish(running):
            res, prompt = finish(running)
            for (req, _), r in zip(running.prep.scheduled, res, strict=True):
                if isinstance(r, list):
                    self.results.setdefault(req.request_id, []).append(len(r))
            return res, prompt

        eng.runner.prepare, eng.runner.finish = checked_prepare, recorded_finish

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.violations.append(what)

    def check_tables(self, req, n: int) -> None:
        c = req.num_computed_tokens
        lo = max(0, c - W + 1) // BS
        swa = req.block_tables.get("swa", [])
        self.check(all(b == -1 for b in swa[:lo]), f"{req.request_id}: a block out of sight kept at {c}")
        self.check(all(b >= 0 for b in swa[lo:]), f"{req.request_id}: a block in sight released at {c}")
        for g, t in req.block_tables.items():
            self.check(len(t) <= -(-(c + n + self.la) // BS), f"{req.request_id}: {g} table past the lookahead")

    def after_step(self) -> None:
        for req in self.eng.scheduler.running:
            c, toks = req.num_computed_tokens, req.all_token_ids
            self.check(c <= req.num_tokens - 1, f"{req.request_id}: {c} computed of {req.num_tokens}")
            h = 0
            for j in range(len(req.block_tables.get("full", []))):
                b = req.block_tables["full"][j]
                h = hash((h, tuple(toks[j * BS : (j + 1) * BS])))
                cached = self.bm.pools["full"].block_hash[b]
                if (j + 1) * BS <= c:
                    self.check(cached in (None, h), f"{req.request_id}: block {j} hash is not its tokens'")
                else:
                    self.check(cached is None, f"{req.request_id}: block {j} past {c} computed is registered")

    def assert_all_free(self) -> None:
        assert not self.violations, self.violations[:5]
        for p in self.bm.pools.values():
            assert p.num_free == p.num_blocks and not any(p.ref_cnt)


def drive(eng, plan: dict, watch: Watch | None = None, max_steps: int = 400) -> dict:
    """Add plan[step]'s requests (id, prompt ids, sampling kw, sibling of) at that step; run to the end."""
    outs, prompts = {}, {}
    for step in range(max_steps):
        for rid, prompt, kw, after in plan.get(step, []):
            prompts[rid] = prompts[after] if after else prompt
            req = eng.make_request(prompts[rid], SamplingParams(**kw), rid)
            if after:
                req.prefill_after = eng.requests[after]
            eng.enqueue(req)
        if step > max(plan) and not eng.has_unfinished_requests():
            break
        for o in eng.step():
            outs[o.request_id] = o
        if watch:
            watch.after_step()
    assert not eng.has_unfinished_requests()
    return outs


def workload(rng) -> dict:
    shared = [int(x) for x in rng.integers(4, 256, 40)]
    g = {"temperature": 0.0, "ignore_eos": True, "logprobs": 2}
    r = lambda n: [int(x) for x in rng.integers(4, 256, n)]  # noqa: E731
    return {
        0: [("long", r(85), {**g, "max_tokens": 70}, None), ("a", shared + r(5), {**g, "max_tokens": 50}, None)],
        2: [("b", r(9), {**g, "max_tokens": 40}, None)],
        4: [("hit", shared + r(3), {**g, "max_tokens": 60}, None), ("c", r(33), {**g, "max_tokens": 45}, None)],
        5: [("c2", None, {**g, "max_tokens": 45}, "c")],
        9: [("late", shared + r(30), {**g, "max_tokens": 30}, None)],
    }


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_output_identical_with_speculation(mtp_model_dir, k, rng):
    """A pool of 18 full blocks forces preemptions; a 40-token budget chunks the prompts (chunks
    below, at and above W as decodes share it); "hit" and "late" reuse "a"'s prefix; c2 is c's sibling."""
    plan = workload(rng)
    kw = dict(num_gpu_blocks_override=18, max_num_batched_tokens=40)
    plain = drive(engine(mtp_model_dir, 0, **kw), plan)
    eng = engine(mtp_model_dir, k, **kw)
    watch = Watch(eng, k - 1)
    got = drive(eng, plan, watch)
    for rid, o in plain.items():
        a, b = got[rid].outputs[0], o.outputs[0]
        assert a.token_ids == b.token_ids, rid
        assert len(a.token_ids) == len(b.token_ids) == plan_tokens(plan, rid)
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys()
            np.testing.assert_allclose(list(la.values()), list(lb.values()), rtol=0, atol=2e-3)
    watch.assert_all_free()
    assert eng.num_preemptions > 0 and eng.block_manager.prefix_hits > 0
    s = eng.spec
    assert s.num_draft_tokens >= s.num_drafts > 0 and 0 < s.num_accepted_tokens <= s.num_draft_tokens
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens and len(s.accepted_per_pos) == k
    assert all(x >= y for x, y in zip(s.accepted_per_pos, s.accepted_per_pos[1:], strict=False))
    assert eng.num_generated_tokens == sum(len(o.outputs[0].token_ids) for o in got.values())
    assert max(n for v in watch.results.values() for n in v) > 1  # some steps accepted drafts


def plan_tokens(plan, rid):
    return next(kw["max_tokens"] for v in plan.values() for r, _, kw, _ in v if r == rid)


def test_stop_strings_ending_inside_accepted_drafts(mtp_model_dir, rng):
    """Stops cut at many points of a greedy continuation: text, tokens, finish reason equal with
    and without speculation, and some stops end a step before its last accepted token."""
    prompt = [int(x) for x in rng.integers(4, 256, 24)]
    plain, eng = engine(mtp_model_dir, 0), engine(mtp_model_dir, 3)
    base = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
    full = drive(plain, {0: [("x", prompt, base, None)]})["x"].outputs[0]
    watch = Watch(eng, 2)
    inside = 0
    for j in range(6, 40, 3):
        text = plain.tokenizer.decode(full.token_ids[: j + 1])
        stop = text[-3:]
        if not stop.strip():
            continue
        kw = {**base, "stop": [stop]}
        want = drive(plain, {0: [(f"p{j}", prompt, kw, None)]})[f"p{j}"].outputs[0]
        got = drive(eng, {0: [(f"s{j}", prompt, kw, None)]}, watch)[f"s{j}"].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
        inside += want.finish_reason == "stop" and sum(watch.results[f"s{j}"]) > len(got.token_ids)
    watch.assert_all_free()
    assert inside > 0


@pytest.mark.parametrize("penalties", [True, False])
def test_seeded_sampling_unchanged_by_speculation(mtp_model_dir, rng, penalties):
    """Each verified row samples as the request's next token would: same seed step, penalties and
    min_tokens, so seeded output is the same token for token. Without penalties every row of a
    verify step is drawn at once (one copy back a step); with them, depth by depth."""
    kw = {"temperature": 0.7, "top_p": 0.9, "min_tokens": 10, "max_tokens": 40, "logprobs": 1}
    if penalties:
        kw.update(presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.1)
    plan = {
        0: [(f"r{i}", [int(x) for x in rng.integers(4, 256, 20 + i)], {**kw, "seed": 11 + i}, None) for i in range(4)]
    }
    plain = drive(engine(mtp_model_dir, 0), plan)
    eng = engine(mtp_model_dir, 2)
    copies, finish, collect = [], eng.runner.finish, eng.runner.sampler.collect
    eng.runner.sampler.collect = lambda drawn: copies.append(1) or collect(drawn)
    eng.runner.finish = lambda running: copies.append(0) or finish(running)
    got = drive(eng, plan)
    for rid, o in plain.items():
        assert got[rid].outputs[0].token_ids == o.outputs[0].token_ids, rid
        for a, b in zip(got[rid].outputs[0].logprobs, o.outputs[0].logprobs, strict=True):
            np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=0, atol=3e-3)
    assert eng.spec.num_accepted_tokens > 0
    per_step = [len(list(g)) for k, g in itertools.groupby(copies, key=bool) if k]  # copies a step
    if penalties:
        assert max(per_step) > 1  # a verify step drew depth by depth
    else:
        assert max(per_step) == 1  # one draw and copy back a step


def test_a_verify_row_that_cannot_sample_fails_only_what_it_must(rng):
    """Greedy verify of three requests with two drafts each, some rows non-finite: a request whose
    first row fails gets the error; one whose second row fails keeps the draft accepted before it
    (the tokens of rows that sampled stand); the third is untouched."""
    V = 9
    logits = rng.standard_normal((9, V)).astype(np.float32)
    drafts = [[int(np.argmax(logits[3 * b + j])) for j in range(2)] for b in range(3)]
    logits[0, 4] = np.nan  # request 0's first row
    logits[3 + 1, 2] = np.inf  # request 1's second row, after its first draft is accepted
    reqs = []
    for b in range(3):
        r = Request(f"r{b}", [1, 2], SamplingParams(temperature=0.0, max_tokens=8))
        r.draft_token_ids = list(drafts[b])
        reqs.append(r)
    res = verify_drafts(DeviceSampler(V, 3, triton=False), paddle.to_tensor(logits), reqs, [0, 3, 6], drafts)
    assert isinstance(res[0], ValueError) and "not finite" in str(res[0])
    assert [s.token_id for s in res[1]] == drafts[1][:1]
    assert [s.token_id for s in res[2]] == [*drafts[2], int(np.argmax(logits[8]))]


def test_rejection_sampling_keeps_the_target_distribution(rng):
    """verify_drafts over many seeded rows of one small-vocabulary distribution per depth, with
    temperature, top-p and penalties: the first token, the second given the first draft accepted
    and the third given both, each follow the target's processed distribution (chi-square)."""
    V, N = 7, 6000
    logits = rng.standard_normal((3, V)) * 1.5
    prompt = [1, 2]
    drafts = [int(np.argsort(-logits[0])[1]), int(np.argmax(logits[1])), int(np.argmax(logits[2]))]
    reqs = []
    for i in range(N):
        sp = SamplingParams(
            temperature=0.9, top_p=0.92, presence_penalty=0.7, repetition_penalty=1.3, seed=i, max_tokens=8
        )
        r = Request(f"r{i}", prompt, sp)
        r.draft_token_ids = list(drafts)
        reqs.append(r)
    flat = paddle.to_tensor(np.tile(logits, (N, 1)).astype(np.float32))
    res = verify_drafts(DeviceSampler(V, N, triton=False), flat, reqs, [3 * i for i in range(N)], [drafts] * N)

    def target(row: int, out: list[int]) -> np.ndarray:
        st = reqs[0].sampling_state
        z = adjusted_logits(logits[row].astype(np.float64), st, prompt, out)
        y, keep = kept_mask(z, st)
        p = np.where(keep, np.exp(y - y[keep].max()), 0.0)
        return p / p.sum()

    def chi2_ok(tokens: list[int], p: np.ndarray) -> None:
        seen = np.bincount(tokens, minlength=V).astype(np.float64)
        n = len(tokens)
        assert n > 300 and seen[p == 0].sum() == 0
        keep = p * n >= 5
        chi2 = (((seen - n * p) ** 2)[keep] / (n * p[keep])).sum()
        assert chi2 < 22.5, (chi2, seen, n * p)  # chi2(df <= 6) exceeds 22.5 with probability 0.001

    toks = [[s.token_id for s in r] for r in res]
    chi2_ok([t[0] for t in toks], target(0, []))
    chi2_ok([t[1] for t in toks if t[0] == drafts[0]], target(1, drafts[:1]))
    chi2_ok([t[2] for t in toks if t[:2] == drafts[:2]], target(2, drafts[:2]))
    for t in toks:  # accepted while equal, then one more
        a = next((j for j in range(3) if t[j] != drafts[j]), 3) if len(t) == 4 else len(t) - 1
        assert len(t) == a + 1 and t[:a] == drafts[:a]


def test_metrics_and_the_interval_log_line(mtp_model_dir, rng, caplog):
    from fastdeploy.engine.metrics import LOG_INTERVAL_S, EngineMetrics

    eng = engine(mtp_model_dir, 2)
    drive(eng, {0: [("m", [int(x) for x in rng.integers(4, 256, 20)], {"temperature": 0.0, "max_tokens": 30}, None)]})
    s = eng.spec
    text = EngineMetrics(eng).render().decode()
    for name, v in (
        ("num_drafts", s.num_drafts),
        ("num_draft_tokens", s.num_draft_tokens),
        ("num_accepted_tokens", s.num_accepted_tokens),
    ):
        assert f"fastdeploy:spec_decode_{name}_total {float(v)}" in text
    assert (
        f'fastdeploy:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} {float(s.accepted_per_pos[1])}'
        in text
    )
    with caplog.at_level("INFO", logger="fastdeploy"):
        s.maybe_log(time.monotonic() + LOG_INTERVAL_S + 1)
    want = f"mean accepted length {1 + s.num_accepted_tokens / s.num_drafts:.2f}, {s.num_drafts} verify steps"
    assert want in caplog.text
    assert "spec_decode" not in EngineMetrics(engine(mtp_model_dir, 0)).render().decode()


def test_deeper_drafts_continue_the_first(mtp_model_dir, rng):
    """k = 3 on the fitted MTP layer, greedy: a second draft (fed the first draft at the next
    position, over the draft pass's own hidden state) is accepted for most accepted first drafts,
    and a third for many accepted second ones, far above chance (1 / 500 a guess). A chain pass
    at a wrong position or fed a wrong token drafts noise past the first."""
    eng = engine(mtp_model_dir, 3)
    prompts = {f"p{i}": [int(x) for x in rng.integers(4, 256, 16)] for i in range(4)}
    drive(
        eng,
        {0: [(rid, p, {"temperature": 0.0, "ignore_eos": True, "max_tokens": 48}, None) for rid, p in prompts.items()]},
    )
    a = eng.spec.accepted_per_pos  # measured 52 / 31 / 23 of 81 verify steps
    assert a[0] >= 0.5 * eng.spec.num_drafts
    assert a[1] >= 0.4 * a[0] and a[2] >= 0.2 * a[1]


def test_structured_outputs_and_speculation_compose(mtp_model_dir, rng):
    """Requests under a JSON Schema draft too: each verify row is masked by the grammar's state
    after the drafts before it, so a draft the grammar refuses is rejected and the matcher rolls
    back. Greedy tokens are those without speculation for k = 1 and 3, every answer that stops
    validates, drafts were proposed and some accepted, and every block is free at the end."""
    import json

    import jsonschema

    from fastdeploy.sampling_params import StructuredOutput

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n"]}
    so = StructuredOutput("json", json.dumps(schema), "response_format.json_schema")
    prompts = [[int(x) for x in rng.integers(4, 256, n)] for n in (9, 40, 70)]
    outs = {}
    for k in (0, 1, 3):
        eng = engine(mtp_model_dir, k)
        for i, p in enumerate(prompts):
            free = SamplingParams(max_tokens=24, temperature=0.0)  # a free request in the same batch
            eng.add_request(p, SamplingParams(max_tokens=48, temperature=0.0, structured=so), f"s{i}")
            eng.add_request(p, free, f"f{i}")
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0]
        outs[k] = {r: c.token_ids for r, c in done.items()}
        for r, c in done.items():
            if r.startswith("s") and c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), schema)
        assert all(p.num_used == 0 for p in eng.block_manager.pools.values())
    assert outs[1] == outs[0] and outs[3] == outs[0]
    alone = engine(mtp_model_dir, 3)  # constrained requests alone: they drafted, and drafts were kept
    for i, p in enumerate(prompts):
        alone.add_request(p, SamplingParams(max_tokens=48, temperature=0.0, structured=so), f"s{i}")
    while alone.has_unfinished_requests():
        alone.step()
    assert alone.spec.num_draft_tokens > 0 and alone.spec.num_accepted_tokens > 0


def test_drafts_unchanged_by_chunking_the_prompt(mtp_model_dir, rng):
    """Every step runs the MTP layer, prefill chunks that sample nothing included, so its cache
    holds every prompt position: a 100-token prompt in one chunk or in chunks of 16, 24 and 40
    tokens (below, at and above a block, below and above W) gives the same drafts, proposed and
    accepted at each position (a chunk without its MTP pass leaves stale cache under later
    drafts)."""
    prompt = [int(x) for x in rng.integers(4, 256, 100)]
    sp = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 40}
    stats = []
    for budget in (256, 16, 24, 40):
        eng = engine(mtp_model_dir, 2, enable_prefix_caching=False, max_num_batched_tokens=budget)
        out = drive(eng, {0: [("r", prompt, sp, None)]})
        s = eng.spec
        stats.append((out["r"].outputs[0].token_ids, s.num_drafts, s.num_draft_tokens, list(s.accepted_per_pos)))
    assert stats[0][1] > 0 and stats[0][3][0] > 0
    assert all(x == stats[0] for x in stats[1:]), stats
