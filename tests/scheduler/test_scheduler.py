"""The scheduler alone (a full-attention pool only, block 4): who is preempted, that a request
preempted in a step is not re-admitted in that step, and the step's token and sequence budgets.
The expected choices are written out here from the policy in the module docstring."""

from fastdeploy.cache_manager.block_manager import BlockManager
from fastdeploy.config import SchedulerConfig
from fastdeploy.request import Request, RequestStatus
from fastdeploy.sampling_params import SamplingParams
from fastdeploy.scheduler.scheduler import Scheduler

BS = 4


def make(blocks: int, **cfg) -> Scheduler:
    return Scheduler(
        SchedulerConfig(**{"max_num_batched_tokens": 64, "max_num_seqs": 8, **cfg}), BlockManager({"full": blocks}, BS)
    )


def run(s: Scheduler) -> list[tuple[str, int]]:
    """One step: schedule, then mark the scheduled tokens computed (a decode also appends a token)."""
    out = s.schedule()
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(1)
    return out


def test_the_newest_running_request_is_preempted_and_not_readmitted_in_that_step():
    s = make(blocks=6)
    reqs = [Request(f"r{i}", [1] * 8, SamplingParams()) for i in range(3)]  # 2 full blocks each
    for r in reqs:
        s.add(r)
    run(s)  # all three prefill: 6 blocks, the pool is full
    assert [r.status for r in reqs] == [RequestStatus.RUNNING] * 3
    out = run(s)  # each decode needs its 3rd block: the newest (r2) gives its blocks up, then r1
    assert [r.request_id for r in out.preempted] == ["r2"]
    scheduled = [r.request_id for r, _ in out.scheduled]
    assert "r2" not in scheduled and scheduled == ["r0", "r1"]
    assert reqs[2].status == RequestStatus.WAITING and s.waiting[0] is reqs[2]
    assert reqs[2].num_computed_tokens == 0 and not reqs[2].block_tables["full"]


def test_each_step_keeps_the_token_and_sequence_budgets():
    s = make(blocks=200, max_num_batched_tokens=10, max_num_seqs=3)
    for i in range(5):
        s.add(Request(f"r{i}", [1] * (4 + 3 * i), SamplingParams()))
    steps = 0
    while s.has_unfinished():
        out = run(s)
        steps += 1
        assert out.num_tokens <= 10 and len(out.scheduled) <= 3 and len(s.running) <= 3
        for req, _ in out.scheduled:
            if len(req.output_token_ids) >= 2:  # two tokens out: finished
                s.finish(req)
        assert steps < 50
    assert steps > 3  # the budget really split the work


def test_admission_is_fair_between_groups():
    """Group "A" (one API call's many sequences) fills the slots first; "B" arrives later and its
    sequences are admitted as soon as slots free up, ahead of A's backlog, one for each of A's
    until the running counts are level; within a group, arrival order."""
    s = make(blocks=400, max_num_seqs=4)
    a = [Request(f"a{i}", [1] * 4, SamplingParams(), group="A") for i in range(10)]
    for r in a:
        s.add(r)
    run(s)
    assert [r.request_id for r in s.running] == ["a0", "a1", "a2", "a3"]
    b = [Request(f"b{i}", [1] * 4, SamplingParams(), group="B") for i in range(3)]
    for r in b:
        s.add(r)
    s.finish(a[0])
    out = run(s)
    assert [r.request_id for r, n in out.scheduled if n > 1] == ["b0"]  # B has 0 running, A 3
    s.finish(a[1])
    s.finish(a[2])
    out = run(s)
    assert [r.request_id for r, n in out.scheduled if n > 1] == ["a4", "b1"]  # 1 running each: arrival
    assert [r.request_id for r in s.waiting] == ["a5", "a6", "a7", "a8", "a9", "b2"]


def test_groups_arriving_together_interleave():
    s = make(blocks=400, max_num_seqs=4)
    for i in range(3):
        s.add(Request(f"a{i}", [1] * 4, SamplingParams(), group="A"))
    for i in range(3):
        s.add(Request(f"b{i}", [1] * 4, SamplingParams(), group="B"))
    run(s)
    assert [r.request_id for r in s.running] == ["a0", "b0", "a1", "b1"]
    ungrouped = make(blocks=400, max_num_seqs=4)  # no groups: arrival order
    for i in range(6):
        ungrouped.add(Request(f"r{i}", [1] * 4, SamplingParams()))
    run(ungrouped)
    assert [r.request_id for r in ungrouped.running] == ["r0", "r1", "r2", "r3"]


