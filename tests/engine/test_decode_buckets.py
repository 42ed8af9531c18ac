"""Pure-decode steps padded to a bucket (``cuda_graph_batch_sizes``) change nothing: two engines
run the same requests in lockstep, one padded, one not, and after every step their tokens, top
logprobs, pool counts and every real KV block agree; padding rows touch only the null block.
float32 GEMMs over another batch size round the last bits differently: one step's logits agree
to 1e-5; over many steps that rounding feeds back through the KV, so KV and logprobs agree to
1e-3 (a padding row writing a real block would differ by O(1)); tokens exactly. Covers window
crossings (sequences >= 2W + a block, W = 32, block 16), SWA block release, preemption, prefix
hits and an n > 1 sibling; and the decode step never syncs the host."""

import re
from dataclasses import replace

import numpy as np
import paddle
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.config import SchedulerConfig
from fastdeploy.engine.args import batch_sizes
from fastdeploy.worker.prompt_logprobs import PromptLogprobRows
from fastdeploy.worker.step_inputs import StepInputs


def engines(model_dir, capture=False, **kw):
    common = dict(block_size=16, max_num_seqs=8, enable_prefix_caching=True, max_model_len=192, **kw)
    return LLM(model_dir, cuda_graph_batch_sizes=[4, 8], cuda_graph_capture=capture, **common).engine, LLM(
        model_dir, cuda_graph_batch_sizes="", **common
    ).engine


def add(eng, prompt, rid, after=None, **kw):
    kw = {"max_tokens": 14, "temperature": 0.0, **kw}
    sp = SamplingParams(ignore_eos=True, logprobs=3, **kw)
    req = eng.make_request(prompt, sp, rid)
    if after is not None:
        req.prefill_after = eng.requests[after]
    eng.enqueue(req)


def same_state(a, b):
    for g, pool in a.block_manager.pools.items():
        other = b.block_manager.pools[g]
        assert pool.num_free == other.num_free and list(pool.ref_cnt) == list(other.ref_cnt), g
    for spec, ca, cb in zip(a.runner.kv_specs, a.runner.caches, b.runner.caches, strict=True):
        n = a.runner.num_blocks[spec.group]  # the real blocks; the null block is the last
        x, y = ca[:n].numpy(), cb[:n].numpy()
        if x.dtype == np.uint8:  # FP8 records: a GEMM of another batch size may round a code the other way
            assert (x != y).mean() < 1e-3
        else:  # float32 GEMMs of another batch size differ in the last bits, and where that rounds
            # an earlier SWA layer's e4m3 code the other way, later layers move by up to ~1e-3
            # (tests/models/test_swa.py's INVARIANCE_TOL); a wrong row or block moves them by O(1)
            np.testing.assert_allclose(x, y, rtol=0, atol=3e-3)


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
def test_padding_changes_no_token_logprob_count_or_block(tiny_model_dir, rng, capture):
    """A full pool of 14 blocks forces preemptions. Captured: the padded engine's decode steps run
    as its buckets' captured steps (docs/design.md §4.11), which read only the step buffer."""
    blocks = 14
    padded, plain = engines(tiny_model_dir, capture, num_gpu_blocks_override=blocks)
    assert (padded.runner.graphs is not None) == capture
    shared = [int(x) for x in rng.integers(2, 500, 40)]
    plan = {  # step -> requests arriving then: (id, prompt, sibling of)
        0: [("a", [int(x) for x in rng.integers(2, 500, 85)], None), ("b", shared + [7, 8, 9], None)],
        2: [("c", [int(x) for x in rng.integers(2, 500, 5)], None)],
        3: [("s", [int(x) for x in rng.integers(2, 500, 9)], None)],  # sampled, seeded
        5: [("d", shared + [11, 12], None), ("e", [int(x) for x in rng.integers(2, 500, 33)], None)],
        6: [("e2", None, "e")],
    }
    prompts = {}
    padded_steps = 0
    for step in range(60):
        for rid, prompt, after in plan.get(step, []):
            prompt = prompts[after] if after else prompt
            prompts[rid] = prompt
            sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 7} if rid == "s" else {}
            for eng in (padded, plain):
                add(eng, prompt, rid, after, **sampled)
        if not padded.has_unfinished_requests() and step > 6:
            break
        sched_before = padded.scheduler.running[:]
        out_a, out_b = padded.step(), plain.step()
        if sched_before and all(r.num_tokens_to_compute == 1 for r in sched_before):
            padded_steps += len(sched_before) not in (4, 8)
        assert [(o.request_id, o.outputs[0].token_ids) for o in out_a] == [
            (o.request_id, o.outputs[0].token_ids) for o in out_b
        ]
        for oa, ob in zip(out_a, out_b, strict=True):
            for la, lb in zip(oa.outputs[0].logprobs, ob.outputs[0].logprobs, strict=True):
                assert la.keys() == lb.keys()
                np.testing.assert_allclose(list(la.values()), list(lb.values()), rtol=0, atol=3e-3)
        same_state(padded, plain)
    assert not padded.has_unfinished_requests() and not plain.has_unfinished_requests()
    assert padded_steps > 0  # some decode steps really ran padded
    if capture:
        assert padded.runner.graphs.replays >= padded_steps
    assert padded.num_preemptions > 0 and padded.num_preemptions == plain.num_preemptions
    assert padded.block_manager.prefix_hits > 0
    for pool in padded.block_manager.pools.values():
        assert pool.num_free == pool.num_blocks


