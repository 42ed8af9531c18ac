"""Window indexer: integer-exact against a pure Python reference."""

import numpy as np
import paddle
import pytest
from ref import swa_indexer_ref_py

from fastdeploy.model_executor.ops.triton_ops.swa_indexer import swa_indexer_ref, swa_indexer_triton


def random_batch(rng, W, bs, n_req=4):
    """Requests with random lengths >= 2W + a block, random non-contiguous block tables, and
    tokens at 0, 1, W-1, W, W+1, 2W+7, block edges, plus padding tokens."""
    lens = [int(rng.integers(2 * W + bs, 2 * W + 3 * bs)) for _ in range(n_req)]
    max_blocks = max(lens) // bs + 2
    pool = rng.permutation(n_req * max_blocks * 2)
    bt = np.full((n_req, max_blocks), -1, np.int32)
    for b, n in enumerate(lens):
        need = -(-n // bs)
        bt[b, :need] = pool[b * max_blocks : b * max_blocks + need]
    positions, bids = [], []
    for b, n in enumerate(lens):
        special = [0, 1, W - 1, W, W + 1, 2 * W + 7, bs - 1, bs, bs + 1, 2 * bs - 1, n - 1]
        pick = sorted(set([q for q in special if 0 <= q < n] + rng.integers(0, n, 8).tolist()))
        positions += pick
        bids += [b] * len(pick)
    positions += [-1, 5, -1]
    bids += [-1, -1, 0]
    return np.array(positions, np.int32), np.array(bids, np.int32), bt


@pytest.mark.parametrize("impl", [swa_indexer_triton, swa_indexer_ref], ids=["triton", "ref"])
@pytest.mark.parametrize("bs", [64, 16])
@pytest.mark.parametrize("W, extra", [(32, 0), (32, 96), (100, 28)])
def test_matches_python(impl, bs, W, extra, rng):
    pos, bids, bt = random_batch(rng, W, bs)
    topk = W + extra
    got = impl(paddle.to_tensor(pos), paddle.to_tensor(bids), paddle.to_tensor(bt), bs, W, topk)
    assert got.dtype == paddle.int32 and list(got.shape) == [len(pos), topk]
    want = swa_indexer_ref_py(pos.tolist(), bids.tolist(), bt.tolist(), bs, W, topk)
    np.testing.assert_array_equal(got.numpy(), want)


def test_window_edges_explicit():
    # one request, identity block table: slot == position
    bs, W = 16, 8
    bt = paddle.to_tensor(np.arange(4, dtype=np.int32)[None])
    pos = paddle.to_tensor([W - 2, W - 1, W, W + 1], dtype="int32")
    out = swa_indexer_triton(pos, paddle.zeros([4], "int32"), bt, bs, W, 16).numpy()
    assert out[0].tolist() == list(range(0, W - 1)) + [-1] * 9
    assert out[1].tolist() == list(range(0, W)) + [-1] * 8
    assert out[2].tolist() == list(range(1, W + 1)) + [-1] * 8
    assert out[3].tolist() == list(range(2, W + 2)) + [-1] * 8


@pytest.mark.parametrize("impl", [swa_indexer_triton, swa_indexer_ref])
def test_errors_and_empty(impl):
    z = paddle.zeros([0], "int32")
    bt = paddle.zeros([1, 2], "int32")
    assert list(impl(z, z, bt, 16, 8, 8).shape) == [0, 8]
    with pytest.raises(ValueError, match="topk"):
        impl(z, z, bt, 16, 8, 4)
    with pytest.raises(ValueError, match="sliding_window"):
        impl(z, z, bt, 16, 0, 4)


@pytest.mark.parametrize("impl", [swa_indexer_triton, swa_indexer_ref], ids=["triton", "ref"])
def test_released_blocks_map_to_minus_one(impl, rng):
    """Released SWA table entries are -1: a window that reaches into one (which the release rule
    never lets a real step do) gets -1 there and real slots elsewhere; tables of windows that
    start past the released blocks are unaffected."""
    bs, W = 16, 40
    bt = rng.permutation(64)[:12].reshape(2, 6).astype(np.int32)
    bt[0, :2] = -1  # request 0 released blocks 0, 1 (positions 0..31)
    bt[1, 0] = -7  # any negative id counts as released
    pos = np.array([31, 32, 45, 71, 72, 95, 15, 16, 60], np.int32)
    bids = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1], np.int32)
    got = impl(paddle.to_tensor(pos), paddle.to_tensor(bids), paddle.to_tensor(bt), bs, W, W).numpy()
    want = swa_indexer_ref_py(pos.tolist(), bids.tolist(), bt.tolist(), bs, W, W)
    np.testing.assert_array_equal(got, want)
    assert (got[0] == -1).all()  # position 31 sees 0..31: all released
    assert (got[2, :26] == -1).all() and (got[2, 26:] >= 0).all()  # 45 sees 6..45: 6..31 released
    assert (got[4] >= 0).all()  # 72 sees 33..72: none released