def test_abort_frees_a_running_and_a_waiting_request():
    s = make(blocks=8, max_num_seqs=1)
    a, b = Request("a", [1] * 8, SamplingParams()), Request("b", [1] * 8, SamplingParams())
    s.add(a)
    s.add(b)
    run(s)
    assert s.running == [a] and list(s.waiting) == [b] and s.bm.pools["full"].num_free == 6
    s.abort(a)
    assert s.running == [] and list(s.waiting) == [b] and s.bm.pools["full"].num_free == 8
    s.abort(b)
    assert not s.has_unfinished() and s.bm.pools["full"].num_free == 8


def test_decodes_are_scheduled_before_prefill_chunks():
    """A budget of 3: the decode (1 token) goes first, the prefill chunk (two tokens left, so
    not a decode) gets the rest; then a step whose budget exactly fits three decodes runs all
    three."""
    s = make(blocks=40, max_num_batched_tokens=3)
    old = Request("old", [1] * 5, SamplingParams())
    s.add(old)
    run(s)  # 3 of its 5 prompt tokens
    new = Request("new", [2] * 2, SamplingParams())
    s.add(new)
    out = run(s)  # old: its last 2; new: 1 of 2
    assert [(r.request_id, n) for r, n in out.scheduled] == [("old", 2), ("new", 1)]
    out = run(s)  # old decodes (1), new finishes its prompt (1)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("old", 1), ("new", 1)]
    third = Request("third", [3], SamplingParams())
    s.add(third)
    run(s)
    out = run(s)
    assert sorted((r.request_id, n) for r, n in out.scheduled) == [("new", 1), ("old", 1), ("third", 1)]


def test_a_scheduled_decode_preempted_later_in_the_step_leaves_the_step():
    """The newest request decodes first and takes the last free block; an older one's prefill
    chunk then needs a block and preempts it: the step holds only the older request."""
    s = make(blocks=4)
    old, new = Request("old", [1] * 8, SamplingParams()), Request("new", [2] * 4, SamplingParams())
    s.add(old)
    s.add(new)
    run(s)  # old: 8 + 1 out (2 blocks), new: 4 + 1 out (1 block)
    old.num_computed_tokens = 4  # old recomputes positions 4..8 (a prefill chunk, 3rd block)
    assert s.bm.pools["full"].num_free == 1
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["new"]
    assert [(r.request_id, n) for r, n in out.scheduled] == [("old", 5)]


def test_a_request_preempted_early_in_the_step_lets_the_later_ones_run():
    """Running: a (decode), b (prefill chunk), c (decode, newest); the pool is full. a needs a
    block and preempts c, whose blocks are enough for a and for b: both run."""
    s = make(blocks=5)
    a, b, c = (Request(r, [i] * n, SamplingParams()) for i, (r, n) in enumerate((("a", 4), ("b", 8), ("c", 8))))
    for r in (a, b, c):
        s.add(r)
    run(s)  # a: 1 block, b: 2, c: 2; each has its first output token
    b.num_computed_tokens = 4  # b recomputes positions 4..8 (a prefill chunk, its 3rd block)
    assert s.bm.pools["full"].num_free == 0
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["c"]
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 5)]


def test_each_preemption_counts_once():
    """Three requests decoding in a pool too small for all: over many steps the requests'
    num_preemptions add up to the preemptions the steps report, and each keeps the time it was
    first scheduled."""
    s = make(blocks=6)
    reqs = [Request(f"r{i}", [1] * 8, SamplingParams()) for i in range(3)]
    for r in reqs:
        s.add(r)
    reported = 0
    run(s)
    first = [r.first_scheduled_time for r in reqs]
    for _ in range(40):
        reported += len(run(s).preempted)
    assert reported >= 2 and sum(r.num_preemptions for r in reqs) == reported
    assert [r.first_scheduled_time for r in reqs] == first  # kept over preemptions
    again = make(blocks=6)
    r0, r1, r2 = (Request(f"r{i}", [1] * 8, SamplingParams()) for i in range(3))
    for r in (r0, r1, r2):
        again.add(r)
    run(again)
    run(again)  # r0 needs a 3rd block: r2 is preempted
    again.finish(r0)  # r2 comes back (3 blocks); r1 later needs a 4th
    for _ in range(10):
        run(again)
        if r2.num_preemptions == 2:
            break
    assert r2.num_preemptions == 2 and r2.status == RequestStatus.WAITING