def test_padding_rows_run_as_the_bucket_and_write_the_null_block(tiny_model_dir, rng):
    """Three decodes run as the bucket of 4; the padding row's KV lands in the null block (zero
    until then), which no pool hands out."""
    padded, _ = engines(tiny_model_dir)
    runner = padded.runner
    rows = []
    inner = runner.run_step

    def run_step(step, *a):
        rows.append((step.batch_size, len(step.samples_at)))
        return inner(step, *a)

    runner.run_step = run_step
    for i in range(3):
        add(padded, [int(x) for x in rng.integers(2, 500, 20 + i)], f"r{i}", max_tokens=4)
    while padded.has_unfinished_requests():
        padded.step()
    assert (4, 3) in rows
    for spec, cache in zip(runner.kv_specs, runner.caches, strict=True):
        null = runner.null_block[spec.group]
        assert null == runner.num_blocks[spec.group] == cache.shape[0] - 1
        assert np.abs(cache[null].astype("float32").numpy()).sum() > 0
        pool = padded.block_manager.pools[spec.group]
        assert pool.num_free == pool.num_blocks and max(pool.free) < null  # never handed out


def test_one_padded_step_gives_the_same_logits(tiny_model_dir, rng):
    """The same decode step run at its own size and padded to a bucket: logits within 1e-5."""
    eng = LLM(tiny_model_dir, block_size=16, max_num_seqs=8, cuda_graph_batch_sizes="", async_scheduling=False).engine
    for i in range(3):
        add(eng, [int(x) for x in rng.integers(2, 500, 20 + i)], f"r{i}", max_tokens=3)
    eng.step()  # the prefills
    runner, sched = eng.runner, [(r, 1) for r in eng.scheduler.running]
    for req, _ in sched:
        eng.block_manager.allocate(req, 1)
    plain = runner.step_inputs(sched)
    eng.config.scheduler_config.cuda_graph_batch_sizes = (4,)
    padded = runner.step_inputs(sched)
    assert len(plain.input_ids) == 3 and len(padded.input_ids) == 4 and padded.samples_at == [0, 1, 2]
    want = runner.run_step(plain)[0].numpy().astype(np.float64)
    np.testing.assert_allclose(runner.run_step(padded)[0].numpy(), want, rtol=0, atol=1e-5)


def test_bucket_settings():
    assert batch_sizes(None, 40, on_cuda=True) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert batch_sizes(None, 12, on_cuda=True) == (1, 2, 4, 8, 12)
    assert batch_sizes(None, 64, on_cuda=False) == ()
    assert batch_sizes("8, 2,4", 8, on_cuda=False) == (2, 4, 8)
    assert batch_sizes([8, 2, 4, 4], 8, on_cuda=True) == (2, 4, 8)
    assert batch_sizes([], 8, on_cuda=True) == ()
    assert SchedulerConfig(max_num_seqs=8, cuda_graph_batch_sizes=(2, 4)).bucket_for(3) == 4
    assert SchedulerConfig(max_num_seqs=8, cuda_graph_batch_sizes=(2, 4)).bucket_for(5) == 5
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        SchedulerConfig(max_num_seqs=8, cuda_graph_batch_sizes=(4, 16))
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        batch_sizes("4,x", 8, on_cuda=False)
    for bad in (["4"], [True], [2.0]):
        with pytest.raises(ValueError, match="cuda_graph_batch_sizes must be integers"):
            batch_sizes(bad, 8, on_cuda=False)


