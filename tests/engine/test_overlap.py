"""The overlapped loop (``async_scheduling``, docs/design.md §4.18) changes no token: the same
requests through an engine that launches step N+1 before taking step N's outputs and through one
that runs each step in turn give the same tokens, logprobs, texts and finish reasons, and the same
count of generated tokens (a row computed after its request finished never sends a token). The
plan crosses windows (W 32, block 16, prompts past 2W + a block, chunks of 48 below and above W),
preempts (a short pool), hits cached prefixes shorter and longer than W, stops on a token, a
string, max_tokens and min_tokens, samples with seeds and penalties, runs n = 4 siblings and aborts
a request while its step runs. Every block is free at the end. Steps a request's structured
output or (uncaptured) speculation needs taken first run in turn; captured speculation chains
its verify steps from the device's acceptance; a step failing with another launched behind it
fails only its request."""

import re

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.sampling_params import StructuredOutput

BS = 16


def engine(model_dir, overlap, **kw):
    common = dict(
        block_size=BS, max_num_seqs=6, max_num_batched_tokens=48, enable_prefix_caching=True, max_model_len=192
    )
    return LLM(model_dir, async_scheduling=overlap, **{**common, **kw}).engine


class Launches:
    """Counts, through the runner's own calls, the steps launched while another was running and
    the placeholders their inputs held."""

    def __init__(self, eng) -> None:
        self.behind = self.placeholders = self.steps = 0
        runner = eng.runner
        launch = runner.launch

        def counted(prep, *a):
            self.steps += 1
            self.behind += runner.step_started is not None
            self.placeholders += len(prep.step.placeholders)
            return launch(prep, *a)

        runner.launch = counted


def drive(eng, plan: dict, aborts: dict | None = None, max_steps: int = 600):
    """Add plan[step]'s requests ((id, prompt, SamplingParams, sibling of)) at that step, abort
    aborts[step]'s ids that are still live; run to the end. Returns the final outputs and every
    streamed one."""
    final, streamed, prompts = {}, {}, {}
    for step in range(max_steps):
        for rid, prompt, sp, after in plan.get(step, []):
            prompts[rid] = prompts[after] if after else prompt
            req = eng.make_request(prompts[rid], sp, rid)
            if after:
                req.prefill_after = eng.requests[after]
            eng.enqueue(req)
        for rid in (aborts or {}).get(step, []):
            if rid in eng.requests:
                assert eng.abort_request(rid)
        if step > max(plan) and not eng.has_unfinished_requests():
            break
        for o in eng.step():
            assert o.request_id not in final or not final[o.request_id].finished, "an output after the last"
            final[o.request_id] = o
            streamed.setdefault(o.request_id, []).append(list(o.outputs[0].token_ids))
    assert not eng.has_unfinished_requests() and eng.in_flight is None
    for pool in eng.block_manager.pools.values():
        assert pool.num_free == pool.num_blocks and not any(pool.ref_cnt)
    return final, streamed


def same_outputs(a: dict, b: dict, skip: tuple = ()) -> None:
    assert a.keys() == b.keys()
    for rid, oa in a.items():
        if rid in skip:
            continue
        ca, cb = oa.outputs[0], b[rid].outputs[0]
        assert (ca.token_ids, ca.text, ca.finish_reason) == (cb.token_ids, cb.text, cb.finish_reason), rid
        for la, lb in zip(ca.logprobs or [], cb.logprobs or [], strict=True):
            assert la.keys() == lb.keys(), rid
            # float32 GEMMs over another batch make-up round the last bits differently (as padding does)
            np.testing.assert_allclose(list(la.values()), list(lb.values()), rtol=0, atol=3e-3)