def test_no_admission_in_a_step_that_preempted():
    """A step that preempted admits nothing, even where the freed blocks would fit a chunk of
    the victim and the token budget leaves room for one."""
    s = make(blocks=7)
    reqs = [Request(f"r{i}", [1] * n, SamplingParams()) for i, n in enumerate((8, 8, 12))]
    for r in reqs:
        s.add(r)
    run(s)  # 2 + 2 + 3 blocks: the pool is full
    s.config.max_num_batched_tokens = 4
    out = s.schedule()  # r0 and r1 need a block each: r2 is preempted, 1 block and 2 tokens of budget left
    assert [r.request_id for r in out.preempted] == ["r2"] and s.bm.pools["full"].num_free == 1
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"] and s.waiting[0] is reqs[2]


def draft_step(max_tokens: int = 50, budget: int = 64, drafts=(7, 8, 9), max_model_len: int = 64):
    """A request past its 6-token prompt (one token out) with drafts, and the step that follows."""
    s = make(blocks=40, max_model_len=max_model_len)
    req = Request("d", [1] * 6, SamplingParams(max_tokens=max_tokens))
    s.add(req)
    run(s)
    s.config.max_num_batched_tokens = budget
    req.draft_token_ids = list(drafts)
    return s, req, s.schedule()


def test_a_decode_verifies_its_drafts_within_room_and_budget():
    _, req, out = draft_step()
    assert out.scheduled == [(req, 4)] and req.draft_token_ids == [7, 8, 9]  # its token and 3 drafts
    _, req, out = draft_step(max_tokens=3)  # 1 out, 2 left: room for 1 draft
    assert out.scheduled == [(req, 2)] and req.draft_token_ids == [7]
    _, req, out = draft_step(budget=3)  # 3 tokens: its own and 2 drafts
    assert out.scheduled == [(req, 3)] and req.draft_token_ids == [7, 8]
    _, req, out = draft_step(max_model_len=9)  # 7 tokens, room to 9: 1 draft
    assert out.scheduled == [(req, 2)] and req.draft_token_ids == [7]
    s, req, out = draft_step()
    for r, n in out.scheduled:
        r.num_computed_tokens += n
    req.output_token_ids += [7, 8, 9, 5]  # all three accepted, and the token after them
    req.draft_token_ids = []
    out = s.schedule()
    assert out.scheduled == [(req, 1)]  # no drafts: one token


def lookahead_step(lookahead: int, max_model_len: int = 64, blocks: int = 40):
    """A request past its 7-token prompt (2 blocks, one token out), and its next decode step."""
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=max_model_len),
        BlockManager({"full": blocks}, BS),
        lookahead=lookahead,
    )
    req = Request("l", [1] * 7, SamplingParams(max_tokens=60))
    s.add(req)
    run(s)
    return s, req, s.schedule()


