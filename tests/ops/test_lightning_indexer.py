"""DeepSeek-V3.2's lightning indexer ops (``ops/triton_ops/lightning_indexer.py``): the FP8
quantization with power-of-two scales, the index scores and the top-k pick, against the float64
reference (``ref.lightning_index_ref``) and against Hugging Face's own ``DeepseekV32Indexer``."""

import numpy as np
import paddle
import pytest
import torch
from ref import lightning_index_ref, pow2_e4m3_ref

from fastdeploy.model_executor.ops.triton_ops.lightning_indexer import index_scores, index_topk, quantize_pow2_e4m3


def test_quantize_pow2_e4m3_equals_the_reference(rng):
    """Random vectors over six decades, an all-zero one and one at e4m3's top: the same values and
    scales as the float64 reference, every scale a power of two, values within 448."""
    x = (rng.standard_normal((7, 128)) * 10.0 ** rng.uniform(-3, 3, (7, 1))).astype(np.float32)
    x[3] = 0
    x[5, :3] = [448.0, -448.0, 447.0]
    q, s = quantize_pow2_e4m3(paddle.to_tensor(x))
    want_q, want_s = pow2_e4m3_ref(x.astype(np.float64))
    np.testing.assert_array_equal(s.numpy().astype(np.float64), want_s)
    np.testing.assert_array_equal(q.numpy().astype(np.float64), want_q)
    assert (np.log2(s.numpy()) == np.round(np.log2(s.numpy()))).all() and np.abs(q.numpy()).max() <= 448


@pytest.mark.parametrize("fp8", [False, True], ids=["unquantized", "fp8"])
def test_scores_and_pick_equal_the_reference(fp8, rng):
    """T queries over S keys with ends at 1, topk - 1, topk, topk + 1 and S (causal prefill rows
    and a long decode row): scores within float32 rounding, the same key sets in the same order."""
    T, S, H, D, topk = 6, 40, 4, 128, 8
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = rng.standard_normal((S, D)).astype(np.float32)
    w = rng.standard_normal((T, H)).astype(np.float32) * H**-0.5 * D**-0.5
    ends = np.array([1, topk - 1, topk, topk + 1, S - 3, S])
    k_scale = None
    if fp8:
        qq, qs = pow2_e4m3_ref(q.astype(np.float64))
        kq, ks = pow2_e4m3_ref(k.astype(np.float64))
        q, w, k, k_scale = qq.astype(np.float32), (w * qs).astype(np.float32), kq.astype(np.float32), ks
    t = paddle.to_tensor
    got = index_scores(t(q), t(w), t(k), t(ends), None if k_scale is None else t(k_scale.astype(np.float32)))
    ids = index_topk(got, t(ends), topk).numpy()
    want, want_ids = lightning_index_ref(q, w, k, ends, topk, k_scale)
    finite = np.isfinite(want)
    assert (np.isfinite(got.numpy()) == finite).all()
    np.testing.assert_allclose(got.numpy()[finite], want[finite], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ids, want_ids)
    assert ids.dtype == np.int32 and (ids[0, 1:] == -1).all() and (ids[-1] >= 0).all()


def test_ties_go_to_the_lower_key_id():
    """Keys 2 and 5 equal (as are 1 and 4): a cut through equal scores keeps the lower id; the
    pick comes in id order; fewer keys than topk pad with -1."""
    k = np.zeros((6, 4), np.float32)
    k[[2, 5], 0], k[[1, 4], 1], k[3, 2] = 1.0, 0.5, 0.25
    q = np.ones((1, 1, 4), np.float32)
    w = np.ones((1, 1), np.float32)
    s = index_scores(paddle.to_tensor(q), paddle.to_tensor(w), paddle.to_tensor(k), paddle.to_tensor([6]))
    assert index_topk(s, paddle.to_tensor([6]), 1).numpy().tolist() == [[2]]
    assert index_topk(s, paddle.to_tensor([6]), 3).numpy().tolist() == [[1, 2, 5]]
    assert index_topk(s, paddle.to_tensor([6]), 5).numpy().tolist() == [[1, 2, 3, 4, 5]]
    assert index_topk(s, paddle.to_tensor([6]), 8).numpy().tolist() == [[0, 1, 2, 3, 4, 5, -1, -1]]


