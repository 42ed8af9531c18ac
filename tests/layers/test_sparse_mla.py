"""sparse_mla_attention: every provider against a float64 numpy reference over the de-quantized
cache. Every slot that no index names is NaN (0xFF bytes: NaN scale, NaN fp8, NaN rope)."""

import sys

import numpy as np
import paddle
import pytest
from fake_flash_mla import fake_flash_mla
from ref import dequant_records, sparse_mla_np

from fastdeploy.config import KernelConfig
from fastdeploy.model_executor.kernel_select import select_kernels
from fastdeploy.model_executor.layers.attention import sparse_mla_providers as sm
from fastdeploy.model_executor.ops.triton_ops import sparse_mla as ops_sm
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache import write_mla_fp8_cache_ref

SCALE = 0.1352


def make_case(rng, T, H, topk, num_blocks=6, block_size=64):
    """A cache whose used slots hold random records and the rest NaN bytes, and index rows with
    -1 holes, all -1 rows, single-slot rows and repeated slots."""
    S = num_blocks * block_size
    cache = paddle.full([num_blocks, block_size, 1, 656], 0xFF, dtype="uint8")
    used = rng.permutation(S)[: S // 2].astype(np.int32)
    kv_c = paddle.to_tensor(rng.standard_normal((used.size, 512)) * rng.uniform(0.1, 4), "float32")
    k_pe = paddle.to_tensor(rng.standard_normal((used.size, 64)), "float32")
    write_mla_fp8_cache_ref(kv_c, k_pe, paddle.to_tensor(used), cache)
    idx = rng.choice(used, size=(T, topk)).astype(np.int32)
    idx[rng.random((T, topk)) < 0.3] = -1
    if T > 3:
        idx[1] = -1  # no valid slot
        idx[2] = -1
        idx[2, topk // 2] = used[0]  # one valid slot
        idx[3, : topk // 2] = used[1]  # repeated slot
    q = paddle.to_tensor(rng.standard_normal((T, H, 576)), "float32").astype("bfloat16")
    return q, cache, idx


def check(q, cache, idx, out, lse, rtol=2e-2):
    kv = dequant_records(cache.numpy().reshape(-1, 656))
    want, want_lse = sparse_mla_np(q.astype("float32").numpy(), kv, idx, SCALE)
    got = out.astype("float32").numpy()
    assert out.dtype == q.dtype and list(out.shape) == list(want.shape)
    assert lse.dtype == paddle.float32 and np.isfinite(got).all()
    err = np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-6)
    empty = ~(idx >= 0).any(-1)
    assert (err[~empty] < rtol).all(), err.max()
    assert (got[empty] == 0).all()
    got_lse = lse.numpy()
    assert np.isinf(got_lse[empty]).all() and (got_lse[empty] > 0).all()
    np.testing.assert_allclose(got_lse[~empty], want_lse[~empty], rtol=0, atol=1e-2)


@pytest.mark.parametrize("provider", ["triton", "reference"])
@pytest.mark.parametrize("T, H, topk", [(1, 16, 64), (7, 64, 100), (300, 16, 128), (5, 128, 64)])
def test_providers_match_float64(provider, T, H, topk, rng):
    q, cache, idx = make_case(rng, T, H, topk)
    out, lse = sm.sparse_mla_attention(q, cache, paddle.to_tensor(idx), SCALE, provider=provider)
    check(q, cache, idx, out, lse)


@pytest.mark.parametrize("num_splits", [2, 3, 50])
def test_triton_split_kv(num_splits, rng):
    q, cache, idx = make_case(rng, 6, 16, 300)
    idx[5, 64:] = -1  # some splits of this row are empty
    out, lse = ops_sm.sparse_mla_triton(q, cache, paddle.to_tensor(idx), SCALE, num_splits=num_splits)
    check(q, cache, idx, out, lse)


@pytest.mark.parametrize("provider", ["triton", "reference"])
@pytest.mark.parametrize("T, H, topk, num_splits", [(3, 16, 100, 1), (6, 64, 200, 1), (4, 16, 300, 3)])
def test_bf16_latent_cache(provider, T, H, topk, num_splits, rng):
    """A full layer's bf16 [..., 576] cache through the same kernel (CACHE_BF16); unused slots NaN."""
    _, _, idx = make_case(rng, T, H, topk)
    rows = rng.standard_normal((6 * 64, 576)) * rng.uniform(0.1, 4)
    named = np.zeros(6 * 64, bool)
    named[idx[idx >= 0]] = True
    rows[~named] = np.nan
    cache = paddle.to_tensor(rows.reshape(6, 64, 1, 576), "float32").astype("bfloat16")
    q = paddle.to_tensor(rng.standard_normal((T, H, 576)), "float32").astype("bfloat16")
    if provider == "triton":
        out, lse = ops_sm.sparse_mla_triton(q, cache, paddle.to_tensor(idx), SCALE, num_splits=num_splits)
    else:
        out, lse = sm.sparse_mla_attention(q, cache, paddle.to_tensor(idx), SCALE, provider=provider)
    kv = cache.astype("float32").numpy().reshape(-1, 576).astype(np.float64)
    want, want_lse = sparse_mla_np(q.astype("float32").numpy(), kv, idx, SCALE)
    got = out.astype("float32").numpy()
    empty = ~(idx >= 0).any(-1)
    err = np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-6)
    assert (err[~empty] < 2e-2).all(), err.max()
    assert (got[empty] == 0).all() and np.isinf(lse.numpy()[empty]).all()
    np.testing.assert_allclose(lse.numpy()[~empty], want_lse[~empty], rtol=0, atol=1e-2)
    # FlashMLA reads a bf16 latent cache only through its dense decode or its prefill gather
    with pytest.raises(ValueError, match="need dense_decode"):
        sm.sparse_mla_attention(q, cache, paddle.to_tensor(idx), SCALE, provider="flashmla")
    with pytest.raises(ValueError, match="bf16 for flashmla"):
        sm.sparse_mla_attention(q, cache.astype("float32"), paddle.to_tensor(idx), SCALE, provider="flashmla")


def test_reference_chunks_and_empty(rng):
    q, cache, idx = make_case(rng, 9, 16, 64)
    out, lse = ops_sm.sparse_mla_reference(q, cache, paddle.to_tensor(idx), SCALE, chunk=4)
    check(q, cache, idx, out, lse)
    out, lse = ops_sm.sparse_mla_reference(q[:0], cache, paddle.to_tensor(idx[:0]), SCALE)
    assert list(out.shape) == [0, 16, 512] and list(lse.shape) == [0, 16]


def test_bad_inputs_named(rng):
    q, cache, idx = make_case(rng, 2, 16, 64)
    with pytest.raises(ValueError, match="q must be"):
        sm.sparse_mla_attention(q[..., :512], cache, paddle.to_tensor(idx), SCALE, provider="reference")
    with pytest.raises(ValueError, match="kv_cache"):
        sm.sparse_mla_attention(q, cache.astype("int32"), paddle.to_tensor(idx), SCALE, provider="reference")
    with pytest.raises(ValueError, match="indices"):
        sm.sparse_mla_attention(q, cache, paddle.to_tensor(idx[:1]), SCALE, provider="reference")
    with pytest.raises(ValueError, match="unknown provider 'cuda'"):
        sm.sparse_mla_attention(q, cache, paddle.to_tensor(idx), SCALE, provider="cuda")
    with pytest.raises(ValueError, match="sparse_mla_provider: unknown provider 'cuda'"):
        select_kernels(sparse_mla_provider="cuda")
    with pytest.raises(ValueError, match="flash_mla"):
        select_kernels(sparse_mla_provider="flashmla")


def test_index_kernels_auto_takes_them_on_a_gpu(monkeypatch):
    """index_kernel_backend auto: the indexer kernels where the Triton kernels run on a GPU (timed
    there against the reference pick), paddle ops where they do not or when asked."""
    import fastdeploy.model_executor.kernel_select as ks

    monkeypatch.setattr(ks, "can_run_triton", lambda: True)
    monkeypatch.setattr(ks, "interpret_mode", lambda: False)
    assert ks.select_kernels().index_triton
    assert not ks.select_kernels(index_kernel_backend="reference").index_triton
    assert not ks.select_kernels("reference").index_triton


def test_kernel_selection_by_argument(monkeypatch, caplog):
    with caplog.at_level("INFO", logger="fastdeploy"):
        chosen = select_kernels()
    assert chosen == KernelConfig(triton=False, sparse_mla_provider="reference")  # interpreter mode is not a GPU
    assert sum("provider: reference" in r.message for r in caplog.records) == 1
    assert select_kernels("auto", "triton") == KernelConfig(triton=False, sparse_mla_provider="triton")
    assert select_kernels("triton") == KernelConfig(triton=True, sparse_mla_provider="triton")
    assert select_kernels("triton", "reference") == KernelConfig(triton=True, sparse_mla_provider="reference")
    with pytest.raises(ValueError, match="kernel_backend: unknown backend 'cuda'"):
        select_kernels("cuda")
    assert select_kernels("triton", index_kernel_backend="triton").index_triton  # the interpreter, when asked
    assert not select_kernels("triton").index_triton  # auto: DSA's indexer kernels only on a GPU
    with pytest.raises(ValueError, match="index_kernel_backend 'triton' needs the Triton kernels"):
        select_kernels("reference", index_kernel_backend="triton")
    with pytest.raises(ValueError, match="index_kernel_backend: unknown backend 'cuda'"):
        select_kernels(index_kernel_backend="cuda")
    with pytest.raises(ValueError, match="sparse_mla_provider must be one of"):
        KernelConfig(sparse_mla_provider="auto")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="sparse_mla_provider: 'triton' needs a CUDA"):
        select_kernels(sparse_mla_provider="triton")
    with pytest.raises(ValueError, match="kernel_backend: 'triton' needs a CUDA"):
        select_kernels("triton")