def refuse(what):
    def f(*a, **k):
        raise AssertionError(f"inside the decode step: {what}")

    return f


class NoHostSync:
    """Inside it, a paddle tensor converted to the host raises (numpy, item, tolist, truth value,
    int, float), and so does every op whose output shape depends on the data (nonzero, unique,
    masked_select, a boolean mask as an index): a CUDA build needs the count on the host, and a
    captured graph would keep the count of its capture. With ``uploads`` a host-to-device copy
    (``paddle.to_tensor``) raises too, which a CUDA-graph capture cannot hold either."""

    names = ("numpy", "item", "tolist", "__bool__", "__int__", "__float__", "__array__")
    shaped = ("nonzero", "unique", "masked_select")

    def __init__(self, uploads=False):
        self.uploads = uploads

    def __enter__(self):
        self.saved = {n: getattr(paddle.Tensor, n) for n in self.names + self.shaped + ("__getitem__",)}
        self.ops = {n: getattr(paddle, n) for n in self.shaped}
        self.to_tensor = paddle.to_tensor
        for n in self.names:
            setattr(paddle.Tensor, n, refuse(f"host sync, Tensor.{n}"))
        for n in self.shaped:
            setattr(paddle.Tensor, n, refuse(f"data-dependent shape, Tensor.{n}"))
            setattr(paddle, n, refuse(f"data-dependent shape, paddle.{n}"))
        getitem = self.saved["__getitem__"]

        def getitem_guarded(x, index):
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, paddle.Tensor) and p.dtype == paddle.bool for p in parts):
                raise AssertionError("inside the decode step: data-dependent shape, a boolean mask as an index")
            return getitem(x, index)

        paddle.Tensor.__getitem__ = getitem_guarded
        if self.uploads:
            paddle.to_tensor = refuse("upload, paddle.to_tensor")

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(paddle.Tensor, n, f)
        for n, f in self.ops.items():
            setattr(paddle, n, f)
        paddle.to_tensor = self.to_tensor


def test_the_guard_refuses_data_dependent_shapes():
    x = paddle.to_tensor(np.array([3, -1, 5], np.int32))
    for op in (
        lambda: paddle.nonzero(x >= 0),
        lambda: x.nonzero(),
        lambda: paddle.unique(x),
        lambda: paddle.masked_select(x, x >= 0),
        lambda: x[x >= 0],
        lambda: x.numpy(),
    ):
        with NoHostSync(), pytest.raises(AssertionError, match="inside the decode step"):
            op()
    with NoHostSync():
        y = paddle.where(x >= 0, x, paddle.zeros_like(x))[paddle.to_tensor(np.array([0, 2]))]
    assert y.numpy().tolist() == [3, 5]


