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