def test_lookahead_blocks_for_the_draft_model():
    """With lookahead L a running request's blocks cover L positions past the step's tokens
    (the draft model writes them), never past max_model_len, and only the step's own tokens
    when the pool is short of the rest (no preemption for them)."""
    for lookahead in (1, 2, 5, 9):
        _, req, out = lookahead_step(lookahead)
        assert out.scheduled == [(req, 1)]
        assert len(req.block_tables["full"]) == -(-(8 + lookahead) // BS), lookahead
    _, req, _ = lookahead_step(0)
    assert len(req.block_tables["full"]) == 2
    _, req, _ = lookahead_step(5, max_model_len=10)  # 2 positions past the step to max_model_len
    assert len(req.block_tables["full"]) == 3
    _, req, _ = lookahead_step(9, max_model_len=12)  # positions up to 11: 3 blocks, not a 4th
    assert len(req.block_tables["full"]) == 3
    _, req, out = lookahead_step(5, blocks=2)  # the pool has only the 2 blocks the step needs
    assert out.scheduled == [(req, 1)] and len(req.block_tables["full"]) == 2 and not out.preempted


def ids(out) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


def test_fair_order_ranks_each_groups_kth_waiting_request_at_running_plus_k():
    """A has 0 running and 3 waiting (ranks 0, 1, 2), B has 2 running and 1 waiting (rank 2):
    admitted A0, A1, then A2 and B0 tie at 2 and go by arrival."""
    s = make(blocks=400, max_num_seqs=5)
    for i in range(2):
        s.add(Request(f"b-run{i}", [1] * 4, SamplingParams(), group="B"))
    run(s)
    for i in range(3):
        s.add(Request(f"a{i}", [1] * 4, SamplingParams(), group="A"))
    s.add(Request("b0", [1] * 4, SamplingParams(), group="B"))
    out = run(s)
    assert [r for r, n in ids(out) if n > 1] == ["a0", "a1", "a2"]


def test_samples_wait_for_the_first_to_compute_the_prompt():
    """Sample 2 of a prompt waits while sample 1 computes the prompt (then shares its blocks),
    and later requests are not held back by it; once sample 1 has computed the prompt, or has
    finished, sample 2 is admitted."""
    s = make(blocks=400, max_num_batched_tokens=6)
    first = Request("s1", [1] * 8, SamplingParams())
    second = Request("s2", [1] * 8, SamplingParams(), prefill_after=first)
    other = Request("o", [2] * 2, SamplingParams())
    for r in (first, second, other):
        s.add(r)
    out = run(s)  # s1: 6 of 8; s2 waits; o: admitted behind it
    assert ids(out) == [("s1", 6)] and list(s.waiting) == [second, other]
    out = run(s)  # s1's last 2 prompt tokens; s2 still waits; o gets 2
    assert ids(out) == [("s1", 2), ("o", 2)] and list(s.waiting) == [second]
    out = run(s)  # s1 has its prompt: s2 is admitted
    assert ("s2", 4) in ids(out)
    lone = make(blocks=400)
    a = Request("a", [1] * 8, SamplingParams())
    b = Request("b", [1] * 8, SamplingParams(), prefill_after=a)
    lone.add(b)
    a.status = RequestStatus.FINISHED  # the first sample was aborted before it ran
    assert ids(run(lone)) == [("b", 8)]


def test_admission_to_the_last_token_of_the_budget():
    """A decode leaves a budget of 3: a waiting prompt gets a chunk of 2, the next one the last
    token (chunks of 1 are admitted)."""
    s = make(blocks=400, max_num_batched_tokens=4)
    s.add(Request("d", [1] * 4, SamplingParams()))
    run(s)
    s.add(Request("p", [2, 2], SamplingParams()))
    s.add(Request("q", [3] * 5, SamplingParams()))
    assert ids(s.schedule()) == [("d", 1), ("p", 2), ("q", 1)]


def test_without_chunked_prefill_a_prompt_waits_for_the_whole_budget():
    """Chunked prefill off: a prompt that does not fit the budget left waits (no blocks held);
    one that fits it exactly is admitted."""
    s = make(blocks=400, max_num_batched_tokens=8, max_model_len=8, enable_chunked_prefill=False)
    s.add(Request("a", [1] * 3, SamplingParams()))
    s.add(Request("b", [2] * 6, SamplingParams()))
    out = s.schedule()
    assert ids(out) == [("a", 3)] and [r.request_id for r in s.waiting] == ["b"]
    assert s.waiting[0].block_tables.get("full", []) == [] and s.bm.pools["full"].num_free == 399
    exact = make(blocks=400, max_num_batched_tokens=8, max_model_len=8, enable_chunked_prefill=False)
    exact.add(Request("c", [3] * 7, SamplingParams()))
    assert ids(exact.schedule()) == [("c", 7)]


def test_a_request_that_finds_no_blocks_waits_with_nothing_computed():
    """Prefix caching: a waiting prompt whose cached prefix hits but whose own blocks do not fit
    is left waiting with no tokens computed and no blocks referenced; its first scheduled time
    is set when it is admitted."""
    bm = BlockManager({"full": 4}, BS, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), bm)
    a = Request("a", [1] * 8 + [2], SamplingParams())
    s.add(a)
    run(s)
    bm.cache_full_blocks(a)
    t0 = a.first_scheduled_time
    assert t0 is not None
    b = Request("b", [1] * 8 + [3] * 9, SamplingParams())  # 2 blocks hit, 3 more needed, 1 free
    s.add(b)
    out = s.schedule()
    assert [r for r, _ in out.scheduled] == [a] and s.waiting[0] is b
    assert b.num_computed_tokens == 0 and b.block_tables["full"] == [] and b.first_scheduled_time is None
    assert [bm.pools["full"].ref_cnt[x] for x in a.block_tables["full"]] == [1, 1, 1]


def test_a_decode_goes_before_an_older_requests_prefill_chunk():
    """Running: P (older) with 2 prompt tokens to recompute, D (newer) decoding; a budget of 2:
    D's token first, then 1 of P's (P with exactly 2 left is a prefill chunk, not a decode)."""
    s = make(blocks=40)
    p, d = Request("P", [1] * 6, SamplingParams()), Request("D", [2] * 3, SamplingParams())
    s.add(p)
    s.add(d)
    run(s)
    p.num_computed_tokens = p.num_tokens - 2
    s.config.max_num_batched_tokens = 2
    assert ids(s.schedule()) == [("D", 1), ("P", 1)]