@pytest.mark.parametrize(
    "capture, provider, kv_cache_dtype, model",
    [
        (False, "triton", "auto", "tiny_model_dir"),
        (True, "triton", "auto", "tiny_model_dir"),  # full layers' latent cache in the model dtype
        (True, "triton", "fp8", "tiny_model_dir"),
        (True, "reference", "auto", "tiny_model_dir"),
        (True, "flashmla", "bf16", "tiny_model_dir"),  # FlashMLA's dense decode over a bf16 latent cache
        (True, "flashmla", "fp8", "tiny_model_dir"),
        (True, "triton", "fp8", "dsa_model_dir"),  # DSA layers: the indexer's kernels inside the captured step
        (True, "reference", "auto", "dsa_model_dir"),
    ],
    ids=[
        "eager",
        "captured-triton-latent",
        "captured-triton-fp8",
        "captured-reference",
        "captured-flashmla-bf16",
        "captured-flashmla-fp8",
        "captured-dsa-fp8",
        "captured-dsa-reference",
    ],
)
def test_decode_steps_never_sync_the_host(request, rng, monkeypatch, capture, provider, kv_cache_dtype, model):
    """Steady padded decode steps with the Triton kernels (interpreter): the forward and the
    sampler's device op run with every tensor-to-host conversion and every data-dependent shape
    raising. Captured: the whole captured step (inputs out of the step buffer, the step's
    ForwardMeta and plans, the model, the LM head) runs with host copies and uploads raising, for
    each sparse MLA provider (FlashMLA: its stand-in) and both full-layer cache formats, and for a
    model with DSA layers (the indexer's key write, scores and pick on the device: its Triton
    kernels, and its paddle ops)."""
    import sys

    from fake_flash_mla import fake_flash_mla

    from fastdeploy.model_executor.layers import device_sampler

    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla([]))
    eng = LLM(
        request.getfixturevalue(model),
        block_size=16,
        max_num_seqs=4,
        kernel_backend="triton",
        sparse_mla_provider=provider,
        kv_cache_dtype=kv_cache_dtype,
        cuda_graph_batch_sizes="4",
        cuda_graph_capture=capture,
        index_kernel_backend="triton" if model == "dsa_model_dir" and provider == "triton" else "reference",
    ).engine
    model, graphs = eng.runner.model, eng.runner.graphs
    guarded = {"forward": 0, "sample": 0}
    forward, sample_tokens = model.forward, device_sampler.sampling.sample_tokens

    def forward_guarded(meta, *a, **k):
        if not meta.seq_lens_encoder.any():  # a pure-decode step (host lengths: no sync)
            guarded["forward"] += 1
            with NoHostSync():
                return forward(meta, *a, **k)
        return forward(meta, *a, **k)

    if capture:
        body = graphs.body

        def body_guarded(B):
            with NoHostSync(uploads=True):
                return body(B)

        monkeypatch.setattr(graphs, "body", body_guarded)

    def sample_guarded(*a, **k):
        guarded["sample"] += 1
        with NoHostSync():
            return sample_tokens(*a, **k)

    monkeypatch.setattr(model, "forward", forward_guarded)
    monkeypatch.setattr(device_sampler.sampling, "sample_tokens", sample_guarded)
    for i, kw in enumerate([{}, {"temperature": 0.8, "top_p": 0.9, "top_k": 20}, {"repetition_penalty": 1.2}]):
        sp = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2, **{"temperature": 0.0, **kw})
        eng.add_request([int(x) for x in rng.integers(2, 500, 10 + i)], sp, f"r{i}")
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.outputs[0].finish_reason != "error", o.error
            outs[o.request_id] = o
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs.values()) and len(outs) == 3
    assert guarded["forward"] >= 3 and guarded["sample"] >= 4
    assert (graphs.replays >= 3) if capture else graphs is None


def test_a_seed_draws_the_same_tokens_alone_or_in_a_batch(tiny_model_dir, rng):
    """The device sampler keys a draw by (seed, step): a seeded sampled request gives the same
    tokens alone and among others, padded or not."""
    prompt = [int(x) for x in rng.integers(2, 500, 12)]
    kw = {"temperature": 1.0, "top_p": 0.95, "top_k": 40, "seed": 1234, "max_tokens": 8}

    def run(others: int, sizes: str):
        eng = LLM(tiny_model_dir, block_size=16, max_num_seqs=8, cuda_graph_batch_sizes=sizes).engine
        for i in range(others):
            add(eng, [int(x) for x in rng.integers(2, 500, 5 + i)], f"o{i}", temperature=0.9, max_tokens=8)
        add(eng, prompt, "me", **kw)
        out = {}
        while eng.has_unfinished_requests():
            out.update({o.request_id: o.outputs[0].token_ids for o in eng.step()})
        return out["me"]

    alone = run(0, "")
    assert run(3, "") == alone and run(2, "8") == alone