def test_pick_equals_hugging_faces_indexer(rng):
    """HF's DeepseekV32Indexer (float32, no FP8) on a causal prefill of 24 tokens with index_topk 8:
    its q, k and head weights fed to index_scores / index_topk pick the same key set for every
    query (HF's entries past a query's end are masked keys: compared up to min(topk, t + 1)); the
    set and order may differ only between keys whose scores agree to float32 rounding (HF
    computes the scores in another order)."""
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        DeepseekV32Indexer,
        DeepseekV32RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    torch.manual_seed(int(rng.integers(1 << 31)))
    cfg = DeepseekV32Config(
        hidden_size=64, q_lora_rank=32, index_n_heads=4, index_head_dim=128, index_topk=8,
        qk_rope_head_dim=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=64,
    )  # fmt: skip
    idx = DeepseekV32Indexer(cfg, 0).eval()
    T = 24
    x, q_resid = torch.randn(1, T, 64), torch.randn(1, T, 32)
    pos = torch.arange(T)[None]
    cos, sin = DeepseekV32RotaryEmbedding(cfg)(x, pos)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))[None]
    hf = idx(x, q_resid, (cos, sin), mask, pos)[0].numpy()
    with torch.no_grad():
        q = idx.wq_b(q_resid).view(1, T, 4, 128)
        k = idx.k_norm(idx.wk(x)).unsqueeze(2)
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :64], k[..., :64], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., 64:]], -1)[0].numpy()
        k = torch.cat([k_rot, k[..., 64:]], -1)[0, :, 0].numpy()
        w = (idx.weights_proj(x)[0] * 4**-0.5 * 128**-0.5).numpy()
    ends = np.arange(1, T + 1)
    t = paddle.to_tensor
    scores = index_scores(t(q), t(w), t(k), t(ends)).numpy()
    ids = index_topk(t(scores), t(ends), 8).numpy()
    for r in range(T):
        n = min(8, r + 1)
        tol = 1e-6 * np.abs(scores[r, : r + 1]).max()
        swapped = set(ids[r, :n].tolist()) ^ set(hf[r, :n].tolist())  # only at a tie across the cut
        cut = scores[r, ids[r, :n]].min()  # our pick comes in position order: its lowest score is the cut
        assert all(abs(scores[r, j] - cut) <= tol for j in swapped), r
        assert (ids[r, n:] == -1).all() and (np.diff(ids[r, :n]) > 0).all()
        assert (np.diff(scores[r, hf[r, :n]]) <= tol).all(), r  # HF's pick comes highest first


