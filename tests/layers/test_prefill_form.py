"""The prefill form cost model: the pair count against a brute-force count, and the choices it
makes at the shapes measured on the H200 (benchmarks/README.md, MLA prefill)."""

import pytest

from fastdeploy.model_executor.layers.attention.prefill_form import (
    attended_pairs,
    choose_prefill_form,
    prefill_seconds,
)


@pytest.mark.parametrize("window", [0, 1, 7, 16, 17, 100])
@pytest.mark.parametrize("chunk, start", [(1, 0), (1, 50), (5, 0), (16, 14), (40, 3), (33, 100)])
def test_attended_pairs_brute_force(chunk, start, window):
    want = sum(min(window, p + 1) if window > 0 else p + 1 for p in range(start, start + chunk))
    assert attended_pairs(chunk, start, window) == want


def test_choices_at_measured_shapes():
    # 128 heads, C = W = 4096 after 4096 of context: MHA (measured 3.63 ms all in vs 20.99 absorbed)
    assert choose_prefill_form("auto", 4096, 4096, 4096, 128) == "mha"
    cost = prefill_seconds(4096, 4096, 4096, 128)
    assert 3.3e-3 < cost["mha"] < 4.0e-3 and 19e-3 < cost["absorbed"] < 23e-3
    # W 128: decompressing 4223 keys still pays (measured 0.57 ms vs 0.98)
    assert choose_prefill_form("auto", 4096, 4096, 128, 128) == "mha"
    # a few tokens over a long context: decompressing the whole window does not pay
    for chunk in (1, 8, 32):
        assert choose_prefill_form("auto", chunk, 8192, 4096, 128) == "absorbed"
        assert choose_prefill_form("auto", chunk, 30000, 0, 16) == "absorbed"
    assert choose_prefill_form("auto", 2048, 30000, 0, 16) == "mha"
    assert choose_prefill_form("absorbed", 4096, 4096, 4096, 128) == "absorbed"
    assert choose_prefill_form("mha", 1, 4096, 4096, 128) == "mha"


@pytest.mark.parametrize("window", [16, 128])
@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_keys_in_view_stop_growing_at_the_window(window, chunk):
    """From start W - 1 on, every query of the chunk sees W keys and the window in view before the
    chunk is W - 1 keys: both forms cost the same however far the chunk is; one position earlier
    the MHA form decompresses one key less. A full layer's cost keeps growing with the start."""
    at, far = prefill_seconds(chunk, window - 1, window, 8), prefill_seconds(chunk, window + 57, window, 8)
    assert at == far
    before = prefill_seconds(chunk, window - 2, window, 8)
    assert before["mha"] < at["mha"] and before["absorbed"] <= at["absorbed"]
    full = [prefill_seconds(chunk, s, 0, 8)["mha"] for s in (window - 1, window, window + 57)]
    assert full[0] < full[1] < full[2]


def test_the_step_builder_sends_each_prefill_request_to_its_form():
    """One mixed step through the builder with mla_prefill_form "auto" (128 heads, W 4096): long
    chunks go MHA (2048 from 0; 1024 after 5000 tokens), a 2-token chunk after 3000 tokens and a
    decode stay absorbed, each as the cost model's shapes say (see test_choices_at_measured_shapes)."""
    from fastdeploy.config import KernelConfig
    from fastdeploy.model_executor.forward_meta import ForwardMetaBuilder
    from fastdeploy.model_executor.layers.attention.dsa_attention_backend import DSAAttentionBackend

    kernels = KernelConfig(triton=False, sparse_mla_provider="reference", mla_prefill_form="auto")
    builder = ForwardMetaBuilder(16, [DSAAttentionBackend(0.1, 4096, kernels, 128, "float32")], kernels)
    chunks, starts = [2048, 2, 1, 1024], [0, 3000, 500, 5000]
    enc = [2048, 2, 0, 1024]
    tables, first = [], 0
    for c, s in zip(chunks, starts, strict=True):
        n = (s + c + 15) // 16
        tables.append(list(range(first, first + n)))
        first += n
    meta = builder.build(list(range(sum(chunks))), enc, starts, {"swa": tables})
    forms = {g.form: g.requests.tolist() for g in meta.attn["swa:4096"].groups}
    assert forms == {"mha": [0, 3], "absorbed": [1, 2]}