def test_capture_settings(tiny_model_dir, mtp_model_dir, rng):
    """--enforce-eager wins over --cuda-graph-capture; speculation with k drafts adds verify
    buckets of bucket x (k + 1) rows; steps that are not a bucket's decodes or verifies (a batch
    above every bucket, a prefill, prompt logprobs) run eagerly and give the eager engine's tokens."""
    kw = dict(block_size=16, max_num_seqs=8, cuda_graph_batch_sizes="2", cuda_graph_capture=True)
    assert LLM(tiny_model_dir, enforce_eager=True, **kw).engine.runner.graphs is None
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    assert LLM(mtp_model_dir, speculative_config=spec, **kw).engine.runner.graphs.buckets == (2, 6)
    eng = LLM(tiny_model_dir, **kw).engine
    plain = LLM(tiny_model_dir, **{**kw, "cuda_graph_batch_sizes": ""}).engine
    prompts = [[int(x) for x in rng.integers(2, 500, 9 + i)] for i in range(3)]
    outs = []
    for e in (eng, plain):
        for i, p in enumerate(prompts):  # three decodes: above the one bucket (2)
            sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=1 if i == 0 else None)
            e.add_request(p, sp, f"r{i}")
        done = {}
        while e.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in e.step()})
        outs.append(done)
    assert outs[0] == outs[1] and eng.runner.graphs.replays == 0
    step = StepInputs([5, 6], [0, 0], [3, 4], {"full": [[1], [2]]}, [0, 1], [[0], [1]])
    graphs = eng.runner.graphs
    assert graphs.takes(step)
    assert not graphs.takes(replace(step, prompt_logprobs=PromptLogprobRows([0], [7], 0)))
    assert not graphs.takes(replace(step, seq_lens_encoder=[0, 3]))
    assert not graphs.takes(replace(step, block_tables={"full": [[1], [2] * (graphs.width + 1)]}))
    assert not graphs.takes(replace(step, sample_rows=[[0], [1, 2]]))
    tables = {g: [[1]] for g in graphs.null_block}
    verify = StepInputs([5, 6], [2], [3], tables, [0], [[0, 1]])  # a last token and one draft
    assert graphs.takes(verify) and graphs.rows_of(verify) == (2, [5, 6], [3, 4], {g: [[1], [1]] for g in tables})
    assert not graphs.takes(replace(verify, sample_rows=[[1]]))  # a token that does not sample
    three = StepInputs([5, 6, 7], [1, 2], [3, 4], {g: [[1], [2]] for g in tables}, [0, 1], [[0], [1, 2]])
    assert not graphs.takes(three)  # one decode row a token: 3 rows, above the bucket of 2


def test_captured_verify_steps_give_the_eager_tokens(mtp_model_dir, rng, monkeypatch):
    """Speculation with captured steps: verify steps (each request's last token and its drafts,
    one decode row a token, padded to a verify bucket) run as the bucket's body, and the draft
    passes after them as the bucket's draft body; they give the eager speculating engine's tokens
    and logprobs (greedy and seeded), and its drafts proposed and accepted. k = 3; a prompt
    crosses 2W + a block (W 32, block 16). (Greedy speculation equals the engine without it:
    test_spec_decode.)"""
    spec = '{"method": "mtp", "num_speculative_tokens": 3}'
    kw = dict(block_size=16, max_num_seqs=4, max_model_len=192, speculative_config=spec)
    captured = LLM(mtp_model_dir, cuda_graph_batch_sizes="1,2,4", cuda_graph_capture=True, **kw).engine
    graphs, shapes = captured.runner.graphs, []
    run = graphs.run

    def recorded(step, *a):
        shapes.append(step.is_decode)
        return run(step, *a)

    monkeypatch.setattr(graphs, "run", recorded)
    eager = LLM(mtp_model_dir, cuda_graph_batch_sizes="", **kw).engine
    prompts = [[int(x) for x in rng.integers(4, 256, n)] for n in (85, 40, 23)]
    sps = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)] * 2 + [
        SamplingParams(max_tokens=30, temperature=0.8, seed=4, ignore_eos=True, logprobs=2)
    ]
    outs = []
    for e in (captured, eager):
        for i, (p, sp) in enumerate(zip(prompts, sps, strict=True)):
            e.add_request(p, sp, f"r{i}")
        done = {}
        while e.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0] for o in e.step()})
        outs.append(done)
    for rid, c in outs[0].items():
        assert c.token_ids == outs[1][rid].token_ids, rid
        for la, lb in zip(c.logprobs, outs[1][rid].logprobs, strict=True):
            assert la.keys() == lb.keys()
            np.testing.assert_allclose(list(la.values()), list(lb.values()), rtol=0, atol=3e-3)
    assert captured.spec.num_accepted_tokens > 0 and shapes.count(False) > 0  # verify steps ran captured
    assert captured.runner.spec.graphs.replays > 0  # and so did the draft passes after them
    for stat in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):  # the same drafts, the same acceptance
        assert getattr(captured.spec, stat) == getattr(eager.spec, stat), stat


