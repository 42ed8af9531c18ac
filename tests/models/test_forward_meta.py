"""The step builder: the common step data once a step, then one plan per attention kind, made by
that kind's backend; every layer of the kind reads it. Window indices are checked against slots
computed here from the block tables (numpy), with windows set here, not read from the code under
test; model outputs against the float64 reference model."""

import json
import sys

import numpy as np
import paddle
import pytest
from fake_flash_mla import fake_flash_mla
from model_harness import Harness, assert_close_with_routing_flips, position_errors

from fastdeploy.config import KernelConfig
from fastdeploy.model_executor.forward_meta import ForwardMetaBuilder
from fastdeploy.model_executor.layers.attention.dsa_attention_backend import DSAAttentionBackend
from fastdeploy.model_executor.layers.attention.mla_attention_backend import MLAAttentionBackend
from fastdeploy.model_executor.models.deepseek_v3_reference import forward, load_np
from fastdeploy.tools.make_tiny_model import make_tiny_model

BS = 16


def window_slots(table: list[int], p: int, W: int, topk: int) -> np.ndarray:
    """Slots of positions max(0, p - W + 1) .. p ascending, then -1 up to topk."""
    q = np.arange(max(0, p - W + 1), p + 1)
    row = np.full(topk, -1, np.int64)
    row[: q.size] = np.asarray(table)[q // BS] * BS + q % BS
    return row


def swa(W: int, kernels: KernelConfig, heads: int = 4) -> DSAAttentionBackend:
    return DSAAttentionBackend(0.1, W, kernels, heads, "float32")


def full(kernels: KernelConfig, heads: int = 4, kv_cache_dtype: str = "auto") -> MLAAttentionBackend:
    return MLAAttentionBackend(0.1, kernels, heads, "float32", kv_cache_dtype)


@pytest.fixture(scope="module")
def four_swa_dir(tmp_path_factory):  # every layer SWA, W = 32 in the checkpoint, dense MLPs
    return make_tiny_model(str(tmp_path_factory.mktemp("swa4")), seed=4, swa_layers=[0, 1, 2, 3], first_k_dense=4)


def test_two_windows_planned_once_each(four_swa_dir, rng):
    """Layers 0, 1 keep the checkpoint's window (32), layers 2, 3 get 12: the builder plans each
    kind once a step, its indices match numpy, and the model attends each layer over its own
    window (logits against the float64 model with those windows, not with one window)."""
    W_A, W_B = 32, 12
    h = Harness(four_swa_dir, block_size=BS, kernels=KernelConfig(mla_prefill_form="absorbed"))
    for layer in h.model.model.layers[2:]:
        layer.self_attn.attn_backend.sliding_window = W_B
    h.builder = ForwardMetaBuilder(BS, h.model.attention_backends(), h.kernels)
    ids = [int(x) for x in rng.integers(0, 500, 2 * W_A + BS + 3)]
    got = h.prefill("a", ids[:-1], chunk=W_A + 1)  # chunks above W_A, crossing both windows and block edges

    # a mixed step: a's decode at 2W + BS + 2, b's prefill
    b_ids = [int(x) for x in rng.integers(0, 500, W_A + 1)]
    meta = h.build_meta([("a", ids[-1:]), ("b", b_ids)], decode={"a"})
    assert sorted(meta.attn) == ["swa:12", "swa:32"]  # one plan per kind
    positions = [len(ids) - 1] + list(range(len(b_ids)))
    tables = [h.tables["swa"]["a"]] + [h.tables["swa"]["b"]] * len(b_ids)
    for W in (W_A, W_B):
        got_idx = meta.attn[f"swa:{W}"].indices.numpy()
        assert got_idx.shape == (len(positions), W)  # the reference provider pads nothing
        want = np.stack([window_slots(t, p, W, W) for t, p in zip(tables, positions, strict=True)])
        np.testing.assert_array_equal(got_idx, want)

    w, cfg = load_np(four_swa_dir), json.load(open(f"{four_swa_dir}/config.json"))
    both = forward(w, cfg, ids[:-1], [W_A, W_A, W_B, W_B], fp8_kv=True)
    assert_close_with_routing_flips(got, both, 1e-2, 5e-2)
    one = position_errors(got, forward(w, cfg, ids[:-1], [W_A] * 4, fp8_kv=True))
    assert np.median(one[-W_A:]) > 10 * np.median(position_errors(got, both)[-W_A:])


def test_flashmla_groups_padding_and_schedule_made_once(rng, monkeypatch):
    """For FlashMLA each SWA kind's plan splits decode from prefill tokens, pads its rows to 128
    (both of its kernels' multiples) and asks for the decode schedule once a step."""
    calls = []
    made = []
    fake = fake_flash_mla(calls)
    fake.get_mla_metadata = lambda: made.append(1) or f"sched{len(made)}"
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    kernels = KernelConfig(triton=False, sparse_mla_provider="flashmla", mla_prefill_form="absorbed")
    builder = ForwardMetaBuilder(BS, [swa(5, kernels, 16), swa(130, kernels, 16)], kernels)
    tables = [list(rng.permutation(40)[:12]) for _ in range(3)]
    # request 0 decodes at 40, request 1 prefills 7 tokens from 3, request 2 decodes at 150
    meta = builder.build(list(range(9)), [0, 7, 0], [40, 3, 150], {"swa": tables})
    assert made == [1, 1] and [meta.attn[k].schedule for k in ("swa:5", "swa:130")] == ["sched1", "sched2"]
    for W in (5, 130):
        assert [
            (g.tokens.numpy().tolist(), g.requests.tolist(), g.is_prefill) for g in meta.attn[f"swa:{W}"].groups
        ] == [
            ([0, 8], [0, 2], False),
            ([1, 2, 3, 4, 5, 6, 7], [1], True),
        ]
    positions = [40, 3, 4, 5, 6, 7, 8, 9, 150]
    rows = [0] + [1] * 7 + [2]
    for W, topk in ((5, 128), (130, 256)):
        want = np.stack([window_slots(tables[b], p, W, topk) for b, p in zip(rows, positions, strict=True)])
        np.testing.assert_array_equal(meta.attn[f"swa:{W}"].indices.numpy(), want)
    prefill_only = builder.build(list(range(4)), [4], [0], {"swa": tables[:1]})  # no decode: no schedule
    assert made == [1, 1] and prefill_only.attn["swa:5"].schedule is None
    assert [(g.tokens, g.form) for g in prefill_only.attn["swa:5"].groups] == [(None, "prefill")]
    builder.build(list(range(2)), [0, 0], [7, 9], {"swa": tables[:2]})
    assert made == [1, 1, 1, 1]  # the next step gets its own schedules
    assert calls == []  # planning runs no kernel


def test_reference_and_triton_take_the_mixed_batch_in_one_group():
    for provider in ("reference", "triton"):
        kernels = KernelConfig(sparse_mla_provider=provider, mla_prefill_form="absorbed")
        meta = ForwardMetaBuilder(BS, [swa(8, kernels)], kernels).build(
            list(range(5)), [0, 4], [20, 0], {"swa": [[0, 1], [2]]}
        )
        plan = meta.attn["swa:8"]
        (group,) = plan.groups
        assert group.tokens is None and group.form == "absorbed" and group.requests.tolist() == [0, 1]
        assert plan.schedule is None and plan.indices.shape == [5, 8]


def test_no_window_indices_when_every_token_is_mha():
    kernels = KernelConfig(mla_prefill_form="mha")
    meta = ForwardMetaBuilder(BS, [swa(8, kernels)], kernels).build(list(range(6)), [6], [0], {"swa": [[3]]})
    plan = meta.attn["swa:8"]
    assert [g.form for g in plan.groups] == ["mha"] and plan.indices is None


def test_mha_groups_and_keys_in_view(rng):
    """Prefill requests in MHA form get their keys in view as slots (the window, or the whole
    context, then the chunk), checked against slots computed here; decodes stay absorbed, and on
    the kernel path a full layer's absorbed rows cover the whole context."""
    tables = [list(rng.permutation(40)[:12]) for _ in range(3)]
    # request 0 decodes at 40, request 1 prefills 7 tokens from 3, request 2 prefills 20 from 30
    args = (list(range(28)), [0, 7, 20], [40, 3, 30], {"swa": tables, "full": tables})
    for kernels in (KernelConfig(mla_prefill_form="mha"), KernelConfig(True, "triton", "mha")):
        meta = ForwardMetaBuilder(BS, [full(kernels), swa(8, kernels)], kernels).build(*args)
        for W in (0, 8):
            mha, absorbed = meta.attn["full" if W == 0 else "swa:8"].groups
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
            if W == 0:  # a full layer's absorbed rows: the whole context, on every provider
                np.testing.assert_array_equal(absorbed.indices.numpy(), window_slots(tables[0], 40, 41, 41)[None])
            else:  # an SWA layer's rows are the kind's window indices, every token's
                np.testing.assert_array_equal(meta.attn["swa:8"].indices.numpy()[0], window_slots(tables[0], 40, 8, 8))
    released = [-1] + list(tables[0][1:])  # positions 0..15 gone: a prefill of 4 from 20 (W 8) sees 13..23
    mha_only = KernelConfig(mla_prefill_form="mha")
    with pytest.raises(ValueError, match="window 8"):
        ForwardMetaBuilder(BS, [swa(8, mha_only)], mha_only).build([1] * 4, [4], [20], {"swa": [released]})


def test_full_layer_decodes_go_to_flashmla_dense(tmp_path, rng, monkeypatch):
    """With the flashmla provider and a bf16 full-layer cache, full layers go through the same
    provider switch as SWA layers: decodes run FlashMLA's dense decode on the paged cache
    (block-table rows and cache lengths from the plan), absorbed prefills its sparse prefill over
    the whole context; a fake flash_mla computes both contracts, and the logits match the
    reference provider's."""
    calls = []
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla(calls))
    d = make_tiny_model(str(tmp_path / "full"), seed=6, num_layers=2, swa_layers=[], first_k_dense=2)
    ids = [int(x) for x in rng.integers(0, 500, 2 * BS + 5)]
    logits = {}
    for provider in ("reference", "flashmla"):
        kernels = KernelConfig(sparse_mla_provider=provider, mla_prefill_form="absorbed")
        h = Harness(d, kv_cache_dtype="bf16", kernels=kernels)
        h.prefill("a", ids[:20])
        h.prefill("b", ids[:7])
        steps = [h.step([("a", [t]), ("b", [t])], decode={"a", "b"}) for t in ids[20:]]
        logits[provider] = np.stack([np.concatenate([s["a"], s["b"]]) for s in steps])
    n_layers = 2
    kinds = [c[0] for c in calls]
    assert kinds == ["prefill"] * 2 * n_layers + ["dense"] * n_layers * len(ids[20:])
    last = calls[-1][1]
    assert last["cache_seqlens"].tolist() == [len(ids), 7 + len(ids) - 20]
    np.testing.assert_array_equal(last["block_table"][0, : len(h.tables["full"]["a"])].numpy(), h.tables["full"]["a"])
    err = np.abs(logits["flashmla"] - logits["reference"]).max() / np.abs(logits["reference"]).max()
    assert err < 3e-2, err  # bf16 q in FlashMLA's kernels


