"""The device sampler op (Triton through the interpreter, and its paddle path) against float64
numpy: the kept set (numpy sampler's ``kept_mask``), the Gumbel draw over it with noise from an
independent implementation of the documented hash, raw logprobs, and draw distributions."""

import numpy as np
import paddle
import pytest
from ref import gumbel_noise_ref

from fastdeploy.model_executor.layers.sampler import adjusted_logits, kept_mask
from fastdeploy.model_executor.ops.triton_ops.sampling import row_keys, sample_tokens
from fastdeploy.sampling_params import SamplingState

M32 = 0xFFFFFFFF


class Batch:
    """Random rows with every sampling feature, as the op's arrays and as SamplingStates."""

    def __init__(self, rng, states, vocab, slots=3):
        self.B, self.V = len(states), vocab
        self.states = states
        self.logits = (rng.standard_normal((self.B, vocab)) * 2.5).astype(np.float32)
        self.prompts = [rng.integers(0, vocab, 6).tolist() for _ in states]
        self.outputs = [rng.integers(0, vocab, 5).tolist() for _ in states]
        self.counts = np.zeros((slots, vocab), np.int32)
        self.seen = np.zeros((slots, vocab), np.uint8)
        f = np.zeros((self.B, 8), np.float32)
        i = np.zeros((self.B, 4), np.int32)
        nb = max(1, max(len(st.logit_bias) + len(st.min_tokens_stop_ids) for st in states))
        bias_ids, bias_vals = np.full((self.B, nb), -1, np.int32), np.zeros((self.B, nb), np.float32)
        nslot = 0
        for b, st in enumerate(states):
            f[b, :6] = (
                st.temperature,
                st.top_p,
                st.min_p,
                st.repetition_penalty,
                st.presence_penalty,
                st.frequency_penalty,
            )
            i[b, 0] = st.top_k
            i[b, 1] = -1
            if st.repetition_penalty != 1 or st.presence_penalty or st.frequency_penalty:
                i[b, 1] = nslot
                np.add.at(self.counts[nslot], self.outputs[b], 1)
                self.seen[nslot, self.prompts[b]] = 1
                nslot += 1
            bias = list(st.logit_bias.items())
            if len(self.outputs[b]) < st.min_tokens:
                bias += [(t, -np.inf) for t in st.min_tokens_stop_ids]
            i[b, 2] = len(bias)
            for j, (t, v) in enumerate(bias):
                bias_ids[b, j], bias_vals[b, j] = t, v
        self.f, self.i, self.bias_ids, self.bias_vals = f, i, bias_ids, bias_vals
        self.keys = row_keys(rng.integers(0, 2**63, self.B, dtype=np.uint64), rng.integers(0, 1000, self.B))

    def run(self, triton, logits=None, kmax=4096, block=2048):
        t = paddle.to_tensor
        out = sample_tokens(
            t(self.logits if logits is None else logits),
            t(self.counts),
            t(self.seen),
            t(self.f),
            t(self.i),
            t(self.keys),
            t(self.bias_ids),
            t(self.bias_vals),
            triton=triton,
            kmax=kmax,
            block=block,
        )
        return out.tokens.numpy(), out.logprobs.numpy(), out.lse.numpy(), out.bad.numpy()

    def want(self, b):
        """float64: the row's token under the same noise, and its raw logprob."""
        st, row = self.states[b], self.logits[b].astype(np.float64)
        out = self.outputs[b] if self.i[b, 1] >= 0 else []
        prompt = self.prompts[b] if self.i[b, 1] >= 0 else []
        z = adjusted_logits(row, st, prompt, out)
        if st.temperature < 1e-5:
            tok = int(np.argmax(z))
        else:
            y, keep = kept_mask(z, st)
            tok = int(np.argmax(np.where(keep, y + gumbel_noise_ref(self.keys[b], self.V), -np.inf)))
        logp = row - row.max() - np.log(np.exp(row - row.max()).sum())
        return tok, logp[tok]


def mixed_states(vocab):
    S = SamplingState
    return [
        S(temperature=0.0),
        S(temperature=0.7, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.2),
        S(temperature=1.0, top_p=0.5, top_k=20, min_p=0.1),
        S(temperature=1.3, top_k=5, logit_bias={10: 5.0, 11: -3.0}),
        S(temperature=0.5, top_p=0.95, repetition_penalty=0.8, min_tokens=8, min_tokens_stop_ids=(1, 2)),
        S(temperature=1.0, min_p=0.02),
        S(temperature=1.0),
        S(temperature=0.0, presence_penalty=1.5, logit_bias={vocab - 1: 100.0}),
        S(temperature=2.0, top_k=1),
        S(temperature=1e-6, top_p=0.3),
    ]