def make_plan(rng, probe: list[int], tokenizer) -> dict:
    ids = lambda n: [int(x) for x in rng.integers(2, 500, n)]  # noqa: E731
    shared = ids(56)  # three blocks cached: a hit of 48 > W; the 16-token one below W
    greedy = dict(temperature=0.0, logprobs=2)
    stop_tok, stop_text = probe[6], tokenizer.decode(probe[3:5])
    seeded = dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2, frequency_penalty=0.3, min_tokens=6)
    return {
        0: [
            ("long", ids(85), SamplingParams(max_tokens=40, ignore_eos=True, **greedy), None),
            ("shared", shared + ids(3), SamplingParams(max_tokens=12, ignore_eos=True, **greedy), None),
        ],
        2: [
            ("stop_tok", PROBE_PROMPT, SamplingParams(max_tokens=30, stop_token_ids=[stop_tok], **greedy), None),
            ("stop_str", PROBE_PROMPT, SamplingParams(max_tokens=30, stop=[stop_text], **greedy), None),
            ("seeded", ids(40), SamplingParams(max_tokens=20, seed=5, logprobs=1, **seeded), None),
        ],
        4: [("aborted", ids(70), SamplingParams(max_tokens=50, ignore_eos=True, **greedy), None)],
        6: [
            ("hit_long", shared + ids(9), SamplingParams(max_tokens=10, ignore_eos=True, **greedy), None),
            ("hit_short", shared[:16] + ids(30), SamplingParams(max_tokens=10, ignore_eos=True, **greedy), None),
            ("n0", ids(36), SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.9, seed=1), None),
        ],
        7: [
            (f"n{i}", None, SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.9, seed=1 + i), "n0")
            for i in (1, 2, 3)
        ],
    }


PROBE_PROMPT = [7, 31, 64, 99, 150, 201, 255, 310, 333, 401, 420, 499]


