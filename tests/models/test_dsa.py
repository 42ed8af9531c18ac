"""DSA layers (DeepSeek-V3.2's lightning indexer, issue 39) in the engine against the float64
reference model, on tiny V3.2 checkpoints (block_size 16, index_topk 16, NaN-poisoned caches):
every layer indexed, and a hybrid of window, indexed and full layers. Sequences reach 4 x
index_topk, so the indexer's pick decides (dense attention is far off there); prefill chunks
below, at and above index_topk, decodes, prefix hits shorter and longer than index_topk, and mixed
batches all give the model's logits. The unquantized path (kv_cache_dtype auto) is held to
float32 rounding; the FP8 path (656-byte records + 132-byte index keys) to the float64 model of
the same quantized math. The indexer cache's byte layout is checked against DeepGEMM's paged one."""

import json

import numpy as np
import paddle
import pytest
from model_harness import Harness, assert_close_with_routing_flips, position_errors
from ref import e4m3_decode, pow2_e4m3_ref

from fastdeploy.config import KernelConfig
from fastdeploy.model_executor.models.deepseek_v3_reference import forward, load_np
from fastdeploy.model_executor.ops.triton_ops.lightning_indexer import read_index_keys_ref, write_index_keys_ref
from fastdeploy.tools.make_tiny_model import make_tiny_model

BS, TOPK = 16, 16


@pytest.fixture(scope="module")
def v32_dir(tmp_path_factory):  # every layer indexed: model_type deepseek_v32
    return make_tiny_model(str(tmp_path_factory.mktemp("v32")), seed=7, dsa_layers=[0, 1, 2, 3], index_topk=TOPK)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):  # layer 0 SWA (W 16), 1 and 3 indexed, 2 full
    d = tmp_path_factory.mktemp("hybrid")
    return make_tiny_model(str(d), seed=8, swa_layers=[0], dsa_layers=[1, 3], index_topk=TOPK, sliding_window=16)


def reference(d, ids, fp8=False):
    cfg = json.load(open(f"{d}/config.json"))
    kinds = cfg.get("layer_types") or ["indexed_attention"] * cfg["num_hidden_layers"]
    windows = [cfg["sliding_window"] if k == "sliding_attention" else None for k in kinds]
    formats = ["fp8" if w or (fp8 and k == "indexed_attention") else None for w, k in zip(windows, kinds, strict=True)]
    return forward(load_np(d), cfg, ids, windows=windows, kv_formats=formats, index_fp8=fp8)


def dense(d, ids):
    cfg = json.load(open(f"{d}/config.json"))
    return forward(load_np(d), {**cfg, "layer_types": ["full_attention"] * cfg["num_hidden_layers"]}, ids)


def run(h, rid, ids, prefill_chunks, start=0):
    """Prefill ids[start:] in chunks of the given sizes (the last repeated), then decode the rest
    one at a time once ``prefill_chunks`` sums past len; -> logits of ids[start:]."""
    out, p = [], start
    for c in prefill_chunks:
        if p >= len(ids):
            break
        out.append(h.step([(rid, ids[p : p + c])])[rid])
        p += c
    for t in ids[p:]:
        out.append(h.step([(rid, [t])], decode={rid})[rid])
    return np.concatenate(out)


def ids_of(rng, n):
    return [int(x) for x in rng.integers(2, 500, n)]


