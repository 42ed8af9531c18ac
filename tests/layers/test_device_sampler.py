"""The device sampler (``layers/device_sampler.py``, the Triton kernels through the interpreter and
its paddle path) held to the numpy sampler, through what a request gets back (token, logprob,
top logprobs), for the settings both take: min_tokens at N - 1 / N / N + 1, logprobs 0 / 1 / 20,
penalties on a slot whose request's output shrank (rejected drafts, preemption) and on slots
taken by requests outside the step. Greedy rows, so the reference's token is exact."""

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers.device_sampler import DeviceSampler
from fastdeploy.model_executor.layers.sampler import sample_one
from fastdeploy.request import Request, sampling_batch
from fastdeploy.sampling_params import SamplingParams

V = 64


def request(rid: str, prompt: list[int], output: list[int], eos: tuple[int, ...] = (), **sp) -> Request:
    req = Request(rid, prompt, SamplingParams(**{"temperature": 0.0, "max_tokens": 50, **sp}), eos_token_ids=list(eos))
    req.output_token_ids = list(output)
    return req


def check(sampler: DeviceSampler, logits: np.ndarray, reqs: list[Request], pending=None) -> list[int]:
    """Sample logits float32 [B, V] for reqs; each row's token, logprob and top logprobs equal
    the numpy sampler's over the same history (output plus ``pending``). Returns the tokens."""
    got = sampler.sample(paddle.to_tensor(logits), sampling_batch(reqs, pending))
    tokens = []
    for b, (req, res) in enumerate(zip(reqs, got, strict=True)):
        out = req.output_token_ids + (list(pending[b]) if pending else [])
        want = sample_one(logits[b].astype(np.float64), req.sampling_state, req.prompt_token_ids, out)
        assert not isinstance(res, Exception), res
        assert res.token_id == want.token_id, (req.request_id, res.token_id, want.token_id)
        assert res.logprob == pytest.approx(want.logprob, abs=1e-5)
        if want.top_logprobs is None:
            assert res.top_logprobs is None
        else:
            assert res.top_logprobs.keys() == want.top_logprobs.keys(), req.request_id
            for t, lp in want.top_logprobs.items():
                assert res.top_logprobs[t] == pytest.approx(lp, abs=1e-5)
        tokens.append(res.token_id)
    return tokens


@pytest.mark.parametrize("triton", [True, False])
def test_min_tokens_blocks_the_stop_ids_until_exactly_n_tokens(rng, triton):
    """EOS (5) and a stop id (9) lead the logits; min_tokens 4: with 3 output tokens both are
    blocked, with 4 and 5 they are drawn again."""
    N = 4
    logits = rng.standard_normal((3, V)).astype(np.float32)
    logits[:, 5], logits[:, 9] = 8.0, 7.0
    reqs = [
        request(f"n{n}", [1, 2, 3], [20 + i for i in range(n)], eos=(5,), min_tokens=N, stop_token_ids=[9])
        for n in (N - 1, N, N + 1)
    ]
    tokens = check(DeviceSampler(V, 4, triton), logits, reqs)
    assert tokens[0] not in (5, 9) and tokens[1:] == [5, 5]


@pytest.mark.parametrize("triton", [True, False])
def test_logprobs_0_1_and_20_give_that_many_alternatives(rng, triton):
    """The drawn token (pushed up by a logit bias) is not the model's most likely one, so each
    row's top logprobs are its N most likely raw tokens plus the drawn one."""
    logits = rng.standard_normal((4, V)).astype(np.float32)
    reqs = []
    for b, n in enumerate((0, 1, 20, None)):
        low = int(np.argmin(logits[b]))
        reqs.append(request(f"lp{n}", [1], [], logprobs=n, logit_bias={low: 100.0}))
    check(DeviceSampler(V, 4, triton), logits, reqs)
    sizes = [
        len(r.top_logprobs or {})
        for r in DeviceSampler(V, 4, triton).sample(paddle.to_tensor(logits), sampling_batch(reqs))
    ]
    assert sizes == [1, 2, 21, 0]


@pytest.mark.parametrize("triton", [True, False])
def test_penalties_follow_an_output_that_shrank(rng, triton):
    """A penalized request verifies two drafts (``pending``), which then do not stay in its
    output; later it is preempted and its output cleared. Each step's counts are of the output
    it has then: the token of a rejected draft, the most likely one by a margin, is not
    penalized."""
    sampler = DeviceSampler(V, 2, triton)
    req = request("p", [1, 2], [30, 31], presence_penalty=2.0, frequency_penalty=0.5, repetition_penalty=1.3)
    logits = rng.standard_normal((1, V)).astype(np.float32)
    check(sampler, logits, [req], pending=[[40, 41]])  # 30, 31, 40, 41 counted, then the draw
    logits = rng.standard_normal((1, V)).astype(np.float32)
    logits[0, 40] = logits.max() + 1.0  # a rejected draft's token leads
    assert check(sampler, logits, [req]) == [40]
    req.output_token_ids.append(40)
    for _ in range(2):
        logits = rng.standard_normal((1, V)).astype(np.float32)
        req.output_token_ids.append(check(sampler, logits, [req])[0])
    req.output_token_ids = []  # preempted: recomputed from its prompt
    logits = rng.standard_normal((1, V)).astype(np.float32)
    logits[0, 30] = logits.max() + 1.0
    assert check(sampler, logits, [req]) == [30]