@pytest.fixture(scope="module")
def probe(tiny_model_dir):
    """The greedy continuation of PROBE_PROMPT (the stop token and string come from it)."""
    llm = LLM(tiny_model_dir, block_size=BS, max_model_len=192, async_scheduling=False)
    out = llm.generate([PROBE_PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return out[0].outputs[0].token_ids, llm.engine.tokenizer


def test_overlap_changes_no_token(tiny_model_dir, rng, probe):
    toks, tokenizer = probe
    plan = make_plan(rng, toks, tokenizer)
    aborts = {24: ["aborted"]}
    runs = {}
    for overlap in (False, True):
        eng = engine(tiny_model_dir, overlap, num_gpu_blocks_override=18)
        launches = Launches(eng)
        runs[overlap] = (drive(eng, plan, aborts), eng, launches)
    (sync, _), sync_eng, sync_l = runs[False]
    (over, streamed), over_eng, over_l = runs[True]
    same_outputs(sync, over, skip=("aborted",))
    cut = [o["aborted"].outputs[0].token_ids for o in (sync, over)]  # the abort lands a step apart
    assert min(map(len, cut)) > 0 and cut[0][: len(cut[1])] == cut[1][: len(cut[0])]
    assert over_eng.num_generated_tokens - len(cut[1]) == sync_eng.num_generated_tokens - len(cut[0])
    assert sync_l.behind == 0 and sync_l.placeholders == 0
    assert over_l.behind > 0.5 * over_l.steps and over_l.placeholders > 0  # it did overlap
    for eng in (sync_eng, over_eng):
        assert eng.num_preemptions > 0 and eng.block_manager.prefix_hits > 0 and eng.block_manager.swa_blocks_released
    c = {rid: o.outputs[0] for rid, o in over.items()}
    assert c["stop_tok"].finish_reason == "stop" and c["stop_tok"].token_ids[-1] == toks[6]
    assert c["stop_str"].finish_reason == "stop" and len(c["stop_str"].token_ids) < 30
    assert c["aborted"].finish_reason is None and len(c["aborted"].token_ids) < 50
    assert len(c["seeded"].token_ids) >= 6 and len(c["long"].token_ids) == 40
    for rid, seen in streamed.items():  # each streamed output extends the one before, up to the final
        for before, after in zip(seen, seen[1:], strict=False):
            assert after[: len(before)] == before and len(after) > len(before), rid
        assert seen[-1] == c[rid].token_ids


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
def test_overlapped_decode_buckets_fill_placeholders_on_the_device(tiny_model_dir, rng, capture):
    """Padded decode steps (captured or not) launched behind a running step take their tokens
    from its draw: the same greedy tokens as in turn without buckets."""
    prompts = [[int(x) for x in rng.integers(2, 500, n)] for n in (20, 33, 47)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = []
    for overlap, kw in ((False, dict(cuda_graph_batch_sizes="")), (True, dict(cuda_graph_batch_sizes="4"))):
        eng = engine(tiny_model_dir, overlap, cuda_graph_capture=capture and overlap, **kw)
        launches = Launches(eng)
        outs.append(drive(eng, {0: [(f"r{i}", p, sp, None) for i, p in enumerate(prompts)]})[0])
    same_outputs(*outs)
    assert launches.placeholders > 0
    if capture:
        assert eng.runner.graphs.replays > 0


@pytest.mark.parametrize("where", ["launch", "finish"])
def test_a_step_failing_with_one_behind_fails_only_its_request(tiny_model_dir, rng, where):
    """A fault in a step (at its launch, or when its results are taken, with the next step already
    launched behind it) fails the request that causes it; the step behind is thrown away and
    undone, the others are retried one by one and end as an in-turn engine without the fault
    gives them; every block is free."""
    prompts = {f"r{i}": [int(x) for x in rng.integers(2, 500, 30 + 7 * i)] for i in range(3)}
    marker = 1  # only the poisoned prompt holds this token id
    bad = [int(x) for x in rng.integers(2, 500, 25)] + [marker]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want, _ = drive(engine(tiny_model_dir, False), {0: [(r, p, sp, None) for r, p in prompts.items()]})
    eng = engine(tiny_model_dir, True)
    runner, running_at_fault = eng.runner, []

    def poisoned(reqs) -> bool:
        if any(marker in r.prompt_token_ids and len(r.output_token_ids) >= 3 for r in reqs):
            running_at_fault.append(len(runner.launched_at))  # steps launched and not finished
            return True
        return False

    if where == "launch":  # before any device work of the step
        launch = runner.launch

        def faulty(prep, *a):
            if poisoned([r for r, _ in prep.scheduled]):
                raise RuntimeError("injected step failure")
            return launch(prep, *a)

        runner.launch = faulty
    else:  # at the copy-back of the step's draw, inside the runner's finish
        collect = runner.sampler.collect

        def faulty(drawn):
            live = [r for r in eng.requests.values() if any(r.sampling_state is st for st in drawn.states)]
            if poisoned(live):
                raise RuntimeError("injected step failure")
            return collect(drawn)

        runner.sampler.collect = faulty
    plan = {0: [(r, p, sp, None) for r, p in prompts.items()] + [("bad", bad, sp, None)]}
    got, _ = drive(eng, plan)
    assert got["bad"].outputs[0].finish_reason == "error" and "injected" in got["bad"].error
    assert len(got["bad"].outputs[0].token_ids) in (3, 4)  # 4: the token of the step before the fault's
    for rid in prompts:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    assert eng.num_request_errors == 1
    # a launch fault lands with a step running; a fault at taking results, with one launched behind
    assert max(running_at_fault) == (1 if where == "launch" else 2)


def test_structured_outputs_run_in_turn_and_match(tiny_model_dir):
    """While a request has a grammar, the next step waits for the running one's tokens (its mask
    needs them); once it finishes, steps overlap again. Same tokens as an in-turn engine."""
    so = StructuredOutput("regex", "(ab|cd){3,6}x", "structured_outputs.regex")
    plan = {
        0: [
            ("g", [5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0, structured=so), None),
            ("free", [9, 10, 11, 12], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), None),
        ]
    }
    outs, launches = [], []
    for overlap in (False, True):
        eng = engine(tiny_model_dir, overlap)
        launches.append(Launches(eng))
        outs.append(drive(eng, plan)[0])
    same_outputs(*outs)
    assert outs[1]["g"].outputs[0].finish_reason == "stop"
    g_steps = len(outs[1]["g"].outputs[0].token_ids)
    assert 0 < launches[1].behind <= launches[1].steps - g_steps  # none while "g" ran, some after


def test_speculation_runs_in_turn_with_the_same_tokens(mtp_model_dir, rng):
    """Uncaptured, MTP drafts come from the running step's tokens on the host: a speculating
    engine launches no step behind another and gives the in-turn tokens (greedy and seeded).
    Captured, verify steps chain (test_chained_steps_stop_and_abort_as_in_turn)."""
    sp = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.7, seed=3, ignore_eos=True),
    ]
    plan = {0: [(f"r{i}", [int(x) for x in rng.integers(4, 256, 24)], sp[i], None) for i in range(2)]}
    outs = []
    for overlap in (False, True):
        eng = engine(mtp_model_dir, overlap, speculative_config='{"method": "mtp", "num_speculative_tokens": 2}')
        launches = Launches(eng)
        outs.append(drive(eng, plan)[0])
        assert launches.behind == 0
    same_outputs(*outs)
    assert eng.spec.num_accepted_tokens > 0


