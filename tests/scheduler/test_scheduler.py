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