@pytest.mark.parametrize(
    "chunks",
    [[4 * TOPK + 8], [TOPK - 1] * 3, [TOPK] * 2, [TOPK + 1, 2 * TOPK + 3], [2 * TOPK + 5]],
    ids=["whole", "below_topk", "at_topk", "above_topk", "prefill_then_decodes"],
)
def test_v32_equals_the_float64_model(chunks, v32_dir, rng):
    """72 tokens (4 x index_topk + a block's half): each position's logits within float32 rounding of
    the float64 model, whatever the chunking; dense attention differs by far more past index_topk."""
    ids = ids_of(rng, 4 * TOPK + 8)
    want = reference(v32_dir, ids)
    got = run(Harness(v32_dir, block_size=BS, seed=int(rng.integers(1 << 16))), "a", ids, chunks)
    e = position_errors(got, want)
    assert e.max() < 2e-5, e
    far = position_errors(dense(v32_dir, ids), want)
    assert far[TOPK:].max() > 1e-2 and far[:TOPK].max() < 2e-5  # the pick decides past index_topk only


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_triton_path_equals_the_reference_path(kv, v32_dir, rng):
    """One DSA layer on the Triton kernels (the index logits kernel, sparse MLA, cache writes;
    interpreter) and on the paddle references, fed the same random hidden states: a prefill chunk
    across index_topk, a mixed step, then decodes past 4 x index_topk. Each step's output within
    the sparse MLA kernel's bf16 rounding (a query whose pick flips on a float32 near-tie in its
    scores may move more: bounded by the 90th percentile)."""
    kernels = KernelConfig(triton=True, sparse_mla_provider="triton", mla_prefill_form="absorbed", index_triton=True)
    seed = int(rng.integers(1 << 16))
    ours, ref = (Harness(v32_dir, block_size=BS, kv_cache_dtype=kv, kernels=k, seed=seed) for k in (kernels, None))
    steps = [([("a", 19)], set()), ([("a", 2 * TOPK), ("b", TOPK + 2)], set())]
    steps += [([("a", 1), ("b", 1)], {"a", "b"})] * (2 * TOPK)
    errs = []
    for batch, decode in steps:
        x = paddle.to_tensor(rng.standard_normal((sum(n for _, n in batch), 128)).astype(np.float32))
        outs = []
        for h in (ours, ref):
            meta = h.build_meta([(rid, [5] * n) for rid, n in batch], decode)
            with paddle.no_grad():
                outs.append(h.model.model.layers[2].self_attn(x, h.caches[2], meta).numpy().astype(np.float64))
        errs.append(position_errors(*outs))
    e = np.concatenate(errs)
    assert np.median(e) < 1e-2 and np.quantile(e, 0.9) < 5e-2, (np.median(e), np.quantile(e, 0.9), e.max())


@pytest.mark.parametrize("hit", [TOPK, 3 * TOPK], ids=["hit_at_topk", "hit_past_topk"])
def test_prefix_hits_and_mixed_batches(hit, v32_dir, rng):
    """b starts with a's first ``hit`` tokens cached (a prefix hit) and prefills its rest while a
    decodes in the same steps; both equal the float64 model."""
    h = Harness(v32_dir, block_size=BS, seed=int(rng.integers(1 << 16)))
    a = ids_of(rng, 4 * TOPK + 4)
    b = a[:hit] + ids_of(rng, 4 * TOPK + 4 - hit)
    got_a = [h.step([("a", a[: 3 * TOPK])])["a"]]
    h.share_prefix("a", "b", hit)
    got_b, p = [], hit
    for t in a[3 * TOPK :]:
        c = b[p : p + 7]
        out = h.step([("a", [t])] + ([("b", c)] if c else []), decode={"a"})
        got_a.append(out["a"])
        if c:
            got_b.append(out["b"])
            p += len(c)
    got_b += [h.step([("b", [t])], decode={"b"})["b"] for t in b[p:]]
    assert position_errors(np.concatenate(got_a), reference(v32_dir, a)).max() < 2e-5
    assert position_errors(np.concatenate(got_b), reference(v32_dir, b)[hit:]).max() < 2e-5


def test_hybrid_of_window_indexed_and_full_layers(hybrid_dir, rng):
    """SWA, DSA and full layers in one model, each reading its own index set: chunks across the
    window and index_topk, then decodes, against the float64 model (the window layer's FP8 records
    give its rounding)."""
    ids = ids_of(rng, 4 * TOPK + 8)
    got = run(Harness(hybrid_dir, block_size=BS), "a", ids, [TOPK + 3, TOPK - 2, 2 * TOPK])
    assert position_errors(got, reference(hybrid_dir, ids)).max() < 2e-5