def test_verify_bodies_never_sync_the_host(mtp_model_dir, rng, monkeypatch):
    """Every bucket's body of a speculating engine (its verify buckets too) and its draft passes'
    body, at capture and at each captured step, run with host copies, uploads and data-dependent
    shapes raising (the Triton kernels, through the interpreter)."""
    from fastdeploy.worker.decode_graphs import DecodeGraphs
    from fastdeploy.worker.draft_graphs import DraftGraphs

    body, bodies = DecodeGraphs.body, []
    draft_body, drafts = DraftGraphs.body, []

    def guarded(self, B):
        bodies.append(B)
        with NoHostSync(uploads=True):
            return body(self, B)

    def draft_guarded(self, B, *a):
        drafts.append(B)
        with NoHostSync(uploads=True):
            return draft_body(self, B, *a)

    monkeypatch.setattr(DecodeGraphs, "body", guarded)
    monkeypatch.setattr(DraftGraphs, "body", draft_guarded)
    spec = '{"method": "mtp", "num_speculative_tokens": 3}'
    eng = LLM(
        mtp_model_dir,
        block_size=16,
        max_num_seqs=1,
        max_model_len=64,
        speculative_config=spec,
        kernel_backend="triton",
        cuda_graph_batch_sizes="1",
        cuda_graph_capture=True,
    ).engine
    assert eng.runner.graphs.buckets == (1, 4) and sorted(set(bodies)) == [1, 4]  # each warmed up, guarded
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eng.add_request([int(x) for x in rng.integers(4, 256, 20)], sp, "r")
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.outputs[0].finish_reason != "error", o.error
    assert eng.spec.num_accepted_tokens > 0 and bodies.count(4) > 1  # verify steps ran as guarded bodies
    assert sorted(set(drafts)) == [1, 4] and drafts.count(4) > 1  # the draft passes after them too


def test_captured_speculation_launches_without_waiting(mtp_model_dir, rng, monkeypatch):
    """A captured speculating step queues its draw, the acceptance of its drafts and the next
    drafts with no host sync between them (uploads allowed): the whole launch runs with host
    copies and data-dependent shapes raising; finish then takes one copy back. The step's
    outcome is checked against an eager engine elsewhere (test_captured_verify_steps_give_the_eager_tokens)."""
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    kw = dict(block_size=16, max_num_seqs=2, max_model_len=96, speculative_config=spec, kernel_backend="triton")
    eng = LLM(mtp_model_dir, cuda_graph_batch_sizes="2", cuda_graph_capture=True, **kw).engine
    launch, staged = eng.runner.launch, []

    def guarded(prep, *a):
        decoding = prep.scheduled and all(r.output_token_ids for r, _ in prep.scheduled)
        if not decoding:  # prefill chunks run eagerly
            return launch(prep, *a)
        with NoHostSync():
            running = launch(prep, *a)
        staged.append(running.proposal is not None)
        return running

    monkeypatch.setattr(eng.runner, "launch", guarded)
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
    for i in range(2):
        eng.add_request([int(x) for x in rng.integers(4, 256, 11 + 7 * i)], sp, f"r{i}")
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.outputs[0].finish_reason != "error", o.error
    assert staged and all(staged) and eng.spec.num_accepted_tokens > 0


def accept_reference(tok, ok, drafts, start, left, covered, may, k):
    """numpy: per request (drafts d, verify rows first .. first + len(d)) the rows kept (each
    while the one before matched its draft; a row not drawn or not finite ends it), then what the
    host's plan does with them: the accepted token after each row (0 past them), and the row,
    position and depth (k, the room, the blocks) of the last accepted token."""
    next_ids, out, at = np.zeros(len(tok), np.int64), [], 0
    for b, d in enumerate(drafts):
        a = 0
        for j in range(len(d) + 1):
            if not ok[at + j]:
                break
            a += 1
            if j == len(d) or tok[at + j] != d[j]:
                break
        next_ids[at : at + a] = tok[at : at + a]
        last = max(a - 1, 0)
        room = min(k, left[b] - a - 1, covered[b] - (start[b] + last))
        out.append((a, at + last, start[b] + last, max(room, 0) if a and may[b] else 0))
        at += len(d) + 1
    return next_ids, out