@pytest.mark.parametrize("triton", [True, False])
def test_slots_of_requests_outside_the_step_are_taken_over(rng, triton):
    """Two slots, both held by requests that are not in the next step: that step's penalized
    request takes one over, and the evicted request gets its counts rebuilt when it returns."""
    sampler = DeviceSampler(V, 2, triton)
    pen = dict(presence_penalty=1.5, repetition_penalty=1.2)
    a, b, c = (request(r, rng.integers(0, V, 5).tolist(), rng.integers(0, V, 6).tolist(), **pen) for r in "abc")
    for reqs in ([a, b], [c], [a, c], [b]):
        logits = (rng.standard_normal((len(reqs), V)) * 2).astype(np.float32)
        for r, t in zip(reqs, check(sampler, logits, reqs), strict=True):
            r.output_token_ids.append(t)


@pytest.mark.parametrize("triton", [True, False])
def test_top_k_above_the_vocabulary_is_the_whole_vocabulary(rng, triton):
    logits = rng.standard_normal((4, V)).astype(np.float32)
    reqs = [request(f"k{k}", [1], [], temperature=1.0, seed=11, top_k=k) for k in (-1, 2**63 - 1, 2**63, 10**30)]
    tokens = [
        r.token_id for r in DeviceSampler(V, 4, triton).sample(paddle.to_tensor(logits[[0] * 4]), sampling_batch(reqs))
    ]
    assert len(set(tokens)) == 1


def near_ties(rng, rows: int) -> np.ndarray:
    """float32 [rows, V] logits whose top 8 tokens lie within 0.4 of each other, so a penalty of a
    count or two reorders them (random logits rarely let a penalty change the drawn token)."""
    logits = rng.standard_normal((rows, V)).astype(np.float32)
    for r in range(rows):
        top = rng.choice(V, 8, replace=False)
        logits[r, top] = 3.0 + rng.uniform(0, 0.4, 8)
    return logits


@pytest.mark.parametrize("triton", [True, False])
def test_penalty_counts_grow_with_each_drawn_token(rng, triton):
    """Twelve decode steps of two penalized requests (slots 0 and 1) beside an unpenalized one:
    each step's token equals the numpy sampler's over the output so far, so the counts the
    sampler adds on the device after every draw are the output's counts."""
    sampler = DeviceSampler(V, 2, triton)
    pen = dict(presence_penalty=0.05, frequency_penalty=0.1, repetition_penalty=1.02)
    reqs = [request("a", [1, 2, 3], [], **pen), request("free", [4], []), request("b", [5, 6], [7, 7], **pen)]
    base, drawn = near_ties(rng, 3), []  # the same near-tied tokens compete at every step
    for _ in range(12):
        tokens = check(sampler, base + 0.01 * rng.standard_normal(base.shape).astype(np.float32), reqs)
        for r, t in zip(reqs, tokens, strict=True):
            r.output_token_ids.append(t)
        drawn.append(tokens)
    assert len({t[0] for t in drawn}) > 3  # the penalties spread the draws over the near-tied tokens


@pytest.mark.parametrize("triton", [True, False])
def test_seeded_draws_do_not_depend_on_how_the_counts_were_built(rng, triton):
    """Sampled (temperature 1), penalized and seeded: a sampler that followed the request from
    its first token (counts added on the device step by step) and a fresh one that meets it at
    step k (counts rebuilt from the output) draw the same token at every step."""
    follow = DeviceSampler(V, 2, triton)
    pen = dict(temperature=1.0, seed=77, presence_penalty=0.1, frequency_penalty=0.3, repetition_penalty=1.1)
    req = request("s", [3, 4, 5], [], **pen)
    base = near_ties(rng, 1)
    for _ in range(10):
        logits = base + 0.01 * rng.standard_normal(base.shape).astype(np.float32)
        (a,) = follow.sample(paddle.to_tensor(logits), sampling_batch([req]))
        (b,) = DeviceSampler(V, 2, triton).sample(paddle.to_tensor(logits), sampling_batch([req]))
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-6)
        req.output_token_ids.append(a.token_id)


@pytest.mark.parametrize("triton", [True, False])
def test_pending_drafts_count_before_the_draw(rng, triton):
    """A verification row with two accepted drafts of the leading token: it is penalized as if
    they were in the output (the numpy sampler over output + pending draws another token)."""
    logits = near_ties(rng, 1)
    lead = int(np.argmax(logits[0]))
    req = request("v", [1], [], presence_penalty=1.0, frequency_penalty=1.0)
    (tok,) = check(DeviceSampler(V, 2, triton), logits, [req], pending=[[lead, lead]])
    assert tok != lead


@pytest.mark.parametrize("triton", [True, False])
def test_min_tokens_keeps_the_logit_bias(rng, triton):
    """While min_tokens blocks the stop ids, the request's own logit bias still applies."""
    logits = rng.standard_normal((1, V)).astype(np.float32)
    low = int(np.argmin(logits[0]))
    req = request("m", [1], [], eos=(5,), min_tokens=3, logit_bias={low: 50.0})
    assert check(DeviceSampler(V, 2, triton), logits, [req]) == [low]


@pytest.mark.parametrize("triton", [True, False])
def test_a_row_with_non_finite_logits_fails_alone(rng, triton):
    logits = rng.standard_normal((3, V)).astype(np.float32)
    logits[1, 7] = np.nan
    reqs = [request(f"r{i}", [1], []) for i in range(3)]
    got = DeviceSampler(V, 2, triton).sample(paddle.to_tensor(logits), sampling_batch(reqs))
    assert len(got) == 3 and isinstance(got[1], ValueError)
    assert str(got[1]) == "the model's logits for this request are not finite"
    assert [got[0].token_id, got[2].token_id] == [int(np.argmax(logits[0])), int(np.argmax(logits[2]))]
