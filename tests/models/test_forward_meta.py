"""The step builder: everything derived from the batch is computed once per step, and every layer
reads the builder's tensors. Window indices are checked against slots computed here from the
block tables (numpy), with windows set here, not read from the code under test."""

import sys
import types

import numpy as np
import paddle
import pytest
from model_harness import Harness

from fastdeploy.config import KernelConfig
from fastdeploy.model_executor import forward_meta
from fastdeploy.model_executor.forward_meta import ForwardMetaBuilder
from fastdeploy.tools.make_tiny_model import make_tiny_model

BS = 16


def window_slots(table: list[int], p: int, W: int, topk: int) -> np.ndarray:
    """Slots of positions max(0, p - W + 1) .. p ascending, then -1 up to topk."""
    q = np.arange(max(0, p - W + 1), p + 1)
    row = np.full(topk, -1, np.int64)
    row[: q.size] = np.asarray(table)[q // BS] * BS + q % BS
    return row


@pytest.fixture(scope="module")
def four_swa_dir(tmp_path_factory):  # every layer SWA, W = 32 in the checkpoint
    return make_tiny_model(str(tmp_path_factory.mktemp("swa4")), seed=4, swa_layers=[0, 1, 2, 3], first_k_dense=4)


def test_two_windows_indexed_once_and_shared(four_swa_dir, rng, monkeypatch):
    W_A, W_B = 32, 12  # layers 0, 1 keep the checkpoint's window; layers 2, 3 get a second one
    h = Harness(four_swa_dir, block_size=BS, kernels=KernelConfig(mla_prefill_form="absorbed"))
    attn = [layer.self_attn for layer in h.model.model.layers]
    for a in attn[2:]:
        a.attn_backend.sliding_window = W_B
    assert h.model.sliding_windows == [W_B, W_A]

    calls = []
    real = forward_meta.get_swa_indexer_top_k
    monkeypatch.setattr(
        forward_meta, "get_swa_indexer_top_k", lambda *a, **k: calls.append(a[4]) or real(*a, **k)
    )  # observe only: count the builder's indexer runs per window
    read = {}
    for i, a in enumerate(attn):
        inner = a.attn_backend.forward_static

        def spy(q, cache, indices, meta, is_prefill=False, i=i, inner=inner):
            read[i] = indices
            return inner(q, cache, indices, meta, is_prefill)

        a.attn_backend.forward_static = spy

    ids = [int(x) for x in rng.integers(0, 500, 2 * W_A + BS + 3)]
    h.prefill("a", ids[:-1])  # step 1: a long prefill
    calls.clear()
    # step 2, mixed: a's decode at 2W + BS + 2, b's prefill crossing both windows and block edges
    b_ids = [int(x) for x in rng.integers(0, 500, W_A + 1)]
    meta = h.build_meta([("a", ids[-1:]), ("b", b_ids)], decode={"a"})
    assert sorted(calls) == [W_B, W_A]  # one indexer run per distinct window
    assert set(meta.swa_indices) == {W_A, W_B}
    with paddle.no_grad():
        h.model(meta, h.caches)
    assert read[0] is read[1] is meta.swa_indices[W_A]
    assert read[2] is read[3] is meta.swa_indices[W_B]
    assert len(calls) == 2  # the forward computed nothing more

    positions = [len(ids) - 1] + list(range(len(b_ids)))
    tables = [h.tables["a"]] + [h.tables["b"]] * len(b_ids)
    for W in (W_A, W_B):
        got = meta.swa_indices[W].numpy()
        assert got.shape == (len(positions), W)  # the reference provider pads nothing
        want = np.stack([window_slots(t, p, W, W) for t, p in zip(tables, positions, strict=True)])
        np.testing.assert_array_equal(got, want)


def test_flashmla_groups_padding_and_schedule_made_once(rng, monkeypatch):
    """For FlashMLA the builder splits decode from prefill tokens, pads every window's rows to
    128 (both of its kernels' multiples) and asks for the decode schedule once a step."""
    made = []
    fake = types.SimpleNamespace(get_mla_metadata=lambda: made.append(1) or f"sched{len(made)}")
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    kernels = KernelConfig(triton=False, sparse_mla_provider="flashmla", mla_prefill_form="absorbed")
    builder = ForwardMetaBuilder(BS, [5, 130], kernels, num_heads=16)
    tables = [list(rng.permutation(40)[:12]) for _ in range(3)]
    # request 0 decodes at 40, request 1 prefills 7 tokens from 3, request 2 decodes at 150
    meta = builder.build(list(range(9)), [0, 7, 0], [40, 3, 150], {"swa": tables})
    assert made == [1] and meta.flashmla_schedule == "sched1"
    for W in (5, 130):
        assert [(g.tokens.numpy().tolist(), g.requests.tolist(), g.is_prefill) for g in meta.attn_groups[W]] == [
            ([0, 8], [0, 2], False),
            ([1, 2, 3, 4, 5, 6, 7], [1], True),
        ]
    positions = [40, 3, 4, 5, 6, 7, 8, 9, 150]
    rows = [0] + [1] * 7 + [2]
    for W, topk in ((5, 128), (130, 256)):
        want = np.stack([window_slots(tables[b], p, W, topk) for b, p in zip(rows, positions, strict=True)])
        np.testing.assert_array_equal(meta.swa_indices[W].numpy(), want)
    prefill_only = builder.build(list(range(4)), [4], [0], {"swa": tables[:1]})  # no decode: no schedule
    assert made == [1] and prefill_only.flashmla_schedule is None
    assert [(g.tokens, g.form) for g in prefill_only.attn_groups[5]] == [(None, "prefill")]
    builder.build(list(range(2)), [0, 0], [7, 9], {"swa": tables[:2]})
    assert made == [1, 1]  # the next step gets its own schedule


def test_reference_and_triton_take_the_mixed_batch_in_one_group():
    for provider in ("reference", "triton"):
        builder = ForwardMetaBuilder(
            BS, [8], KernelConfig(sparse_mla_provider=provider, mla_prefill_form="absorbed"), 4
        )
        meta = builder.build(list(range(5)), [0, 4], [20, 0], {"swa": [[0, 1], [2]]})
        (group,) = meta.attn_groups[8]
        assert group.tokens is None and group.form == "absorbed" and group.requests.tolist() == [0, 1]
        assert meta.flashmla_schedule is None and meta.swa_indices[8].shape == [5, 8]


def test_mha_groups_and_keys_in_view(rng):
    """Prefill requests in MHA form get their keys in view as slots (the window, or the whole
    context, then the chunk), checked against slots computed here; decodes stay absorbed, and on
    the kernel path a full layer's absorbed rows cover the whole context."""
    tables = [list(rng.permutation(40)[:12]) for _ in range(3)]
    # request 0 decodes at 40, request 1 prefills 7 tokens from 3, request 2 prefills 20 from 30
    args = (list(range(28)), [0, 7, 20], [40, 3, 30], {"swa": tables, "full": tables})
    for kernels in (KernelConfig(mla_prefill_form="mha"), KernelConfig(True, "triton", "mha")):
        meta = ForwardMetaBuilder(BS, [0, 8], kernels, num_heads=4).build(*args)
        for W in (0, 8):
            mha, absorbed = meta.attn_groups[W]
            assert mha.form == "mha" and mha.requests.tolist() == [1, 2]
            assert mha.tokens.numpy().tolist() == list(range(1, 28))
            keys = mha.mha
            k_start = [0, 0] if W == 0 else [0, 30 - W + 1]
            want = np.concatenate([window_slots(tables[b], p, 10**6, 10**6) for b, p in ((1, 9), (2, 49))])
            want = want[want >= 0]
            if W:
                want = np.concatenate(
                    [window_slots(tables[1], 9, 10, 10), window_slots(tables[2], 49, 49 - 23 + 1, 27)]
                )
            np.testing.assert_array_equal(keys.slots.numpy(), want)
            assert keys.batch.q_start.tolist() == [3, 30] and keys.batch.k_start.tolist() == k_start
            assert keys.batch.cu_seqlens_q.tolist() == [0, 7, 27]
            assert keys.batch.cu_seqlens_k.tolist() == [0, 10, 10 + 50 - k_start[1]]
            for host, dev in zip(
                (keys.batch.cu_seqlens_q, keys.batch.cu_seqlens_k, keys.batch.q_start, keys.batch.k_start),
                keys.batch.device,
                strict=True,
            ):
                assert dev.dtype == paddle.int32 and dev.numpy().tolist() == host.tolist()
            assert absorbed.form == "absorbed" and absorbed.requests.tolist() == [0]
            assert absorbed.tokens.numpy().tolist() == [0]
            if W == 0 and kernels.triton:
                np.testing.assert_array_equal(absorbed.full_indices.numpy(), window_slots(tables[0], 40, 41, 41)[None])
            else:
                assert absorbed.full_indices is None
    released = [-1] + list(tables[0][1:])  # positions 0..15 gone: a prefill of 4 from 20 (W 8) sees 13..23
    with pytest.raises(ValueError, match="window 8"):
        ForwardMetaBuilder(BS, [8], KernelConfig(mla_prefill_form="mha"), 4).build(
            [1] * 4, [4], [20], {"swa": [released]}
        )


def test_full_layer_decodes_go_to_flashmla_dense(tmp_path, rng, monkeypatch):
    """With the flashmla provider and a bf16 full-layer cache, full layers' decodes run FlashMLA's
    dense decode on the paged cache (block table rows and cache lengths from the step builder);
    a fake flash_mla computes that contract in torch, and the logits match the reference path."""
    import torch

    calls = []

    def dense(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, softmax_scale, causal, **kw):
        calls.append((block_table.clone(), cache_seqlens.clone(), q.shape, causal, tile_scheduler_metadata))
        b, _, h, _ = q.shape
        bs = k_cache.shape[1]
        out = torch.zeros(b, 1, h, head_dim_v)
        for i in range(b):
            pos = torch.arange(int(cache_seqlens[i]))
            rows = k_cache.reshape(-1, 576)[block_table[i].long()[pos // bs] * bs + pos % bs].float()
            p = torch.softmax(q[i, 0].float() @ rows.T * softmax_scale, -1)
            out[i, 0] = p @ rows[:, :head_dim_v]
        return out.to(torch.bfloat16), torch.zeros(b, h, 1)

    fake = types.SimpleNamespace(get_mla_metadata=lambda: ("sched", None), flash_mla_with_kvcache=dense)
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    d = make_tiny_model(str(tmp_path / "full"), seed=6, num_layers=2, swa_layers=[], first_k_dense=2)
    ids = [int(x) for x in rng.integers(0, 500, 2 * BS + 5)]
    logits = {}
    for provider in ("reference", "flashmla"):
        h = Harness(d, kv_cache_dtype="bf16", kernels=KernelConfig(sparse_mla_provider=provider))
        h.prefill("a", ids[:20])
        h.prefill("b", ids[:7])
        steps = [h.step([("a", [t]), ("b", [t])], decode={"a", "b"}) for t in ids[20:]]
        logits[provider] = np.stack([np.concatenate([s["a"], s["b"]]) for s in steps])
    n_layers = 2
    assert len(calls) == n_layers * len(ids[20:])  # every full layer's decodes, every step
    table, seqlens, shape, causal, sched = calls[-1]
    assert causal and sched == "sched" and list(shape) == [2, 1, 64, 576]  # 4 heads padded to 64
    assert seqlens.tolist() == [len(ids), 7 + len(ids) - 20]
    np.testing.assert_array_equal(table[0, : len(h.tables["a"])].numpy(), h.tables["a"])
    err = np.abs(logits["flashmla"] - logits["reference"]).max() / np.abs(logits["reference"]).max()
    assert err < 3e-2, err  # bf16 q in the dense kernel