# ---------------------------------------------------------------- FlashMLA, faked


@pytest.mark.parametrize("is_prefill", [False, True])
@pytest.mark.parametrize("H", [16, 128])
def test_flashmla_provider_pads_and_slices(is_prefill, H, rng, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla(calls))
    assert select_kernels(sparse_mla_provider="flashmla").sparse_mla_provider == "flashmla"
    q, cache, idx = make_case(rng, 6, H, 72)
    idx[4, 0] = -7  # any negative becomes -1 before FlashMLA sees it
    out, lse = sm.sparse_mla_attention(
        q, cache, paddle.to_tensor(idx), SCALE, provider="flashmla", is_prefill=is_prefill
    )
    assert [c[0] for c in calls] == ["prefill" if is_prefill else "decode"]
    check(q, cache, idx, out, lse)


def test_flashmla_head_limit(rng, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla(calls))
    q, cache, idx = make_case(rng, 2, 256, 64)
    with pytest.raises(ValueError, match="128 heads"):
        sm.sparse_mla_attention(q, cache, paddle.to_tensor(idx), SCALE, provider="flashmla")
    assert calls == []
    assert sm.PROVIDERS["flashmla"].topk_multiple(True) == 128 and sm.PROVIDERS["triton"].topk_multiple(True) == 1