@pytest.mark.parametrize("provider", ["reference", "triton"])
def test_captured_decode_step_plans_from_the_device(provider, rng):
    """``build_decode`` (a captured decode step: device inputs only, tables at a fixed width) gives
    the slots and window indices numpy computes from the tables (W = 32: positions W - 1, W,
    W + 1, block edges, >= 2W + a block, a padding row on the null block); full layers index the
    whole context up to the step's bound, -1 past each row's own position."""
    W, bound, null = 32, 200, 99
    width = -(-bound // BS)
    kernels = KernelConfig(sparse_mla_provider=provider, mla_prefill_form="absorbed", triton=provider == "triton")
    builder = ForwardMetaBuilder(BS, [swa(W, kernels), full(kernels)], kernels)
    positions = [W - 1, W, W + 1, BS - 1, 2 * BS, 2 * W + BS + 3, 0]  # the last row pads
    tables = {g: [] for g in ("swa", "full")}
    for p in positions[:-1]:
        blocks = [int(b) for b in rng.permutation(90)[: p // BS + 1]]
        tables["full"].append(blocks)
        tables["swa"].append([-1 if (i + 1) * BS <= p - W + 1 else b for i, b in enumerate(blocks)])  # released
    for g in tables:
        tables[g].append([null])
    dev = {}
    for g, rows in tables.items():
        t = np.full((len(rows), width), -1, np.int32)
        for b, row in enumerate(rows):
            t[b, : len(row)] = row
        dev[g] = paddle.to_tensor(t)
    ids = [int(x) for x in rng.integers(0, 500, len(positions))]
    meta = builder.build_decode(paddle.to_tensor(ids), paddle.to_tensor(positions), dev, bound)
    assert meta.captured and not meta.seq_lens_encoder.any() and (meta.seq_lens_decoder == bound - 1).all()
    for g, rows in tables.items():
        want = [row[p // BS] * BS + p % BS for row, p in zip(rows, positions, strict=True)]
        np.testing.assert_array_equal(meta.slot_mapping[g].numpy(), want)
    swa_plan, full_plan = meta.attn[f"swa:{W}"], meta.attn["full"]
    ((group,),) = [swa_plan.groups]
    assert group.tokens is None and group.form == "absorbed"
    topk = swa_plan.indices.shape[1]
    want = np.stack([window_slots(t, p, W, topk) for t, p in zip(tables["swa"], positions, strict=True)])
    np.testing.assert_array_equal(swa_plan.indices.numpy(), want)
    (fgroup,) = full_plan.groups
    topk = fgroup.indices.shape[1]
    assert topk >= bound
    want = np.stack([window_slots(t, p, p + 1, topk) for t, p in zip(tables["full"], positions, strict=True)])
    np.testing.assert_array_equal(fgroup.indices.numpy(), want)


def test_captured_dense_decode_reads_device_tables(rng, monkeypatch):
    """FlashMLA's dense decode of a captured step: the device block table and position + 1."""
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla([]))
    kernels = KernelConfig(sparse_mla_provider="flashmla", mla_prefill_form="absorbed")
    builder = ForwardMetaBuilder(BS, [full(kernels, kv_cache_dtype="bf16")], kernels)
    table = rng.integers(0, 50, (3, 4)).astype(np.int32)
    pos = [5, 63, 17]
    meta = builder.build_decode(
        paddle.to_tensor([1, 2, 3]), paddle.to_tensor(pos), {"full": paddle.to_tensor(table)}, 64
    )
    (group,) = meta.attn["full"].groups
    assert group.form == "decode" and group.indices is None
    np.testing.assert_array_equal(group.dense_decode.block_table.numpy(), table)
    np.testing.assert_array_equal(group.dense_decode.cache_seqlens.numpy(), [6, 64, 18])
