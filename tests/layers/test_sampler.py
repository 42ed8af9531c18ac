import numpy as np
import pytest

from fastdeploy.model_executor.layers.sampler import (
    SAMPLING_EPS,
    SamplingState,
    adjusted_logits,
    kept_mask,
    sample,
    sample_one,
    top_p_mask,
)
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


def kept_by_definition(z: np.ndarray, temperature: float, min_p: float, top_k: int, top_p: float) -> np.ndarray:
    """The tokens a draw may pick, from each filter's definition in turn, token by token: min-p
    keeps p >= min_p * max p; top-k keeps whatever is at least the k-th largest kept logit (ties
    kept); top-p keeps, of the rest renormalized, the most likely tokens (ties by token id) until
    their mass reaches top_p."""
    y = z / temperature
    p = np.exp(y - y.max())
    p /= p.sum()
    keep = [True] * len(y)
    if min_p > 0:
        keep = [k and p[t] >= min_p * p.max() for t, k in enumerate(keep)]
    kept = sorted((y[t] for t in range(len(y)) if keep[t]), reverse=True)
    if 0 < top_k < len(kept):
        keep = [k and y[t] >= kept[top_k - 1] for t, k in enumerate(keep)]
    if top_p < 1.0:
        q = np.array([np.exp(y[t] - y.max()) if keep[t] else 0.0 for t in range(len(y))])
        q /= q.sum()
        chosen, mass = set(), 0.0
        for t in sorted(range(len(y)), key=lambda t: (-q[t], t)):
            if mass >= top_p:
                break
            chosen.add(t)
            mass += q[t]
        keep = [k and t in chosen for t, k in enumerate(keep)]
    return np.array(keep)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("top_k", [-1, 1, 3, 40])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 1.0])
def test_kept_tokens_follow_each_filters_definition(rng, temperature, min_p, top_k, top_p):
    z = rng.standard_normal(40) * 2
    z[[3, 17]] = z.max() + 0.1  # a tie at the top
    y, keep = kept_mask(z, SamplingState(temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p))
    np.testing.assert_allclose(y, z / temperature, rtol=1e-15)
    want = kept_by_definition(z, temperature, min_p, top_k, top_p)
    assert keep.tolist() == want.tolist()
    assert keep[3]  # the arg-max (of a tie, the lowest id) is always kept


def test_a_draw_is_from_the_kept_tokens_renormalized(rng):
    """A seeded draw picks the token the same generator picks from the kept tokens' softmax of
    z / temperature (the distribution, not only its support)."""
    z = rng.standard_normal(30) * 2
    for seed in range(20):
        st = SamplingState(temperature=0.7, top_k=8, top_p=0.9, rng=np.random.default_rng(seed))
        keep = kept_by_definition(z, 0.7, 0.0, 8, 0.9)
        q = np.where(keep, np.exp((z - z.max()) / 0.7), 0.0)
        want = int(np.random.default_rng(seed).choice(30, p=q / q.sum()))
        assert sample_one(z, st, [], []).token_id == want


def test_without_a_generator_a_request_still_draws(rng):
    z = rng.standard_normal(30)
    res = sample(z[None].astype(np.float32), [SamplingState(temperature=1.0, top_k=5)])[0]
    assert res.token_id in set(np.argsort(-z)[:5].tolist())


def test_temperature_at_the_greedy_threshold_samples():
    """Below SAMPLING_EPS is greedy; at it a row samples: two tied leaders are both drawn."""
    z = np.zeros(20)
    z[[4, 9]] = 5.0
    at = {
        sample_one(z, SamplingState(temperature=SAMPLING_EPS, rng=np.random.default_rng(s)), [], []).token_id
        for s in range(30)
    }
    below = {
        sample_one(z, SamplingState(temperature=SAMPLING_EPS / 2, rng=np.random.default_rng(s)), [], []).token_id
        for s in range(30)
    }
    assert at == {4, 9} and below == {4}


def test_each_penalty_alone_and_a_repetition_penalty_of_two():
    row = np.linspace(-2.0, 2.0, 12)
    prompt, output = [1], [10, 10, 4]
    cases = [
        (dict(presence_penalty=0.7), {10: row[10] - 0.7, 4: row[4] - 0.7}),
        (dict(frequency_penalty=0.4), {10: row[10] - 0.8, 4: row[4] - 0.4}),
        (dict(repetition_penalty=2.0), {1: row[1] * 2.0, 10: row[10] / 2.0, 4: row[4] * 2.0}),  # 1, 4 negative
    ]
    for kw, changed in cases:
        want = row.copy()
        for t, v in changed.items():
            want[t] = v
        np.testing.assert_allclose(adjusted_logits(row, SamplingState(**kw), prompt, output), want, rtol=0, atol=1e-12)
    no_history = sample(row[None].astype(np.float32), [SamplingState(temperature=0.0, repetition_penalty=1.5)])
    assert no_history[0].token_id == 11  # nothing seen: nothing penalized


def test_ties_are_broken_by_token_id(rng):
    """Top logprobs and top-p's nucleus, over a row of 64 tokens in tied groups: the lower token
    ids of a tie come first (numpy's default sort is not stable at this size)."""
    z = np.repeat(rng.permutation(8).astype(np.float64), 8)[rng.permutation(64)]
    res = sample_one(z, SamplingState(temperature=0.0, logprobs=11), [], [])
    top = np.flatnonzero(z == z.max()).tolist() + np.flatnonzero(z == np.sort(np.unique(z))[-2]).tolist()[:3]
    assert set(res.top_logprobs) == set(top)
    p = np.exp(z - z.max())
    p /= p.sum()
    leaders = np.flatnonzero(z == z.max())
    mask = top_p_mask(p, p[leaders[0]] * 2.5)  # two and a half of the 8 leaders' mass: 3 of them
    assert np.flatnonzero(mask).tolist() == leaders[:3].tolist()


def test_non_finite_logits_error_message(rng):
    z = rng.standard_normal(10)
    z[2] = np.inf
    with pytest.raises(ValueError, match="^the model's logits for this request are not finite$"):
        sample_one(z, SamplingState(), [], [])


def test_top_k_over_a_real_vocabulary_and_top_p_of_one(rng):
    """top-k of a 4096-token row keeps exactly the k largest (a small row sorts itself while
    numpy partitions it, a large one does not); top_p 1.0 keeps every token, those whose mass is
    below the float64 rounding of the running sum included."""
    z = rng.standard_normal(4096) * 2
    for k in (1, 5, 50):
        _, keep = kept_mask(z, SamplingState(top_k=k))
        assert keep.tolist() == kept_by_definition(z, 1.0, 0.0, k, 1.0).tolist()
        assert keep.sum() == k
    wide = np.full(64, -80.0)
    wide[[5, 9]] = 0.0  # p: 0.5, 0.5 and 62 tokens of e^-80: the cumulative mass is 1.0 after two
    _, keep = kept_mask(wide, SamplingState(top_p=1.0))
    assert keep.all()
