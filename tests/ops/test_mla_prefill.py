"""MLA prefill in MHA form: the Triton kernel (interpreter) and the paddle reference against a
float64 numpy reference, with windows around block and chunk edges, varlen batches with prefix
context, and NaN in every key no query may see."""

import numpy as np
import paddle
import pytest
from ref import mla_prefill_ref_np

from fastdeploy.model_executor.ops.triton_ops.mla_prefill import PrefillBatch, mla_prefill_attention, mla_prefill_ref

SCALE = 0.1352


def make_batch(rng, reqs, W, H=4):
    """reqs: (context, chunk) per request; keys are the window before the chunk (all the context
    without a window) plus the chunk. Keys no query sees are NaN."""
    cu_q, cu_k, q_start, k_start = [0], [0], [], []
    for ctx, n in reqs:
        k0 = max(0, ctx - W + 1) if W > 0 else 0
        k0 = max(0, k0 - 5)  # 5 more keys before the window: nobody's, NaN
        q_start.append(ctx)
        k_start.append(k0)
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + ctx + n - k0)
    T, S = cu_q[-1], cu_k[-1]
    q = rng.standard_normal((T, H, 192))
    k, kr, v = rng.standard_normal((S, H, 128)), rng.standard_normal((S, 64)), rng.standard_normal((S, H, 128))
    for b, (ctx, _) in enumerate(reqs):  # NaN where no query of b looks
        first = ctx - W + 1 if W > 0 else 0
        for j in range(cu_k[b], cu_k[b + 1]):
            if k_start[b] + j - cu_k[b] < first:
                k[j], kr[j], v[j] = np.nan, np.nan, np.nan
    return q, k, kr, v, np.array(cu_q), np.array(cu_k), np.array(q_start), np.array(k_start)


@pytest.mark.parametrize("impl", [mla_prefill_attention, mla_prefill_ref], ids=["triton", "ref"])
@pytest.mark.parametrize(
    "W, reqs",
    [
        (32, [(0, 70), (40, 31), (5, 32), (100, 33)]),  # chunks below / equal / above W, prefix context
        (33, [(31, 1), (32, 65), (63, 2)]),  # positions W-1, W, W+1 at block edges
        (0, [(0, 50), (17, 20)]),  # full causal: a full layer's prefill
        (64, [(0, 130), (64, 64)]),  # window = tile
        (200, [(250, 150), (3, 140)]),  # tiles every query sees whole (no mask) between masked edges
        (0, [(300, 70)]),  # full causal over a long context: mostly unmasked tiles
    ],
)
def test_matches_float64(impl, W, reqs, rng):
    q, k, kr, v, cu_q, cu_k, qs, ks = make_batch(rng, reqs, W)
    t = lambda x: paddle.to_tensor(x, "float32")  # noqa: E731
    got = impl(t(q), t(k), t(kr), t(v), PrefillBatch.of(cu_q, cu_k, qs, ks), SCALE, W).numpy()
    want = mla_prefill_ref_np(q, k, kr, v, cu_q, cu_k, qs, ks, W, SCALE)
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert err.max() < 1e-4, err.max()


def test_bad_shapes_named(rng):
    q, k, kr, v, cu_q, cu_k, qs, ks = make_batch(rng, [(0, 4)], 8)
    t = lambda x: paddle.to_tensor(x, "float32")  # noqa: E731
    with pytest.raises(ValueError, match="k_rope must be"):
        mla_prefill_ref(t(q), t(k), t(kr[:, :32]), t(v), PrefillBatch.of(cu_q, cu_k, qs, ks), SCALE, 8)
    with pytest.raises(ValueError, match="q must be"):
        mla_prefill_attention(t(q[..., :128]), t(k), t(kr), t(v), PrefillBatch.of(cu_q, cu_k, qs, ks), SCALE, 8)
