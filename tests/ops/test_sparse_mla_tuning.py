"""The recorded sparse MLA tuning: tile choice and split-KV counts keep the properties the H200
sweeps chose them for (benchmarks/README.md)."""

import itertools

import triton

from fastdeploy.model_executor.ops.triton_ops.sparse_mla_kernel import (
    TUNED_NARROW,
    TUNED_WIDE,
    default_num_splits,
    tuned_config,
)

SMS = 132


def test_tile_choice():
    assert tuned_config(1, 128) is TUNED_WIDE and tuned_config(4096, 64) is TUNED_WIDE
    assert tuned_config(128, 16) is TUNED_WIDE  # decodes below 64 heads: pipelined gathers win
    assert tuned_config(4096, 16) is TUNED_NARROW  # enough 16-head programs without splitting
    assert tuned_config(263, 16) is TUNED_WIDE and tuned_config(264, 16) is TUNED_NARROW


def test_splits_fill_whole_waves_and_keep_two_tiles():
    for T, H, topk in itertools.product(
        [1, 2, 7, 33, 64, 100, 128, 131, 132, 300, 4096], [16, 64, 128], [64, 128, 1000, 4096]
    ):
        cfg = tuned_config(T, H)
        bh, bn = cfg["block_h"], cfg["block_n"]
        programs = T * triton.cdiv(H, bh)
        slots = SMS if bh >= 64 else 2 * SMS  # programs an SM holds at once: wide 1, narrow 2
        s = default_num_splits(T, H, topk, bh, bn, SMS)
        assert 1 <= s <= 32
        if programs >= slots:
            assert s == 1, (T, H, topk)
        if s > 1:
            assert programs * s <= 2 * SMS, (T, H, topk, s)  # never a part wave past the target
            assert triton.cdiv(topk, s) >= 2 * bn or s == triton.cdiv(topk, 2 * bn)
            assert programs * (s + 1) > 2 * SMS or s == min(triton.cdiv(topk, 2 * bn), 32)
