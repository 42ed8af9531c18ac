"""ops/fp8_numerics.py, the one home of e4m3 encoding and block scales, against brute force from
the format's definition (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; S.1111.111 NaN)."""

import numpy as np
import pytest

from fastdeploy.model_executor.ops.fp8_numerics import (
    E4M3_TO_F32,
    FP8_MAX,
    dequant_fp8_blocks,
    e4m3_encode,
    quantize_fp8_blocks,
)


def values_by_definition() -> np.ndarray:
    out = []
    for code in range(256):
        s, e, m = code >> 7, (code >> 3) & 15, code & 7
        v = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        out.append(np.nan if (e, m) == (15, 7) else (-v if s else v))
    return np.array(out)


def test_table_and_max():
    want = values_by_definition()
    np.testing.assert_array_equal(E4M3_TO_F32.astype(np.float64), want)
    assert FP8_MAX == np.nanmax(want) == 448.0


def test_encode_is_nearest_ties_to_even(rng):
    vals = values_by_definition()
    finite = [c for c in range(256) if np.isfinite(vals[c])]
    x = np.concatenate(
        [
            rng.uniform(-448, 448, 3000),
            rng.standard_normal(3000) * 2.0**-7,  # subnormals
            (vals[1:126] + vals[2:127]) / 2,  # exact ties between neighbours
            vals[finite],
        ]
    ).astype(np.float32)
    got = e4m3_encode(x)
    for xi, c in zip(x, got, strict=True):
        d = np.abs(vals[finite] - float(xi))
        best = [finite[i] for i in np.flatnonzero(d == d.min())]
        if len(best) > 1:  # a tie: the even code of the same sign (+0 and -0 both code for 0)
            best = [b for b in best if b % 2 == 0 and (b >> 7) == (1 if xi < 0 else 0)] or best
        assert vals[c] == vals[best[0]] and (len(best) == 1 or c % 2 == 0), (xi, c, best)


@pytest.mark.parametrize("shape", [(130, 257), (1, 128), (256, 3)])
def test_block_scales_round_trip(shape, rng):
    w = rng.standard_normal(shape) * rng.uniform(0.01, 10, (shape[0], 1))
    codes, scale = quantize_fp8_blocks(w.astype(np.float32))
    assert codes.dtype == np.uint8 and scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = dequant_fp8_blocks(codes, scale).astype(np.float64)
    full = np.kron(scale.astype(np.float64), np.ones((128, 128)))[: shape[0], : shape[1]]
    assert (np.abs(back - w) <= full * 16 + 1e-30).all()  # half an e4m3 step at the top binade: 16 x scale
    np.testing.assert_allclose(back, values_by_definition()[codes] * full, rtol=1e-6)  # a float32 product
    with pytest.raises(ValueError, match="expected"):
        dequant_fp8_blocks(codes, scale[:, :1] if scale.shape[1] > 1 else scale[:0])


def test_the_float64_reference_has_its_own_e4m3_and_torch_agrees(rng):
    """The float64 reference model rounds to e4m3 with its own table and search (it imports no
    code under test); both agree with torch's float8_e4m3fn cast, an implementation of the format
    outside this project, on random values, every midpoint between neighbours (ties to the even
    code) and the extremes."""
    import torch

    from fastdeploy.model_executor.models.deepseek_v3_reference import E4M3, e4m3_round

    np.testing.assert_array_equal(E4M3, values_by_definition())
    torch_table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).numpy()
    np.testing.assert_array_equal(E4M3, torch_table)
    pos = E4M3[:127]
    mids = (pos[:-1] + pos[1:]) / 2
    x = np.concatenate([rng.uniform(-448, 448, 20000), rng.standard_normal(20000) * 1e-2, mids, -mids, [448, -448, 0]])
    want = torch.tensor(x).to(torch.float8_e4m3fn).to(torch.float64).numpy()
    np.testing.assert_array_equal(e4m3_round(x), want)
    np.testing.assert_array_equal(E4M3_TO_F32[e4m3_encode(x)].astype(np.float64), want)
    assert e4m3_round(x[:21].reshape(3, 7)).shape == (3, 7)