def test_fp8_path_equals_the_quantized_float64_model(v32_dir, rng):
    """kv_cache_dtype fp8: each DSA layer keeps 656-byte records and 132-byte e4m3 index keys. Against
    the float64 model of that math (records rounded as stored, q and k quantized per vector with
    power-of-two scales), within the bound the FP8 window layers state (a value on an e4m3
    rounding boundary in float32, a near-tie in the pick or a routing flip moves a position); the
    unquantized model is further off."""
    ids = ids_of(rng, 4 * TOPK + 8)
    got = run(Harness(v32_dir, block_size=BS, kv_cache_dtype="fp8"), "a", ids, [TOPK + 5, 2 * TOPK])
    e = assert_close_with_routing_flips(got, reference(v32_dir, ids, fp8=True), 1e-2, 5e-2)
    assert position_errors(got, reference(v32_dir, ids)).max() > 5 * e.max(), e


def test_mha_form_only_while_the_pick_keeps_everything(v32_dir, rng):
    """With the MHA prefill form forced, a request whose context ends within index_topk goes the MHA
    form (it sees every key either way), a longer one stays absorbed (its pick decides); both give
    the model's logits."""
    h = Harness(v32_dir, block_size=BS, kernels=KernelConfig(mla_prefill_form="mha"))
    short, long = ids_of(rng, TOPK), ids_of(rng, 3 * TOPK)
    meta = h.build_meta([("s", short), ("l", long)])
    plan = meta.attn[f"dsa:{TOPK}"]
    assert {g.form: list(g.requests) for g in plan.groups} == {"mha": [0], "absorbed": [1]}
    hidden = h.model(meta, h.caches[:4])
    logits = h.model.compute_logits(hidden).numpy().astype(np.float64)
    assert position_errors(logits[:TOPK], reference(v32_dir, short)).max() < 2e-5
    assert position_errors(logits[TOPK:], reference(v32_dir, long)).max() < 2e-5


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "unquantized"])
def test_index_cache_layout(fp8, rng):
    """Keys written at random slots (one -1) land where DeepGEMM's paged layout puts them: block b's
    page is bs * (D + 4) bytes, the bs keys' e4m3 codes first, then their float32 scales; they read
    back as written (FP8: the pow2 e4m3 reference's values and scales); every other byte keeps its
    poison, and slot -1 writes only the null block's last slot."""
    N, D, T = 6, 128, 9
    shape = [N, BS, 1, D + 4] if fp8 else [N, BS, 1, D]
    cache = paddle.full(shape, 0xFF if fp8 else float("nan"), "uint8" if fp8 else "float32")
    k = (rng.standard_normal((T, D)) * 10.0 ** rng.uniform(-2, 2, (T, 1))).astype(np.float32)
    slots = rng.choice((N - 1) * BS, T, replace=False).astype(np.int32)
    slots[4] = -1
    write_index_keys_ref(paddle.to_tensor(k), paddle.to_tensor(slots), cache)
    slots[4] = N * BS - 1
    got, scale = read_index_keys_ref(cache, paddle.to_tensor(slots.astype(np.int64)))
    if not fp8:
        np.testing.assert_array_equal(got.numpy(), k)
        assert scale is None and np.isnan(np.delete(cache.numpy().reshape(-1, D), slots, 0)).all()
        return
    want_v, want_s = pow2_e4m3_ref(k.astype(np.float64))
    np.testing.assert_array_equal(got.numpy(), want_v)
    np.testing.assert_array_equal(scale.numpy(), want_s)
    pages = cache.numpy().reshape(N, BS * (D + 4))
    touched = np.zeros_like(pages, bool)
    for t, s in enumerate(slots):
        b, o = divmod(int(s), BS)
        codes = pages[b, o * D : (o + 1) * D]
        np.testing.assert_array_equal(e4m3_decode(codes), want_v[t])
        assert pages[b, BS * D + 4 * o : BS * D + 4 * o + 4].copy().view("<f4")[0] == want_s[t]
        touched[b, o * D : (o + 1) * D] = touched[b, BS * D + 4 * o : BS * D + 4 * o + 4] = True
    assert (pages[~touched] == 0xFF).all()