@pytest.mark.parametrize(
    "triton, kmax, block", [(True, 4096, 2048), (True, 4096, 128), (True, 8, 128), (False, 4096, 0)]
)
def test_tokens_and_logprobs_match_float64(rng, triton, kmax, block):
    """kmax 8 sends most rows through the uncompacted path (the whole row), 4096 compacts;
    block 128 splits each 700-token row into 6 chunks (partials merged), 2048 keeps it whole."""
    batch = Batch(rng, mixed_states(700), 700)
    for _ in range(3):
        batch.keys = row_keys(rng.integers(0, 2**63, batch.B, dtype=np.uint64), rng.integers(0, 9, batch.B))
        tokens, logprobs, lse, bad = batch.run(triton, kmax=kmax, block=block or 2048)
        for b in range(batch.B):
            tok, lp = batch.want(b)
            assert tokens[b] == tok, (b, batch.states[b])
            assert logprobs[b] == pytest.approx(lp, abs=1e-5)
        assert not bad.any()
        row = batch.logits.astype(np.float64)
        np.testing.assert_allclose(lse, np.log(np.exp(row).sum(1)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("triton", [True, False])
def test_a_key_draws_the_same_token_in_any_batch(rng, triton):
    """Also across chunkings: a batch of 5 splits 300-token rows into 3 chunks of 128, a batch of
    one into 3 as well but with other partial sums; the draw does not move."""
    batch = Batch(rng, [SamplingState(temperature=1.0, top_p=0.9)] * 5, 300)
    tokens = batch.run(triton, block=128)[0]
    for b in range(5):
        one = Batch(np.random.default_rng(0), [SamplingState(temperature=1.0, top_p=0.9)], 300)
        one.logits, one.keys = batch.logits[b : b + 1], batch.keys[b : b + 1]
        assert one.run(triton, block=2048)[0][0] == tokens[b]


@pytest.mark.parametrize("triton", [True, False])
@pytest.mark.parametrize("top_p, kept", [(0.5, 2), (0.3, 2), (0.6, 3), (0.8, 4)])
def test_top_p_ties_keep_the_lowest_ids(triton, top_p, kept):
    """Four equal tokens (a quarter of the mass each): top_p keeps the fewest of them, lowest ids
    first, whose mass reaches it, the numpy sampler's set; 0.3 and 0.6 land between two counts
    (1.2 and 2.4 tokens' worth: 2 and 3 kept), 0.5 on one."""
    n = 80
    logits = np.zeros((n, 6), np.float32)
    logits[:, 4:] = -50
    st = SamplingState(temperature=1.0, top_p=top_p)
    assert kept_mask(logits[0].astype(np.float64), st)[1].tolist() == [True] * kept + [False] * (6 - kept)
    batch = Batch(np.random.default_rng(1), [st] * n, 6)
    tokens = batch.run(triton, logits=logits)[0]
    assert set(tokens.tolist()) == set(range(kept))


def test_draws_follow_the_reference_distribution(rng):
    """Chi-square over many keys on a small vocabulary: draws against the numpy sampler's
    processed probabilities (temperature, min-p, top-k, top-p); df = kept - 1. The paddle path
    only (the interpreter takes ~0.1 s a row): the Triton kernels draw the same token as the
    float64 reference for every key in the tests above, so they share this distribution."""
    triton, vocab, n = False, 12, 3000
    st = SamplingState(temperature=0.8, top_k=9, top_p=0.97, min_p=0.01)
    row = rng.standard_normal(vocab) * 1.5
    batch = Batch(rng, [st] * n, vocab)
    logits = np.repeat(row[None].astype(np.float32), n, 0)
    tokens = batch.run(triton, logits=logits)[0]
    y, keep = kept_mask(logits[0].astype(np.float64), st)
    p = np.where(keep, np.exp(y - y.max()), 0)
    p /= p.sum()
    seen = np.bincount(tokens, minlength=vocab)
    assert seen[~keep].sum() == 0
    chi2 = (((seen - n * p) ** 2)[keep] / (n * p[keep])).sum()
    assert chi2 < 26.1, (chi2, keep.sum())  # chi2(df <= 8) exceeds 26.1 with probability 0.001


@pytest.mark.parametrize("triton", [True, False])
def test_a_row_that_is_not_finite_is_flagged_alone(rng, triton):
    batch = Batch(rng, [SamplingState(temperature=0.0)] * 3, 64)
    logits = batch.logits.copy()
    logits[1, 7] = np.nan
    logits[2, 3] = np.inf
    tokens, _, _, bad = batch.run(triton, logits=logits, block=16)
    assert bad.tolist() == [False, True, True]
    assert tokens[0] == int(np.argmax(logits[0]))


@pytest.mark.parametrize("triton", [True, False])
def test_extreme_accepted_values_never_make_nan(rng, triton):
    """repetition_penalty 5e-324 / 1e-310 / 1e-305 (0 in float32: a seen positive logit / 0 is
    inf) with tiny and large temperatures, every penalty and bias at its bound: a valid token and
    a finite logprob for every row, never NaN; greedy rows pick an overflowed token (a seen
    token with a positive logit), where the float64 reference puts them too."""
    S = SamplingState
    states = [
        S(temperature=0.7, repetition_penalty=5e-324),
        S(temperature=0.001, repetition_penalty=1e-305, top_p=0.5),
        S(temperature=0.0, repetition_penalty=1e-310),
        S(temperature=2.0, repetition_penalty=10.0, presence_penalty=-2, frequency_penalty=-2, top_k=3, min_p=1.0),
        S(temperature=1e-5, presence_penalty=2, frequency_penalty=2, logit_bias={0: 100.0, 1: -100.0}),
    ]
    batch = Batch(rng, states, 256, slots=5)
    tokens, logprobs, _, bad = batch.run(triton, block=64)
    assert not bad.any() and np.isfinite(logprobs).all()
    assert ((tokens >= 0) & (tokens < 256)).all()
    row, seen = batch.logits[2], set(batch.prompts[2] + batch.outputs[2])
    assert tokens[2] in seen and row[tokens[2]] > 0
    z = adjusted_logits(row.astype(np.float64), states[2], batch.prompts[2], batch.outputs[2])
    assert np.isfinite(z).all() and row[int(np.argmax(z))] > 0 and int(np.argmax(z)) in seen


@pytest.mark.parametrize("triton", [True, False])
def test_any_accepted_sampling_values_give_a_valid_token(triton):
    """Hypothesis over every sampling field's whole accepted range (SamplingParams' bounds, the
    subnormal repetition penalties and extremes together; subnormals are given as values since
    paddle's flush-to-zero stops Hypothesis drawing them): a valid token, a finite logprob, no row flagged; and
    where the values are moderate, the float64 reference's token under the same noise."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    floats = lambda lo, hi: st.floats(lo, hi, allow_nan=False, allow_subnormal=False)  # noqa: E731
    state = st.builds(
        SamplingState,
        temperature=st.one_of(st.just(0.0), floats(0.0, 2.0)),
        top_p=floats(1e-300, 1.0).filter(lambda x: x > 0),
        top_k=st.one_of(st.just(-1), st.integers(1, 80)),
        min_p=floats(0.0, 1.0),
        repetition_penalty=st.one_of(st.sampled_from([5e-324, 1e-310, 1e-305]), floats(1e-300, 10.0)),
        presence_penalty=floats(-2.0, 2.0),
        frequency_penalty=floats(-2.0, 2.0),
        logit_bias=st.dictionaries(st.integers(0, 63), floats(-100.0, 100.0), max_size=3),
    )

    @settings(
        max_examples=20 if triton else 60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(states=st.lists(state, min_size=1, max_size=3), seed=st.integers(0, 2**32 - 1))
    def check(states, seed):
        batch = Batch(np.random.default_rng(seed), states, 64, slots=3)
        tokens, logprobs, _, bad = batch.run(triton, block=32)
        assert not bad.any() and np.isfinite(logprobs).all()
        assert ((tokens >= 0) & (tokens < 64)).all()
        for b, s in enumerate(states):
            moderate = s.repetition_penalty >= 0.05 and (s.temperature == 0 or s.temperature >= 0.05)
            if moderate:
                assert tokens[b] == batch.want(b)[0], s

    check()


def test_the_rows_arrays_go_up_in_one_copy(rng, monkeypatch):
    """``device_sampler.upload``: int32 and float32 arrays (NaN, -inf and negative zero among the
    floats) come back bit for bit from one host-to-device copy."""
    from fastdeploy.model_executor.layers import device_sampler

    copies = []
    to_tensor = paddle.to_tensor
    monkeypatch.setattr(paddle, "to_tensor", lambda *a, **k: copies.append(1) or to_tensor(*a, **k))
    f = rng.standard_normal((5, 8)).astype(np.float32)
    f[0, :3] = [np.nan, -np.inf, -0.0]
    host = {"f": f, "i": rng.integers(-(2**31), 2**31 - 1, (5, 4)).astype(np.int32), "b": f[:, :1].copy()}
    dev = device_sampler.upload(host)
    assert len(copies) == 1
    for k, v in host.items():
        got = dev[k].numpy()
        assert got.dtype == v.dtype and got.shape == v.shape
        np.testing.assert_array_equal(got.view(np.int32), v.view(np.int32))
