"""The prefill form cost model: the pair count against a brute-force count, and the choices it
makes at the shapes measured on the H200 (benchmarks/README.md, MLA prefill) and on CPU."""

import pytest

from fastdeploy.model_executor.layers.attention.prefill_form import (
    CPU_REFERENCE_RATES,
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


# one prompt from position 0 through the tiny checkpoint on 2 cores (benchmarks/README.md, MLA
# prefill forms on CPU): tokens, MHA seconds, absorbed seconds
CPU_MEASURED = [(256, 0.07, 1.67), (650, 0.40, 8.11), (1300, 0.80, 29.1), (2048, 2.34, 70.5)]


@pytest.mark.parametrize("tokens, mha_s, absorbed_s", CPU_MEASURED)
def test_cpu_rates_price_the_measured_prefills(tokens, mha_s, absorbed_s):
    # the tiny checkpoint's four layers (W 32, full, W 32, full) at 4 heads, one chunk
    layers = [prefill_seconds(tokens, 0, w, 4, CPU_REFERENCE_RATES) for w in (32, 0, 32, 0)]
    # within 2x of what was measured, but for the MHA form at 256 tokens: its fixed cost and the
    # parts of the model both forms share are priced from longer prompts (modelled 0.15 s)
    for form, measured in (("mha", mha_s), ("absorbed", absorbed_s)):
        high = 2.2 if (form, tokens) == ("mha", 256) else 2
        assert 0.5 * measured < sum(c[form] for c in layers) < high * measured, form
    for w in (32, 0):  # every layer sends a whole prompt to the MHA form, the faster one measured
        assert choose_prefill_form("auto", tokens, 0, w, 4, CPU_REFERENCE_RATES) == "mha"
    # one token over that context (a chunk's tail): decompressing every key does not pay
    assert choose_prefill_form("auto", 1, tokens, 0, 4, CPU_REFERENCE_RATES) == "absorbed"


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
