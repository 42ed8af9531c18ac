import numpy as np
import pytest

from fastdeploy.model_executor.layers.sampler import SamplingState, adjusted_logits, sample, top_p_mask
from fastdeploy.sampling_params import SamplingParams


def test_greedy_and_logprobs(rng):
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    res = sample(logits, [SamplingState(temperature=0.0, logprobs=3)] * 3)
    for row, r in zip(logits.astype(np.float64), res, strict=True):
        assert r.token_id == int(np.argmax(row))
        logp = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        assert r.logprob == pytest.approx(logp[r.token_id])
        assert len(r.top_logprobs) == 3 and r.token_id in r.top_logprobs
        assert sorted(r.top_logprobs.values(), reverse=True)[0] == pytest.approx(logp.max())


def test_chosen_token_always_in_logprobs(rng):
    logits = np.zeros((1, 10), np.float32)
    logits[0, 3] = 5
    r = sample(logits, [SamplingState(temperature=100.0, logprobs=1, rng=np.random.default_rng(1))] * 1)[0]
    assert r.token_id in r.top_logprobs


def test_seed_reproduces_and_top_k_top_p_restrict(rng):
    logits = rng.standard_normal((1, 100)).astype(np.float32) * 3

    def draw(seed, **kw):
        st = SamplingState(rng=np.random.default_rng(seed), **kw)
        return [sample(logits, [st])[0].token_id for _ in range(200)]

    assert draw(5) == draw(5) and draw(5) != draw(6)
    top5 = set(np.argsort(-logits[0])[:5].tolist())
    assert set(draw(1, top_k=5)) <= top5
    p = np.exp(logits[0] - logits[0].max())
    p /= p.sum()
    order = np.argsort(-p)
    nucleus = set(order[: int(np.searchsorted(np.cumsum(p[order]), 0.5)) + 1].tolist())
    assert set(draw(2, top_p=0.5)) <= nucleus
    assert len(set(draw(3, temperature=1.0))) > len(nucleus)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_sampling_params_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)
    assert SamplingParams(stop="x").stop == ["x"]


def test_top_p_keeps_exactly_the_smallest_set_reaching_it():
    p = np.array([0.05, 0.5, 0.15, 0.3])  # order by mass: 1, 3, 2, 0
    for top_p, want in ((0.5, {1}), (0.8, {1, 3}), (0.81, {1, 3, 2}), (0.96, {0, 1, 2, 3}), (1e-9, {1})):
        assert set(np.nonzero(top_p_mask(p, top_p))[0].tolist()) == want, top_p
    tied = np.array([0.25, 0.25, 0.25, 0.25])
    assert np.nonzero(top_p_mask(tied, 0.5))[0].tolist() == [0, 1]  # ties by token id
    # sampled: exactly the nucleus shows up over many draws, nothing outside it
    logits = np.log(np.array([[0.05, 0.5, 0.15, 0.3]], np.float32))
    st = SamplingState(top_p=0.8, rng=np.random.default_rng(0))
    assert {sample(logits, [st])[0].token_id for _ in range(400)} == {1, 3}


def test_tiny_temperature_is_greedy_and_bad_logits_fail_only_their_row(rng):
    logits = rng.standard_normal((3, 64)).astype(np.float32)
    logits[1, 5] = np.nan
    states = [SamplingState(temperature=t, rng=np.random.default_rng(1)) for t in (1e-310, 1.0, 1e-6)]
    res = sample(logits, states)
    assert res[0].token_id == int(np.argmax(logits[0])) and res[2].token_id == int(np.argmax(logits[2]))
    assert isinstance(res[1], ValueError) and "not finite" in str(res[1])


def test_penalties_bias_and_min_tokens_against_the_formulas(rng):
    row = rng.standard_normal(20) * 3
    prompt, output = [1, 2, 2], [2, 3, 3, 3]
    st = SamplingState(
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.3,
        logit_bias={7: 2.0, 3: -1.0},
        min_tokens=5,
        min_tokens_stop_ids=(9, 11),
    )
    want = row.copy()
    for t in {1, 2, 3}:  # repetition over prompt and output (HF / vLLM): divide positives, multiply negatives
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t, c in ((2, 1), (3, 3)):  # OpenAI: presence once, frequency per occurrence, output only
        want[t] -= 0.5 + 0.25 * c
    want[7] += 2.0
    want[3] -= 1.0
    want[[9, 11]] = -np.inf  # 4 tokens out, min_tokens 5: stop tokens banned
    np.testing.assert_allclose(adjusted_logits(row, st, prompt, output), want, rtol=0, atol=1e-12)
    assert np.isfinite(adjusted_logits(row, st, prompt, output + [0])[[9, 11]]).all()  # 5 out: allowed again
    forced = SamplingState(temperature=0.0, logit_bias={13: 100.0})
    assert sample(row[None].astype(np.float32), [forced])[0].token_id == 13


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"max_tokens": True}, "max_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": [-2]}, "stop_token_ids"),
    ],
)
def test_new_sampling_params_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kw)


def test_accepted_extremes_never_make_nan(rng):
    """The numpy reference under repetition_penalty 5e-324 (a seen positive logit overflows): a
    token, never 'Probabilities contain NaN'."""
    logits = rng.standard_normal((3, 40)).astype(np.float32)
    for temp in (0.7, 0.001, 0.0):
        st = SamplingState(temperature=temp, repetition_penalty=5e-324, rng=np.random.default_rng(0), top_p=0.9)
        res = sample(logits, [st] * 3, [([1, 2, 3], [4, 5])] * 3)
        assert all(not isinstance(r, Exception) and 0 <= r.token_id < 40 for r in res), res