@pytest.mark.parametrize("k", [1, 3])
def test_captured_speculation_changes_no_token_through_the_whole_plan(mtp_model_dir, rng, k):
    """Speculation with k drafts over the whole plan (window crossings, chunks below and above W,
    preemption, prefix hits shorter and longer than W, stop token / string, max_tokens,
    min_tokens, seeded penalized sampling, n = 4, an abort) plus a regex-constrained request and
    seeded sampled requests without penalties, three ways: every step eager, overlapped; decode
    and verify steps and the draft passes captured (buckets 1, 2, 4, 6 and their verify buckets)
    in turn; and captured overlapped, where a verify step is launched behind the running one
    from its acceptance on the device whenever the running step holds every live request and
    none has penalties or a grammar. The same tokens, texts, finish reasons, logprobs and drafts
    proposed and accepted each way; every block free at the end."""
    llm = LLM(mtp_model_dir, block_size=BS, max_model_len=192)
    probe = llm.generate([PROBE_PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    plan = make_plan(rng, probe[0].outputs[0].token_ids, llm.engine.tokenizer)
    so = StructuredOutput("regex", "(ab|cd){3,6}x", "structured_outputs.regex")
    plan[3] = [("grammar", [5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0, structured=so), None)]
    tail = [int(x) for x in rng.integers(4, 256, 12)]
    plan[60] = [  # alone at the end: steps that can chain, sampled with seeds, ending at max_tokens
        (f"tail{i}", tail + [i], SamplingParams(max_tokens=30 + 7 * i, temperature=0.7, seed=i), None) for i in range(2)
    ]
    spec = '{"method": "mtp", "num_speculative_tokens": %d}' % k
    runs = []
    for capture, overlap in ((False, True), (True, False), (True, True)):
        kw = dict(cuda_graph_capture=capture, cuda_graph_batch_sizes="1,2,4,6" if capture else "")
        eng = engine(mtp_model_dir, overlap, num_gpu_blocks_override=24, speculative_config=spec, **kw)
        runs.append((drive(eng, plan, {24: ["aborted"]})[0], eng))
    (eager, e_eng), (in_turn, t_eng), (captured, c_eng) = runs
    same_outputs(eager, in_turn)
    same_outputs(eager, captured)
    assert c_eng.runner.graphs.replays > 0 and c_eng.runner.spec.graphs.replays > 0
    assert t_eng.num_chained_steps == e_eng.num_chained_steps == 0 < c_eng.num_chained_steps
    for stat in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert getattr(c_eng.spec, stat) == getattr(t_eng.spec, stat) == getattr(e_eng.spec, stat) > 0, stat
    for eng in (e_eng, t_eng, c_eng):
        assert eng.num_preemptions > 0 and eng.block_manager.prefix_hits > 0 and eng.block_manager.swa_blocks_released
    g = captured["grammar"].outputs[0]
    assert g.finish_reason == "stop" and re.fullmatch("(ab|cd){3,6}x", g.text), g.text


def chained_engine(mtp_model_dir, overlap, **kw):
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    caps = dict(cuda_graph_capture=True, cuda_graph_batch_sizes="1,2,4")
    return engine(mtp_model_dir, overlap, speculative_config=spec, **caps, **kw)


def test_chained_steps_stop_and_abort_as_in_turn(mtp_model_dir, rng):
    """Captured speculation, every step after the prompts chained behind the running one: a
    request stopping on a token, one on a string, one at max_tokens and one aborted while a
    chained step runs end as in turn (the aborted one with a prefix of the other's tokens); the
    chained steps after a stop are thrown away and every block is free."""
    prompt = [int(x) for x in rng.integers(4, 256, 14)]
    probe, _ = drive(
        chained_engine(mtp_model_dir, False),
        {0: [("p", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), None)]},
    )
    toks = probe["p"].outputs[0].token_ids
    tok = chained_engine(mtp_model_dir, False).tokenizer
    greedy = dict(temperature=0.0, ignore_eos=True)
    plan = {
        0: [
            ("token", prompt, SamplingParams(max_tokens=30, stop_token_ids=[toks[17]], **greedy), None),
            ("string", prompt, SamplingParams(max_tokens=30, stop=[tok.decode(toks[9:11])], **greedy), None),
            ("length", prompt[:-1], SamplingParams(max_tokens=23, temperature=0.6, seed=4), None),
            ("aborted", prompt[2:], SamplingParams(max_tokens=30, **greedy), None),
        ]
    }
    outs = []
    for overlap in (False, True):
        eng = chained_engine(mtp_model_dir, overlap)
        final, _ = drive(eng, plan, {8: ["aborted"]})
        outs.append((final, eng))
    (want, e_turn), (got, e_chain) = outs
    same_outputs(want, got, skip=("aborted",))
    assert e_chain.num_chained_steps > 0 and e_turn.num_chained_steps == 0
    assert got["token"].outputs[0].token_ids[-1] == toks[17] and got["string"].outputs[0].finish_reason == "stop"
    a, b = (o["aborted"].outputs[0].token_ids for o in (want, got))
    assert a[: len(b)] == b or b[: len(a)] == a
    assert len(b) < 30 and "aborted" not in e_chain.requests  # cut short, gone from the engine


@pytest.mark.parametrize("where", ["chain", "finish"])
def test_a_fault_with_a_chained_step_behind(mtp_model_dir, rng, where):
    """A chained verify step that fails to launch (before any device work), and a speculating
    step whose results fail to come back while a chained step runs behind it: the failed step's
    requests are retried one by one (the chained step behind thrown away and undone first) and,
    the fault being transient, end as in turn; no request fails; every block is free."""
    prompts = {f"r{i}": [int(x) for x in rng.integers(4, 256, 12 + 5 * i)] for i in range(2)}
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    plan = {0: [(r, p, sp, None) for r, p in prompts.items()]}
    want, _ = drive(chained_engine(mtp_model_dir, False), plan)
    eng = chained_engine(mtp_model_dir, True)
    runner, faults = eng.runner, []
    if where == "chain":
        chain = runner.spec.graphs.chain

        def faulty(*a):
            if eng.num_chained_steps == 3 and not faults:
                faults.append(eng.num_chained_steps)
                raise RuntimeError("injected chain failure")
            return chain(*a)

        runner.spec.graphs.chain = faulty
    else:
        finish = runner.finish

        def faulty(running):
            if eng.in_flight is not None and eng.in_flight.chained and eng.num_chained_steps == 3 and not faults:
                faults.append(eng.num_chained_steps)
                raise RuntimeError("injected finish failure")
            return finish(running)

        runner.finish = faulty
    got, _ = drive(eng, plan)
    assert faults and eng.num_request_errors == 0 and eng.num_chained_steps > 3
    same_outputs(want, got)


def test_any_plan_gives_the_same_tokens_in_turn_and_overlapped(tiny_model_dir):
    """Hypothesis over request plans (1 to 5 requests arriving at steps 0..6, prompts of 1..100
    tokens, max_tokens 1..20, min_tokens, a stop token id, greedy or seeded sampling, an abort):
    the overlapped engine ends every request as the in-turn one does (aborted ones: a prefix of
    each other's tokens) and frees every block. The two engines serve every example in turn, so
    later examples also meet earlier ones' cached prefixes."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    engines = [engine(tiny_model_dir, overlap, num_gpu_blocks_override=24) for overlap in (False, True)]
    params = st.builds(
        dict,
        max_tokens=st.integers(1, 20),
        min_tokens=st.integers(0, 3),
        stop_token_ids=st.lists(st.integers(2, 499), max_size=1),
        temperature=st.sampled_from([0.0, 0.9]),
        seed=st.integers(0, 99),
    )
    request = st.tuples(st.integers(0, 6), st.lists(st.integers(2, 499), min_size=1, max_size=100), params)

    @settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(reqs=st.lists(request, min_size=1, max_size=5), abort=st.one_of(st.none(), st.integers(0, 12)))
    def check(reqs, abort):
        plan: dict = {}
        for i, (at, prompt, kw) in enumerate(reqs):
            sp = SamplingParams(**{**kw, "min_tokens": min(kw["min_tokens"], kw["max_tokens"])})
            plan.setdefault(at, []).append((f"q{check.n}-{i}", prompt, sp, None))
        aborts = {abort: [f"q{check.n}-0"]} if abort is not None else {}
        check.n += 1
        a, b = (drive(eng, plan, aborts)[0] for eng in engines)
        cut = tuple(r for r in a.keys() | b.keys() if not (r in a and r in b and a[r].finished and b[r].finished))
        same_outputs({r: o for r, o in a.items() if r not in cut}, {r: o for r, o in b.items() if r not in cut})
        for rid in cut:  # aborted: the abort lands a step apart (maybe before any output of one)
            assert aborts and rid in aborts[abort]
            x, y = (o[rid].outputs[0].token_ids if rid in o else [] for o in (a, b))
            assert x[: len(y)] == y[: len(x)], rid

    check.n = 0
    check()