@pytest.mark.parametrize("tiling", [(64, 64, False), (32, 16, True)], ids=["one_tile", "sub_tiles_keys_as_rows"])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8_cache", "float_cache"])
def test_index_logits_kernel_equals_the_reference(fp8, tiling, rng):
    """One step over a paged indexer cache (block_size 16, blocks drawn at random, the rest of the
    cache NaN): a prefill of 21 tokens after 11 cached ones and two decode rows, one at a block
    edge. The Triton kernel (one launch for every row; a program's positions in one tile, or in
    sub-tiles some of which lie past the end with the keys as the dot's rows), the paddle
    reference (one key gather a request) and the float64 scores of the cached keys agree; past
    each row's end, -inf."""
    from types import SimpleNamespace

    from fastdeploy.model_executor.ops.triton_ops.lightning_indexer import (
        index_logits_ref,
        index_logits_triton,
        write_index_keys_ref,
    )

    BS, H, D, nb = 16, 16, 128, 4
    starts, counts = [11, 31, 47], [21, 1, 1]  # request b's queries: positions start .. start + count - 1
    table = rng.permutation(20)[: 3 * nb].reshape(3, nb).astype(np.int32)
    shape = [21, BS, 1, D + 4] if fp8 else [21, BS, 1, D]
    cache = paddle.full(shape, 0xFF if fp8 else float("nan"), "uint8" if fp8 else "float32")
    keys = {}
    for b in range(3):
        pos = np.arange(starts[b] + counts[b])
        keys[b] = rng.standard_normal((len(pos), D)).astype(np.float32)
        slots = table[b, pos // BS] * BS + pos % BS
        write_index_keys_ref(paddle.to_tensor(keys[b]), paddle.to_tensor(slots.astype(np.int32)), cache)
    krow = np.repeat(np.arange(3), counts).astype(np.int32)
    ends = np.concatenate([np.arange(s, s + c) + 1 for s, c in zip(starts, counts, strict=True)])
    T, width = len(krow), nb * BS
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    w = (rng.standard_normal((T, H)) * H**-0.5 * D**-0.5).astype(np.float32)
    if fp8:
        qq, qs = pow2_e4m3_ref(q.astype(np.float64))
        q, w = qq.astype(np.float32), (w * qs).astype(np.float32)
    t = paddle.to_tensor
    got = index_logits_triton(t(q), t(w), cache, t(table), t(krow), t(ends), width, *tiling).numpy()
    rows, cu = [], np.concatenate([[0], np.cumsum(counts)])
    for b in range(3):
        pos = np.arange(ends[cu[b + 1] - 1])
        slots = (table[b, pos // BS] * BS + pos % BS).astype(np.int64)
        rows.append(
            SimpleNamespace(tokens=(int(cu[b]), int(cu[b + 1])), key_slots=t(slots), ends=t(ends[cu[b] : cu[b + 1]]))
        )
    ref = index_logits_ref(t(q), t(w), cache, rows, width).numpy()
    want = np.full((T, width), -np.inf)
    for i in range(T):
        k = keys[krow[i]].astype(np.float64)
        k_scale = np.ones(len(k))
        if fp8:
            k, k_scale = pow2_e4m3_ref(k)
        s = np.maximum(np.einsum("hd,sd->hs", q[i].astype(np.float64), k), 0)
        want[i, : ends[i]] = (w[i].astype(np.float64) @ s * k_scale)[: ends[i]]
    for x in (got, ref):
        assert (np.isinf(x) == np.isinf(want)).all()
        fin = np.isfinite(want)
        np.testing.assert_allclose(x[fin], want[fin], rtol=2e-5, atol=2e-5 * np.abs(want[fin]).max())


@pytest.mark.parametrize("tile", [16, 2048])
def test_topk_kernel_equals_the_reference_pick(tile, rng):
    """The Triton top-k (a radix select of the k-th largest score, then a compaction in position
    order) against index_topk's stable sort, over tiles of 16 (seven a row) and one tile: rows
    ending before, at and past k; ties across the cut (equal ones go to the lower position);
    negative scores; scores that differ only in their last bits (every pass of the select
    decides); a row of one value; a row whose k-th score is -inf-free but holds -inf inside."""
    from fastdeploy.model_executor.ops.triton_ops.lightning_indexer_kernel import launch_index_topk

    T, L, k = 9, 100, 16
    s = rng.standard_normal((T, L)).astype(np.float32)
    s[1, 3:60:7] = s[1, 2]  # ties
    s[2] = np.round(s[2])  # many ties, one of them at the cut
    s[3] = -np.abs(s[3])
    s[4] = (1.0 + np.arange(L) * 2.0**-23).astype(np.float32)[rng.permutation(L)]  # one ulp apart
    s[5] = 0.25
    s[6, ::3] = -np.inf
    ends = np.array([1, 60, L, k, L, L, L, k - 3, 37])
    s[np.arange(L)[None, :] >= ends[:, None]] = -np.inf
    got = paddle.full([T, k], -7, "int32")
    launch_index_topk(paddle.to_tensor(s), paddle.to_tensor(ends), got, tile=tile)
    want = index_topk(paddle.to_tensor(s), paddle.to_tensor(ends), k).numpy()
    np.testing.assert_array_equal(got.numpy(), want)
    assert (want[0, 1:] == -1).all() and (want[2] >= 0).all() and want[5].tolist() == list(range(k))
    for t in (1, 2, 4):  # the pick is the top k by (score, lower position) first
        best = sorted(range(ends[t]), key=lambda j: (-s[t, j], j))[:k]
        assert sorted(best) == want[t].tolist()


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8_cache", "float_cache"])
def test_index_key_write_kernel_equals_the_reference(fp8, rng):
    """The Triton key write against the paddle one into two caches poisoned alike: keys over six
    decades, an all-zero key (amax floored at 1e-4), one with values at e4m3's top, a slot -1 (the
    null block's last slot): byte for byte the same cache."""
    from fastdeploy.model_executor.ops.triton_ops.lightning_indexer import write_index_keys_ref, write_index_keys_triton

    N, BS, D, T = 5, 16, 128, 11
    k = (rng.standard_normal((T, D)) * 10.0 ** rng.uniform(-3, 3, (T, 1))).astype(np.float32)
    k[2] = 0
    k[4, :2] = [448.0, -447.0]
    slots = rng.choice((N - 1) * BS, T, replace=False).astype(np.int32)
    slots[7] = -1
    shape, dtype = ([N, BS, 1, D + 4], "uint8") if fp8 else ([N, BS, 1, D], "float32")
    fill = 0xFF if fp8 else float("nan")
    ours, ref = paddle.full(shape, fill, dtype), paddle.full(shape, fill, dtype)
    write_index_keys_triton(paddle.to_tensor(k), paddle.to_tensor(slots), ours)
    write_index_keys_ref(paddle.to_tensor(k), paddle.to_tensor(slots), ref)
    np.testing.assert_array_equal(ours.numpy(), ref.numpy())
    assert not (ref.numpy() == (0xFF if fp8 else ref.numpy())).all()  # something was written
