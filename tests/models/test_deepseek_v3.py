"""The paddle DeepSeek-V3 against the independent float64 model, and step-shape invariance:
prefill + decodes, chunked prefill and mixed batches give the logits of one-shot prefill."""

import json

import numpy as np
import paddle
import pytest
from model_harness import Harness, assert_close_with_routing_flips, position_errors, rel

from fastdeploy.model_executor.models.deepseek_v3_reference import forward, load_np
from fastdeploy.tools.make_tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("full")), seed=1, swa_layers=[])


@pytest.fixture(scope="module")
def ref_weights(full_dir):
    return load_np(full_dir), json.load(open(f"{full_dir}/config.json"))


def tokens(rng, n):
    return [int(x) for x in rng.integers(0, 500, n)]


def test_matches_float64_reference(full_dir, ref_weights, rng):
    ids = tokens(rng, 100)
    got = Harness(full_dir).prefill("a", ids)
    w, cfg = ref_weights
    want = forward(w, cfg, ids)
    assert rel(got[-1], want[-1]) < 1e-4
    assert rel(got, want) < 1e-4


def test_prefill_then_40_decodes_equals_one_prefill(full_dir, rng):
    ids = tokens(rng, 70)
    one = Harness(full_dir, seed=1).prefill("a", ids)
    h = Harness(full_dir, seed=2)
    h.prefill("a", ids[:30])
    for i in range(30, 70):
        got = h.step([("a", [ids[i]])], decode={"a"})["a"][0]
        assert rel(got, one[i]) < 1e-5, i


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_shot(full_dir, chunk, rng):
    ids = tokens(rng, 80)
    one = Harness(full_dir, seed=3).prefill("a", ids)
    got = Harness(full_dir, seed=4).prefill("a", ids, chunk=chunk)
    assert rel(got, one) < 1e-5


def test_mixed_batch_equals_alone(full_dir, rng):
    """One new prefill, one chunked-prefill continuation and two decodes in one step."""
    seqs = {k: tokens(rng, n) for k, n in (("new", 37), ("cont", 60), ("d1", 45), ("d2", 20))}
    alone = {k: Harness(full_dir, seed=5).prefill(k, v) for k, v in seqs.items()}
    h = Harness(full_dir, seed=6)
    h.prefill("cont", seqs["cont"][:25])
    h.prefill("d1", seqs["d1"][:-1])
    h.prefill("d2", seqs["d2"][:-1])
    out = h.step(
        [("d1", seqs["d1"][-1:]), ("new", seqs["new"]), ("d2", seqs["d2"][-1:]), ("cont", seqs["cont"][25:])],
        decode={"d1", "d2"},
    )
    assert rel(out["new"], alone["new"]) < 1e-5
    assert rel(out["cont"], alone["cont"][25:]) < 1e-5
    assert rel(out["d1"][0], alone["d1"][-1]) < 1e-5
    assert rel(out["d2"][0], alone["d2"][-1]) < 1e-5


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_quantized_full_layer_caches(full_dir, ref_weights, kv, rng):
    """bf16 or FP8-record caches on full layers: small, visible error; with FP8 the reference that
    rounds every layer's kv_c / k_pe like the record agrees closely."""
    ids = tokens(rng, 50)
    got = Harness(full_dir, kv_cache_dtype=kv).prefill("a", ids)
    w, cfg = ref_weights
    exact = position_errors(got, forward(w, cfg, ids))
    assert np.median(exact) > 1e-6  # the quantization is there
    stored = forward(w, cfg, ids, kv_formats=[kv] * cfg["num_hidden_layers"])
    assert_close_with_routing_flips(got, stored, 1e-2, 5e-2)


def test_absorbed_weights_are_prepared_once_after_loading(full_dir, rng):
    """load_weights splits kv_b_proj into W_UK / W_UV once; a forward reads those, not kv_b_proj,
    until process_weights_after_loading runs again."""
    ids = tokens(rng, 20)
    h = Harness(full_dir)
    attn = h.model.model.layers[0].self_attn
    cfg = h.cfg
    w = attn.kv_b_proj.weight.numpy().reshape(cfg.num_attention_heads, -1, 512)
    np.testing.assert_array_equal(attn.w_uk.numpy(), w[:, : cfg.qk_nope_head_dim])
    np.testing.assert_array_equal(attn.w_uv.numpy(), w[:, cfg.qk_nope_head_dim :])
    before = Harness(full_dir).prefill("a", ids)
    attn.kv_b_proj.weight.set_value(paddle.zeros_like(attn.kv_b_proj.weight))
    assert rel(h.prefill("a", ids), before) < 1e-6  # the prepared weights, not the zeroed projection
    attn.process_weights_after_loading()
    assert rel(Harness(full_dir).prefill("b", ids), before) < 1e-6  # a fresh load is unaffected
    assert rel(h.prefill("c", ids), before) > 1e-2  # now the zeroed projection counts
