"""W8A8 block-scaled linear: the Triton kernels (interpreter) and the paddle reference against a
float64 numpy reference of the same math (activations quantized per token per 128 columns,
weights de-quantized per 128 x 128 block), on shapes that are not tile multiples."""

import numpy as np
import paddle
import pytest
from ref import GRID, e4m3_round, w8a8_ref

from fastdeploy.model_executor.ops.fp8_numerics import E4M3_TO_F32
from fastdeploy.model_executor.ops.triton_ops.fp8_gemm import (
    check_fp8_weight,
    quantize_activations_ref,
    w8a8_block_linear,
    w8a8_block_linear_ref,
)
from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import launch_w8a8_gemm


def make(rng, M, N, K):
    x = (rng.standard_normal((M, K)) * rng.uniform(0.1, 10, (M, 1))).astype(np.float32)
    x[0, : min(K, 128)] = 0  # an all-zero block
    codes = rng.integers(0, 256, (N, K)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    scale = rng.uniform(1e-3, 1e-2, (-(-N // 128), -(-K // 128))).astype(np.float32)
    return x, codes, scale


@pytest.mark.parametrize("impl", [w8a8_block_linear, w8a8_block_linear_ref], ids=["triton", "ref"])
@pytest.mark.parametrize("M, N, K", [(1, 200, 300), (5, 128, 256), (37, 130, 129), (130, 64, 384)])
def test_matches_float64(impl, M, N, K, rng):
    x, codes, scale = make(rng, M, N, K)
    got = impl(paddle.to_tensor(x), paddle.to_tensor(codes), paddle.to_tensor(scale)).numpy()
    want = w8a8_ref(x, codes, scale)
    assert got.shape == (M, N) and np.isfinite(got).all()
    err = np.linalg.norm(got - want, axis=1) / np.maximum(np.linalg.norm(want, axis=1), 1e-30)
    assert err.max() < 1e-5, err.max()  # float32 accumulation of identical products


@pytest.mark.parametrize(
    "M, cfg",
    [
        (20, {"block_m": 16, "block_n": 32, "split_k": 1}),
        (20, {"block_m": 32, "block_n": 64, "split_k": 3}),
        (1, {"block_m": 16, "block_n": 16, "split_k": 2}),
        (65, {"block_m": 64, "block_n": 64, "split_k": 3}),
        (5, {"block_m": 16, "block_n": 128, "split_k": 1}),
        (33, {"block_m": 64, "block_n": 128, "split_k": 2}),
    ],
)
def test_tiles_and_split_k(M, cfg, rng):
    """Every tile shape and split writes each output element once: the last split of each tile
    sums the partials (NaN-poisoned first) into the float64 product, and leaves its counter zero;
    a second launch on other inputs, reusing partials and counters, is right too (no stale state)."""
    counters = paddle.zeros([64], "int32")
    for _ in range(2):
        x, codes, scale = make(rng, M, 300, 300)
        a, a_s = quantize_activations_ref(paddle.to_tensor(x))
        out = paddle.full([M, 300], float("nan"), "float32")
        part = paddle.full([cfg["split_k"], M, 300], float("nan"), "float32") if cfg["split_k"] > 1 else None
        full = {**cfg, "num_warps": 4, "num_stages": 1}
        launch_w8a8_gemm(a, a_s, paddle.to_tensor(codes), paddle.to_tensor(scale), out, full, part, counters)
        want = w8a8_ref(x, codes, scale)
        got = out.numpy()
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
        assert (counters.numpy() == 0).all()


def test_split_k_needs_its_partials(rng):
    x, codes, scale = make(rng, 3, 70, 300)
    a, a_s = quantize_activations_ref(paddle.to_tensor(x))
    cfg = {"block_m": 16, "block_n": 64, "split_k": 3, "num_warps": 4, "num_stages": 1}
    out = paddle.empty([3, 70], "float32")
    part = paddle.empty([3, 3, 70], "float32")
    w, s = paddle.to_tensor(codes), paddle.to_tensor(scale)
    with pytest.raises(ValueError, match=r"float32 partials \[3, 3, 70\]"):
        launch_w8a8_gemm(a, a_s, w, s, out, cfg)
    with pytest.raises(ValueError, match="zeroed int32 counters for 2 tiles"):
        launch_w8a8_gemm(a, a_s, w, s, out, cfg, part, paddle.zeros([1], "int32"))
    with pytest.raises(ValueError, match="leaves a split empty"):
        launch_w8a8_gemm(a, a_s, w, s, out, {**cfg, "split_k": 4})


def test_linear_splits_k_with_shared_counters(rng):
    """The paddle wrapper at a split shape (M 2, K 4096: 32 K blocks), twice: the shared counters
    return to zero and both answers match float64."""
    from fastdeploy.model_executor.ops.triton_ops.fp8_gemm import split_counters
    from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import tuned_config

    assert tuned_config(2, 256, 4096)["split_k"] > 1
    for _ in range(2):
        x, codes, scale = make(rng, 2, 256, 4096)
        got = w8a8_block_linear(paddle.to_tensor(x), paddle.to_tensor(codes), paddle.to_tensor(scale)).numpy()
        want = w8a8_ref(x, codes, scale)
        assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
        assert (split_counters(paddle.CPUPlace()).numpy() == 0).all()


@pytest.mark.parametrize("M", [1, 16, 17, 64])
@pytest.mark.parametrize("N, K", [(7168, 16384), (4096, 7168), (24576, 1536), (200, 300), (7, 128), (36864, 7168)])
def test_small_m_config_fills_the_machine(M, N, K):
    """Decode sizes split K only while the tiles fill fewer than two waves of 132 SMs, never below
    4 K blocks a split, and every split gets K blocks; tiles divide the weight-scale blocks; large
    M never splits."""
    from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import tuned_config

    cfg = tuned_config(M, N, K)
    n_kb, tiles = -(-K // 128), -(-M // cfg["block_m"]) * -(-N // cfg["block_n"])
    per = -(-n_kb // cfg["split_k"])
    assert -(-n_kb // per) == cfg["split_k"] and cfg["block_m"] >= M and 128 % cfg["block_n"] == 0
    if cfg["split_k"] > 1:
        assert per >= 4 and tiles * cfg["split_k"] // 2 < 2 * 132
    if tiles >= 2 * 132:
        assert cfg["split_k"] == 1
    assert tuned_config(4096, N, K)["split_k"] == 1
    # eager decode (M <= 16) saves a launch by quantizing inside the GEMM; a captured step does not
    assert cfg["fuse_quant"] == (M <= 16) and not tuned_config(M, N, K, captured=True)["fuse_quant"]
    captured = tuned_config(M, N, K, captured=True)
    if M <= 16:  # the same tiles and splits, quantized by a launch of its own
        assert {**captured, "fuse_quant": cfg["fuse_quant"]} == cfg
    else:  # descriptors wherever the rows are 16-byte aligned, one 64-row warpgroup a CTA
        assert captured.get("tma", False) == (K % 16 == 0) and captured["num_warps"] == 4


def test_bad_weights_named(rng):
    x, codes, scale = make(rng, 2, 200, 300)
    with pytest.raises(ValueError, match="q_proj.weight_scale_inv: must be float32 \\[2, 3\\]"):
        check_fp8_weight(paddle.to_tensor(codes), paddle.to_tensor(scale[:1]), "q_proj.weight")
    with pytest.raises(ValueError, match="uint8"):
        check_fp8_weight(paddle.to_tensor(codes.astype(np.float32)), paddle.to_tensor(scale), "w")
    with pytest.raises(ValueError, match="300 columns"):
        w8a8_block_linear(paddle.to_tensor(x), paddle.to_tensor(codes[:, :256]), paddle.to_tensor(scale[:, :2]))


def tie_rows() -> np.ndarray:
    """Two rows of 128 whose block max is 448 (scale exactly 1) and whose other entries sit
    exactly half-way between neighbouring e4m3 values (5 significant bits: exact in float32), both
    signs: only round-half-to-even picks the right code."""
    mids = (GRID[1:126] + GRID[2:127]) / 2
    row = np.concatenate([[448.0], np.resize(mids, 127)]).astype(np.float32)
    return np.stack([row, -row[::-1]])


def test_activation_ties_round_to_even():
    from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import launch_act_quant

    x = tie_rows()
    want = e4m3_round(x.astype(np.float64))
    codes, scales = paddle.empty([2, 128], "uint8"), paddle.empty([2, 1], "float32")
    launch_act_quant(paddle.to_tensor(x), codes, scales)
    assert (scales.numpy() == 1.0).all()
    np.testing.assert_array_equal(E4M3_TO_F32[codes.numpy()].astype(np.float64), want)
    ref_codes, _ = quantize_activations_ref(paddle.to_tensor(x))
    np.testing.assert_array_equal(E4M3_TO_F32[ref_codes.numpy()].astype(np.float64), want)


@pytest.mark.parametrize("M, split_k", [(1, 1), (9, 3)])
def test_quantization_inside_the_gemm(M, split_k, rng):
    """The experimental one-launch form (activations in, quantized per K block in every N tile)
    against float64, NaN-poisoned, with the half-way rows that only ties-to-even rounds right."""
    x, codes, scale = make(rng, M, 70, 300)
    x[:, 128:256] = np.resize(tie_rows(), (M, 128))
    cfg = {"block_m": 16, "block_n": 64, "split_k": split_k, "num_warps": 4, "num_stages": 1}
    out = paddle.full([M, 70], float("nan"), "float32")
    part = paddle.full([split_k, M, 70], float("nan"), "float32") if split_k > 1 else None
    w, s = paddle.to_tensor(codes), paddle.to_tensor(scale)
    launch_w8a8_gemm(paddle.to_tensor(x), None, w, s, out, cfg, part, paddle.zeros([8], "int32"))
    want = w8a8_ref(x, codes, scale)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_ties_round_to_even_inside_the_gemm():
    """With identity weights (code 0x38 = 1.0, scale 1) the in-GEMM quantization's output is the
    rounded activations themselves: exact, ties to even."""
    x = tie_rows()
    codes = np.zeros((128, 128), np.uint8)
    np.fill_diagonal(codes, 0x38)
    assert E4M3_TO_F32[0x38] == 1.0
    out = paddle.full([2, 128], float("nan"), "float32")
    cfg = {"block_m": 16, "block_n": 64, "split_k": 1, "num_warps": 4, "num_stages": 1}
    launch_w8a8_gemm(paddle.to_tensor(x), None, paddle.to_tensor(codes), paddle.ones([1, 1], "float32"), out, cfg)
    np.testing.assert_array_equal(out.numpy().astype(np.float64), e4m3_round(x.astype(np.float64)))


# the TMA configs tuned_config picks: 128 x 128 on 8 warps (K 7168), one 64 x 128 warpgroup a CTA
# (short K at large M, and M 17..64 over two waves of tiles)
TMA_PICKS = [(4096, 4096, 4096), (4096, 7168, 2048), (64, 36864, 7168)]


@pytest.mark.parametrize("pick", TMA_PICKS)
@pytest.mark.parametrize("M, N, K", [(130, 300, 304), (3, 200, 400), (65, 130, 256)])
def test_tma_path_matches_float64(M, N, K, pick, rng):
    """The tensor-descriptor GEMM (M >= 128, or dense gate_up's M 17..64, on the GPU) with each
    tile config it is given, on shapes that are not tile multiples: rows and columns past the edge
    masked, K past the last full block read as zeros, outputs NaN-poisoned first; M-major
    activation scales equal the row-major ones transposed. K blocks differ in magnitude by up to
    1e6."""
    from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import launch_act_quant, tuned_config

    x, codes, scale = make(rng, M, N, K)
    x *= np.repeat(10.0 ** rng.uniform(-3, 3, -(-K // 128)), 128)[:K].astype(np.float32)
    xt = paddle.to_tensor(x)
    a, a_s = quantize_activations_ref(xt)
    a_t = paddle.empty([M, K], "uint8")
    s_t = paddle.full([-(-K // 128), M], float("nan"), "float32")
    launch_act_quant(xt, a_t, s_t, m_major=True)
    np.testing.assert_array_equal(a_t.numpy(), a.numpy())
    np.testing.assert_array_equal(s_t.numpy(), a_s.numpy().T)
    cfg = {**tuned_config(*pick), "num_stages": 1}
    assert cfg["tma"]
    out = paddle.full([M, N], float("nan"), "float32")
    launch_w8a8_gemm(a_t, s_t, paddle.to_tensor(codes), paddle.to_tensor(scale), out, cfg)
    want = w8a8_ref(x, codes, scale)
    got = out.numpy()
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    with pytest.raises(ValueError, match="M-major scales"):
        launch_w8a8_gemm(a_t, a_s, paddle.to_tensor(codes), paddle.to_tensor(scale), out, cfg)
    assert "tma" not in tuned_config(4096, 4096, 4100)  # rows not 16-byte aligned: the pointer kernel
    assert "tma" not in tuned_config(512, 7168, 2048)  # small: the descriptors' host cost
    # short K runs one warpgroup a CTA; M 17..64 runs descriptors, M <= 16 the pointer kernel
    assert [tuned_config(*p)["num_warps"] for p in TMA_PICKS] == [8, 4, 4]
    assert "tma" not in tuned_config(16, 36864, 7168)
    # M 17..64: descriptors where captured (no host cost) or large (2^33 M N K), as at M >= 128
    assert tuned_config(17, 7168, 16384, captured=True)["tma"] and "tma" not in tuned_config(17, 7168, 16384)
    assert tuned_config(64, 36864, 7168)["tma"]


@pytest.mark.parametrize("M, N, K, split", [(3, 200, 400, 2), (65, 130, 384, 3), (1, 70, 528, 5)])
def test_tma_split_k_matches_float64(M, N, K, split, rng):
    """The tensor-descriptor GEMM with K split over programs: NaN-poisoned output and partials,
    zeroed counters; twice, interleaved with another shape on the same counters, each answer
    equal to float64 and the repeat bitwise equal (the last split sums in split order)."""
    from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import launch_act_quant

    cfg = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 1, "split_k": split, "tma": True}
    counters = paddle.zeros([16], "int32")
    runs = []
    for x, codes, scale in [make(rng, M, N, K), make(rng, M + 2, N, K)] * 2:
        m = x.shape[0]
        a, a_s = paddle.empty([m, K], "uint8"), paddle.empty([-(-K // 128), m], "float32")
        launch_act_quant(paddle.to_tensor(x), a, a_s, m_major=True)
        out = paddle.full([m, N], float("nan"), "float32")
        part = paddle.full([split, m, N], float("nan"), "float32")
        launch_w8a8_gemm(a, a_s, paddle.to_tensor(codes), paddle.to_tensor(scale), out, cfg, part, counters)
        want = w8a8_ref(x, codes, scale)
        assert np.abs(out.numpy() - want).max() < 1e-5 * np.abs(want).max()
        assert (counters.numpy() == 0).all()
        runs.append(out.numpy())
    np.testing.assert_array_equal(runs[0], runs[2])
    np.testing.assert_array_equal(runs[1], runs[3])


@pytest.mark.parametrize("M, N, K, split", [(129, 256, 256, 1), (20, 200, 3072, 2)])
def test_linear_at_tma_sizes(M, N, K, split, rng, monkeypatch):
    """The paddle wrapper runs the TMA path end to end (M-major quantization, split partials
    included) when tuned_config picks it, here forced at small shapes: M >= 128's config, and the
    captured step's M 17..64 config, K split in two."""
    from fastdeploy.model_executor.ops.triton_ops import fp8_gemm
    from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import tuned_config

    cfg = tuned_config(4096, 4096, 4096) if M >= 128 else tuned_config(M, N, K, captured=True)
    assert cfg["tma"] and cfg["split_k"] == split
    monkeypatch.setattr(fp8_gemm, "tuned_config", lambda M, N, K, captured=False: {**cfg, "num_stages": 1})
    x, codes, scale = make(rng, M, N, K)
    got = w8a8_block_linear(paddle.to_tensor(x), paddle.to_tensor(codes), paddle.to_tensor(scale)).numpy()
    want = w8a8_ref(x, codes, scale)
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
