import numpy as np
import pytest

from fastdeploy.model_executor.layers.sampler import SamplingState, sample
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
