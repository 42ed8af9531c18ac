"""The 656-byte record: byte layout decoded independently with numpy, round trip, skipped slots."""

import numpy as np
import paddle
import pytest
from ref import decode_records

from fastdeploy.model_executor.ops.triton_ops import mla_fp8_cache as m


def random_inputs(rng, T):
    # tiles of very different magnitudes, some all-zero tiles, tiny values (subnormal codes)
    mag = 10.0 ** rng.uniform(-6, 4, size=(T, 4, 1))
    x = rng.standard_normal((T, 4, 128)) * mag
    x[rng.random((T, 4)) < 0.1] = 0.0
    x = x.reshape(T, 512)
    pe = rng.standard_normal((T, 64)) * 3
    return paddle.to_tensor(x, dtype="float32").astype("bfloat16"), paddle.to_tensor(pe, dtype="float32").astype(
        "bfloat16"
    )


def expected_scale(amax: np.ndarray) -> np.ndarray:
    s = (amax.astype(np.float32) / np.float32(448)).astype(np.float64)
    e = np.ceil(np.log2(np.where(s > 0, s, 1.0)))
    return np.where(amax > 0, 2.0 ** np.maximum(e, -126), 1.0)


@pytest.mark.parametrize("writer", [m.write_mla_fp8_cache, m.write_mla_fp8_cache_ref], ids=["triton", "ref"])
@pytest.mark.parametrize("block_size", [64, 16])
def test_layout_roundtrip_and_skipped_slots(writer, block_size, rng):
    T, num_blocks = 37, 5
    kv_c, k_pe = random_inputs(rng, T)
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int32)
    slots[rng.random(T) < 0.2] = -1
    poison = rng.integers(0, 256, (num_blocks, block_size, 1, 656), dtype=np.uint8)
    cache = paddle.to_tensor(poison.copy())
    writer(kv_c, k_pe, paddle.to_tensor(slots), cache)
    got = cache.numpy().reshape(-1, 656)
    written = slots[slots >= 0]
    untouched = np.setdiff1d(np.arange(num_blocks * block_size), written)
    np.testing.assert_array_equal(got[untouched], poison.reshape(-1, 656)[untouched])

    x = kv_c.astype("float32").numpy().astype(np.float64)[slots >= 0]
    pe = k_pe.astype("float32").numpy().astype(np.float64)[slots >= 0]
    lat, scales, rope = decode_records(got[written])
    np.testing.assert_array_equal(rope, pe)
    amax = np.abs(x.reshape(-1, 4, 128)).max(-1)
    np.testing.assert_array_equal(scales, expected_scale(amax))
    # each element is the nearest e4m3 value of x / scale: error within half a quantum
    sc = np.repeat(scales, 128, axis=1).astype(np.float64)
    y = np.abs(x) / sc
    quantum = 2.0 ** (np.floor(np.log2(np.maximum(y, 2.0**-6))) - 3)
    assert np.all(np.abs(x - lat) <= 0.5 * quantum * sc)
    assert np.all(np.abs(x - lat) <= 2.0**-4 * np.abs(x) + 2.0**-10 * sc)


def test_triton_and_reference_bytes_equal(rng):
    T = 50
    kv_c, k_pe = random_inputs(rng, T)
    slots = paddle.to_tensor(np.arange(T, dtype=np.int32)[::-1].copy())
    a = paddle.zeros([1, 64, 1, 656], dtype="uint8")
    b = paddle.zeros([1, 64, 1, 656], dtype="uint8")
    m.write_mla_fp8_cache(kv_c, k_pe, slots, a)
    m.write_mla_fp8_cache_ref(kv_c, k_pe, slots, b)
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_ties_round_to_even_and_saturation():
    # with scale 1 (amax 448): 1.0625 lies between 1.0 (code 56) and 1.125 (57): even -> 56;
    # 17 between 16 (88) and 18 (89) -> 88; 2^-10 between 0 and 2^-9 -> 0; 3 * 2^-10 -> 2 * 2^-9
    vals = [448.0, 1.0625, 17.0, 2.0**-10, 3 * 2.0**-10, -1.1875, 0.0]
    x = np.zeros((1, 512), np.float32)
    x[0, : len(vals)] = vals
    kv = paddle.to_tensor(x)
    pe = paddle.zeros([1, 64])
    for writer in (m.write_mla_fp8_cache, m.write_mla_fp8_cache_ref):
        cache = paddle.zeros([1, 1, 1, 656], dtype="uint8")
        writer(kv, pe, paddle.to_tensor([0], dtype="int32"), cache)
        codes = cache.numpy().reshape(656)[: len(vals)]
        assert codes.tolist() == [126, 56, 88, 0, 2, 128 + 58, 0], writer.__name__


@pytest.mark.parametrize("deq", [m.dequant_mla_fp8_cache, m.dequant_mla_fp8_cache_ref], ids=["triton", "ref"])
def test_dequant_matches_numpy_decode(deq, rng):
    kv_c, k_pe = random_inputs(rng, 21)
    cache = paddle.zeros([3, 8, 1, 656], dtype="uint8")
    m.write_mla_fp8_cache_ref(kv_c, k_pe, paddle.to_tensor(np.arange(21, dtype=np.int32)), cache)
    out = deq(cache)
    assert out.dtype == paddle.bfloat16 and list(out.shape) == [3, 8, 1, 576]
    lat, _, rope = decode_records(cache.numpy().reshape(-1, 656))
    want = np.concatenate([lat, rope], axis=1).reshape(3, 8, 1, 576)
    got = out.astype("float32").numpy()
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=0)
    gathered = deq(cache.reshape([-1, 656])[paddle.to_tensor([5, 2])])
    np.testing.assert_array_equal(gathered.astype("float32").numpy(), got.reshape(-1, 576)[[5, 2]])


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="kv_c"):
        m.write_mla_fp8_cache(
            paddle.zeros([2, 500]),
            paddle.zeros([2, 64]),
            paddle.zeros([2], "int32"),
            paddle.zeros([1, 4, 1, 656], "uint8"),
        )
    with pytest.raises(ValueError, match="cache"):
        m.write_mla_fp8_cache(
            paddle.zeros([2, 512]),
            paddle.zeros([2, 64]),
            paddle.zeros([2], "int32"),
            paddle.zeros([1, 4, 1, 576], "bfloat16"),
        )
    with pytest.raises(ValueError, match="records"):
        m.dequant_mla_fp8_cache(paddle.zeros([4, 576], "uint8"))
    m.write_mla_fp8_cache_ref(
        paddle.zeros([1, 512]),
        paddle.zeros([1, 64]),
        paddle.to_tensor([-1], "int32"),
        paddle.zeros([1, 4, 1, 656], "uint8"),
    )
    m.launch_write_mla_fp8_cache(
        paddle.zeros([0, 512]), paddle.zeros([0, 64]), paddle.zeros([0], "int32"), paddle.zeros([1, 4, 1, 656], "uint8")
    )