def test_acceptance_on_the_device_matches_the_reference(mtp_model_dir, rng):
    """The draft graph's acceptance (``DraftGraphs.accept``) against a numpy reference on random
    steps of each bucket: drafts of 0..k tokens, samples equal to their draft 60% of the time,
    rows not finite, requests that may not draft, rooms and blocks that stop the depth at 0..k;
    padding rows and requests after them."""
    spec = '{"method": "mtp", "num_speculative_tokens": 3}'
    eng = LLM(
        mtp_model_dir,
        block_size=16,
        max_num_seqs=2,
        speculative_config=spec,
        cuda_graph_batch_sizes="1,2",
        cuda_graph_capture=True,
    ).engine
    graphs, k = eng.runner.spec.graphs, 3
    for B, R in sorted(graphs.requests.items()):
        for _ in range(25):
            n, cap = int(rng.integers(1, R + 1)), min(k, B // R - 1)  # a decode bucket's rows: no drafts
            drafts = [[int(x) for x in rng.integers(0, 50, int(rng.integers(0, cap + 1)))] for _ in range(n)]
            T = sum(len(d) + 1 for d in drafts)
            wanted = np.concatenate([d + [-1] for d in drafts])
            tok = np.where(rng.random(T) < 0.6, wanted, rng.integers(0, 50, T)).astype(np.int64)
            tok[tok < 0] = rng.integers(0, 50, int((tok < 0).sum()))
            ok = rng.random(T) < 0.9
            start = [int(x) for x in rng.integers(0, 100, len(drafts))]
            left = [int(x) for x in rng.integers(0, 8, len(drafts))]
            covered = [s + int(x) for s, x in zip(start, rng.integers(0, 8, len(drafts)), strict=True)]
            may = [bool(x) for x in rng.random(len(drafts)) < 0.8]
            buf = graphs.host_buffer(B, drafts, start, left, covered, may)
            graphs.load(B, buf, paddle.to_tensor(tok), paddle.to_tensor(ok))
            ids, accepted, rows, pos, depth = (t.numpy() for t in graphs.accept(B))
            want_ids, want = accept_reference(tok, ok, drafts, start, left, covered, may, k)
            np.testing.assert_array_equal(ids[:T], want_ids)
            assert not ids[T:].any()  # padding rows read token 0
            got = list(zip(accepted, rows, pos, depth, strict=True))[: len(drafts)]
            assert [tuple(int(v) for v in g) for g in got] == want
            assert not depth[len(drafts) :].any()  # padding requests draft nothing


def test_a_chained_step_starts_where_the_acceptance_ends(mtp_model_dir, rng):
    """``DraftGraphs.chain`` (the verify step launched behind a running one, docs/design.md
    §4.18) against numpy on random acceptances: each request's rows are its bonus token (the
    sample of its last accepted row) then its drafts, 0 past its depth, at the positions after
    its accepted tokens; the drafts checked are -1 past the depth (never accepted); the draw's
    step shift is the accepted count - 1."""
    spec = '{"method": "mtp", "num_speculative_tokens": 3}'
    kw = dict(block_size=16, max_num_seqs=4, speculative_config=spec, cuda_graph_batch_sizes="1,2,4")
    graphs, k = LLM(mtp_model_dir, cuda_graph_capture=True, **kw).engine.runner.spec.graphs, 3
    for R in (1, 2, 4):
        for _ in range(10):
            T = R * (k + 1)
            tokens = rng.integers(0, 500, T)
            accepted = rng.integers(1, k + 2, R)
            depth = rng.integers(0, k + 1, R)
            drafts = rng.integers(0, 500, (R, k))
            out = np.concatenate([accepted[:, None], depth[:, None], drafts], 1).astype(np.int64)
            first, start = [b * (k + 1) for b in range(R)], [int(x) for x in rng.integers(0, 90, R)]
            got = graphs.chain(paddle.to_tensor(tokens), paddle.to_tensor(out), first, start)
            checked = np.where(np.arange(k)[None, :] < depth[:, None], drafts, -1)
            bonus = tokens[np.asarray(first) + accepted - 1]
            ids = np.concatenate([bonus[:, None], np.maximum(checked, 0)], 1).reshape(-1)
            pos = (np.asarray(start) + accepted)[:, None] + np.arange(k + 1)[None, :]
            np.testing.assert_array_equal(got.ids_pos.numpy(), np.concatenate([ids, pos.reshape(-1)]))
            column = np.concatenate([checked, np.full((R, 1), -1)], 1).reshape(-1)
            np.testing.assert_array_equal(got.draft.numpy(), column)
            np.testing.assert_array_equal(got.start.numpy(), np.asarray(start) + accepted)
            np.testing.assert_array_equal(got.shift.numpy(), np.repeat(accepted - 1, k + 1))


def test_one_copy_fills_the_step_buffer(tiny_model_dir):
    """A step's ids, positions and its tables' first w columns (w: its longest row) land in the
    step buffer; columns past w keep an earlier step's entries (nothing reads past a row's
    position), and a step's rows never shift into another's."""
    eng = LLM(tiny_model_dir, block_size=16, cuda_graph_batch_sizes="2", cuda_graph_capture=True).engine
    graphs = eng.runner.graphs
    groups, W = list(graphs.null_block), graphs.width
    graphs.staging[:] = -7
    graphs.fill(graphs.host_buffer([11, 12], [40, 3], {g: [[1, 2, 3, 4], [5]] for g in groups}), 2)
    graphs.fill(graphs.host_buffer([13, 14], [5, 17], {g: [[21], [22, 23]] for g in groups}), 2)
    buf = graphs.staging.numpy()
    assert buf[:4].tolist() == [13, 14, 5, 17]
    for i in range(len(groups)):
        table = buf[4 + i * 2 * W : 4 + (i + 1) * 2 * W].reshape(2, W)
        assert table[:, :2].tolist() == [[21, -1], [22, 23]]  # this step's, -1 padded to its longest row
        assert table[:, 2:4].tolist() == [[3, 4], [-1, -1]] and (table[:, 4:] == -7).all()  # earlier steps'


def test_rows_reaching_a_max_model_len_off_the_block_grid_stay_captured(tiny_model_dir, rng):
    """max_model_len 200 over 16-token blocks: a row at the last positions holds 13 blocks (the
    13th partly usable). Every pure-decode step, up to the row that reaches 200 tokens, runs
    captured, with the eager engine's tokens."""
    kw = dict(block_size=16, max_num_seqs=4, max_model_len=200)
    eng = LLM(tiny_model_dir, cuda_graph_batch_sizes="2", cuda_graph_capture=True, **kw).engine
    plain = LLM(tiny_model_dir, cuda_graph_batch_sizes="", **kw).engine
    prompts = [[int(x) for x in rng.integers(2, 500, n)] for n in (170, 176)]
    outs, decodes = [], []
    prepare = eng.runner.prepare

    def counted(scheduled):
        prep = prepare(scheduled)
        decodes.append(prep.step.is_decode)
        return prep

    eng.runner.prepare = counted
    for e in (eng, plain):
        for i, p in enumerate(prompts):
            e.add_request(p, SamplingParams(max_tokens=200 - len(p), temperature=0.0, ignore_eos=True), f"r{i}")
        done = {}
        while e.has_unfinished_requests():
            done.update({o.request_id: (o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in e.step()})
        outs.append(done)
    assert outs[0] == outs[1]
    assert [len(p) + len(outs[0][f"r{i}"][0]) for i, p in enumerate(prompts)] == [200, 200]
    assert sum(decodes) > 0 and eng.runner.graphs.replays == sum(decodes)
    graphs = eng.runner.graphs  # 13 blocks a row fit the bucket's tables; 14 do not
    step = StepInputs(
        [5, 6], [0, 0], [3, 199], {g: [[1], list(range(13))] for g in graphs.null_block}, [0, 1], [[0], [1]]
    )
    assert graphs.takes(step)
    assert not graphs.takes(replace(step, block_tables={g: [[1], list(range(14))] for g in graphs.null_block}))


def test_each_bucket_is_logged_with_what_capture_did(tiny_model_dir, caplog):
    """Start-up logs one line a bucket: its size, prepared (no CUDA here) or captured, the seconds
    it took and the device memory it holds (none without CUDA)."""
    with caplog.at_level("INFO", logger="fastdeploy"):
        LLM(tiny_model_dir, block_size=16, cuda_graph_batch_sizes="1,2", cuda_graph_capture=True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode bucket")]
    pattern = r"decode bucket (\d+) prepared \(no CUDA: re-run at each step\) in (\d+\.\d\d) s \(0\.0 MiB\)"
    found = [re.fullmatch(pattern, line) for line in lines]
    assert all(found) and sorted(int(m.group(1)) for m in found) == [1, 2], lines
    assert all(0 <= float(m.group(2)) < 600 for m in found)
