"""Fused MoE: the Triton kernels (interpreter) and the paddle reference against a float64 numpy
MoE of the same math (bf16 / float32 and FP8 block weights), with empty experts, one expert
taking every token, other ranks' experts, T = 1 and shapes that are not tile multiples."""

import numpy as np
import paddle
import pytest
from ref import act_quant_ref, bf16_round, e4m3_decode, e4m3_round, expert_sort_ref, fused_moe_ref_np

from fastdeploy.model_executor.ops.fp8_numerics import quantize_fp8_blocks
from fastdeploy.model_executor.ops.triton_ops.expert_sort_kernel import (
    ALIGN_KERNEL_MAX,
    align_scratch_size,
    launch_moe_align,
    launch_moe_align_chunks,
)
from fastdeploy.model_executor.ops.triton_ops.fused_moe import fused_moe, fused_moe_ref, moe_align
from fastdeploy.model_executor.ops.triton_ops.fused_moe_kernel import (
    launch_moe_gemm,
    launch_moe_sum,
    moe_tile_config,
)


def make(rng, T, H, inter, E, top_k, fp8, route="random"):
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E + 2)[:top_k] for _ in range(T)]) - 1  # -1 and E: other ranks
    if route == "one":
        ids[:, 0] = 3  # expert 3 gets every token
        ids[:, 1:] = np.where(ids[:, 1:] == 3, -1, ids[:, 1:])
    if route == "sparse":
        ids[ids >= 2] = -1  # experts 2.. get nothing
    wts = rng.uniform(0.1, 1, (T, top_k)).astype(np.float32)
    ws = [
        rng.standard_normal(s).astype(np.float32) / np.sqrt(s[-1])
        for s in ((E, inter, H), (E, inter, H), (E, H, inter))
    ]
    if not fp8:
        return x, ids, wts, ws, ws, None
    codes, scales, deq = [], [], []
    for w in ws:
        cs = [quantize_fp8_blocks(w[e]) for e in range(E)]
        codes.append(np.stack([c for c, _ in cs]))
        scales.append(np.stack([s for _, s in cs]))
        deq.append(
            np.stack([e4m3_decode(c) * np.kron(s, np.ones((128, 128)))[: c.shape[0], : c.shape[1]] for c, s in cs])
        )
    return x, ids, wts, codes, deq, scales


@pytest.mark.parametrize("impl", [fused_moe, fused_moe_ref], ids=["triton", "ref"])
@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize(
    "T, H, inter, E, top_k, route",
    [
        (1, 128, 64, 8, 4, "random"),
        (37, 192, 96, 8, 3, "random"),
        (20, 128, 64, 6, 2, "one"),
        (9, 256, 128, 5, 4, "sparse"),
        (40, 128, 96, 4, 4, "random"),  # 40 entries an expert: FP8 weights through descriptors
    ],
)
def test_matches_float64(impl, fp8, T, H, inter, E, top_k, route, rng):
    assert moe_tile_config(T * top_k, E, fp8, (H, inter)).get("w_tma", False) == (fp8 and T == 40)
    x, ids, wts, ws, deq, scales = make(rng, T, H, inter, E, top_k, fp8, route)
    t = paddle.to_tensor
    args = [t(x), t(ids.astype(np.int64)), t(wts)] + [t(w) for w in ws] + ([t(s) for s in scales] if fp8 else [])
    got = impl(*args).numpy()
    want = fused_moe_ref_np(x, ids, wts, *deq, fp8)
    assert got.shape == (T, H) and np.isfinite(got).all()
    err = np.linalg.norm(got - want, axis=1) / np.maximum(np.linalg.norm(want, axis=1), 1e-30)
    # float32 accumulation; with FP8 an intermediate near an e4m3 rounding boundary may land on
    # the other side in float32 than in float64 and move its row by ~1e-2
    assert np.median(err) < 1e-5 and err.max() < (3e-2 if fp8 else 1e-5), err


def test_align_sorts_and_pads_by_expert(rng):
    ids = np.array([[2, 0], [2, 5], [1, 2], [-1, 2]])  # expert 3, 4 empty; -1 and 5 not on this rank (E = 5)
    sorted_ids, block_expert = (a.numpy() for a in moe_align(paddle.to_tensor(ids), 5, 4))
    N = ids.size
    blocks = sorted_ids.reshape(-1, 4)
    got = {}
    for b, e in enumerate(block_expert):
        if e < 0:
            assert (blocks[b] == N).all()
            continue
        got.setdefault(int(e), []).extend(int(r) for r in blocks[b] if r < N)
    assert got == {0: [1], 1: [4], 2: [0, 2, 5, 7]}  # each expert's entries, in entry order
    assert (block_expert[: len(got)] >= 0).all() and (block_expert[len(got) :] == -1).all()


@pytest.mark.parametrize(
    "T, top_k, E, bm",
    [
        (1, 8, 256, 16),
        (3, 2, 5, 4),
        (64, 8, 256, 16),
        (128, 8, 256, 16),
        (40, 4, 7, 64),
        (205, 5, 256, 16),  # 1025 entries: the chunked launches from here
        (129, 8, 256, 64),
        (300, 8, 256, 64),
        (700, 8, 64, 64),
        (333, 4, 6, 32),
    ],
)
def test_align_matches_numpy(T, top_k, E, bm, rng):
    """moe_align against its definition in numpy: one Triton program up to ALIGN_KERNEL_MAX
    entries, four chunked launches above (entries not a multiple of the chunk); other ranks' ids
    (-1, E, E + 5) skipped; one expert taking every token; every padding slot reads N and every
    block past the runs -1. Each case also through the other form: both give the definition."""
    ids = rng.integers(-1, E + 6, (T, top_k)) if E < 100 else rng.integers(0, E, (T, top_k))
    if T in (64, 300):
        ids[:, 0] = 7  # one expert takes every token
    sorted_ids, block_expert = (a.numpy() for a in moe_align(paddle.to_tensor(ids), E, bm))
    want_ids, want_blocks = expert_sort_ref(ids, E, bm)
    np.testing.assert_array_equal(sorted_ids, want_ids)
    np.testing.assert_array_equal(block_expert, want_blocks)
    flat = paddle.to_tensor(ids.reshape(-1).astype(np.int64))
    other_ids = paddle.full(want_ids.shape, -7, "int32")  # poisoned: every slot must be written
    other_blocks = paddle.full(want_blocks.shape, -7, "int32")
    if ids.size <= ALIGN_KERNEL_MAX:
        scratch = paddle.full([align_scratch_size(E, ids.size)], -7, "int32")
        launch_moe_align_chunks(flat, E, bm, other_ids, other_blocks, scratch)
    else:
        launch_moe_align(flat, E, bm, other_ids, other_blocks)
    np.testing.assert_array_equal(other_ids.numpy(), want_ids)
    np.testing.assert_array_equal(other_blocks.numpy(), want_blocks)


def test_gated_gemm_writes_only_routed_rows(rng):
    """The first grouped GEMM into a NaN-filled output: routed entries get silu(x W1) * (x W3),
    every other row stays NaN."""
    x, ids, _, ws, _, _ = make(rng, 6, 128, 64, 4, 2, False)
    ids[2] = -1  # token 2 routed nowhere here
    sorted_ids, block_expert = moe_align(paddle.to_tensor(ids), 4, 16)
    out = paddle.full([12, 64], float("nan"), "float32")
    w1, w3 = paddle.to_tensor(ws[0]), paddle.to_tensor(ws[1])
    launch_moe_gemm(paddle.to_tensor(x), w1, out, sorted_ids, block_expert, 12, 2, 16, w3=w3)
    got = out.numpy()
    for entry in range(12):
        t, e = divmod(entry, 2)
        e = ids[t, e]
        if e < 0:
            assert np.isnan(got[entry]).all()
            continue
        g, u = x[t] @ ws[0][e].T.astype(np.float64), x[t] @ ws[1][e].T.astype(np.float64)
        np.testing.assert_allclose(got[entry], g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_n", [64, 32])
def test_weight_descriptors_match_float64(block_n, rng):
    """FP8 grouped GEMMs with the weights loaded through tensor descriptors (w_tma), both gated and
    down, into NaN-filled outputs: each routed entry against float64 of the same quantized math.
    inter 96 is not a multiple of block_n, so a tile's last rows come from the next expert's
    weights and must not reach the output; unrouted rows stay NaN."""
    from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import launch_act_quant

    T, H, inter, E, k = 7, 256, 96, 4, 2
    x, ids, wts, codes, deq, scales = make(rng, T, H, inter, E, k, True)
    ids[2] = -1  # token 2 routed nowhere here
    N = T * k
    sorted_ids, block_expert = moe_align(paddle.to_tensor(ids), E, 16)
    t = paddle.to_tensor
    a, a_s = paddle.empty([T, H], "uint8"), paddle.empty([T, H // 128], "float32")
    launch_act_quant(t(x), a, a_s)
    mid = paddle.full([N, inter], float("nan"), "float32")
    w1, w3, w2 = (t(c) for c in codes)
    s1, s3, s2 = (t(c) for c in scales)
    launch_moe_gemm(
        a, w1, mid, sorted_ids, block_expert, N, k, 16, a_s=a_s, ws1=s1, w3=w3, ws3=s3, block_n=block_n, w_tma=True
    )
    h = np.nan_to_num(mid.numpy())
    b, b_s = paddle.empty([N, inter], "uint8"), paddle.empty([N, 1], "float32")
    launch_act_quant(t(h), b, b_s)
    y = paddle.full([N, H], float("nan"), "float32")
    top_w = t(wts.reshape(-1))
    launch_moe_gemm(
        b, w2, y, sorted_ids, block_expert, N, k, 16, a_s=b_s, ws1=s2, top_w=top_w, block_n=block_n, w_tma=True
    )
    got_mid, got_y = mid.numpy(), y.numpy()
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    for entry in range(N):
        tok, e = divmod(entry, k)
        e = ids[tok, e]
        if not 0 <= e < E:
            assert np.isnan(got_mid[entry]).all() and np.isnan(got_y[entry]).all()
            continue
        xq = act_quant_ref(x[tok : tok + 1])
        want = silu(xq @ deq[0][e].T) * (xq @ deq[1][e].T)
        np.testing.assert_allclose(got_mid[entry], want[0], rtol=1e-4, atol=1e-5)
        hq = act_quant_ref(h[entry : entry + 1])
        np.testing.assert_allclose(got_y[entry], wts.reshape(-1)[entry] * (hq @ deq[2][e].T)[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="w_tma needs FP8"):
        launch_moe_gemm(t(x), t(deq[0].astype(np.float32)), mid, sorted_ids, block_expert, N, k, 16, w_tma=True)


@pytest.mark.parametrize("impl", [fused_moe, fused_moe_ref], ids=["triton", "ref"])
def test_bf16_rounds_the_intermediate(impl, rng):
    """bf16 inputs: the gated intermediate and each entry's weighted down output are kept in bf16
    (the GEMMs accumulate and the sum over k adds in float32). Against float64 MoEs of the same
    bf16 inputs that do and do not round them: the output matches the one that rounds to float32
    accuracy and is 1e-3 away from the other. Triton's interpreter converts float32 to bf16 toward
    zero (a GPU rounds to nearest even), so the kernel's reference rounds that way."""
    T, H, inter, E, top_k = 16, 128, 256, 4, 2
    x, ids, wts, ws, _, _ = make(rng, T, H, inter, E, top_k, False)
    xb, wb = bf16_round(x), [bf16_round(w) for w in ws]
    t = paddle.to_tensor
    args = [t(x).astype("bfloat16"), t(ids.astype(np.int64)), t(wts)] + [t(w).astype("bfloat16") for w in ws]
    got = impl(*args).astype("float32").numpy().astype(np.float64)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    nearest = impl is fused_moe_ref

    def moe(round_h: bool) -> np.ndarray:
        y = np.zeros((T, H))
        for tk in range(T):
            for e, wt in zip(ids[tk], wts[tk], strict=True):
                if 0 <= e < E:
                    h = silu(xb[tk] @ wb[0][e].T) * (xb[tk] @ wb[1][e].T)
                    if round_h:
                        d = wt * (bf16_round(h.astype(np.float32), nearest) @ wb[2][e].T)
                        y[tk] += bf16_round(d.astype(np.float32), nearest)
                    else:
                        y[tk] += wt * (h @ wb[2][e].T)
        return y

    rounded, exact = moe(True), moe(False)
    scale = np.abs(rounded).max()
    assert np.abs(rounded - exact).max() > 1e-3 * scale  # the rounding is visible at these shapes
    # float32 and float64 may put an intermediate on either side of a bf16 rounding boundary: a
    # few outputs move by one of its ulps, the rest agree to float32 accuracy
    e_r, e_x = np.abs(got - rounded), np.abs(got - exact)
    assert np.median(e_r) < 1e-6 * scale and (e_r > 1e-5 * scale).mean() < 0.05, (np.median(e_r), e_r.max())
    assert np.median(e_x) > 30 * np.median(e_r)


@pytest.mark.parametrize("impl", [fused_moe, fused_moe_ref], ids=["triton", "ref"])
def test_fp8_activation_ties_round_to_even(impl, rng):
    """FP8 weights: every activation the MoE quantizes first lies half way between two e4m3 values
    (each 128-column block's amax is 448, so its scale is 1): they must round to the even code,
    as the reference does; ties to odd or away from zero move whole rows."""
    T, H, inter, E, top_k = 12, 256, 128, 4, 2
    _, ids, wts, codes, deq, scales = make(rng, T, H, inter, E, top_k, True)
    mids = np.array([1.0625, 1.1875, 1.3125, 1.4375, 1.5625, 1.6875, 1.8125, 1.9375])
    x = mids[rng.integers(0, 8, (T, H))] * 2.0 ** rng.integers(-3, 4, (T, H)) * rng.choice([-1, 1], (T, H))
    x[:, ::128] = 448.0
    x = x.astype(np.float32)
    assert (e4m3_round(x.astype(np.float64)) != x).mean() > 0.9  # ties, not e4m3 values
    t = paddle.to_tensor
    args = [t(x), t(ids.astype(np.int64)), t(wts)] + [t(w) for w in codes] + [t(s) for s in scales]
    got = impl(*args).numpy()
    want = fused_moe_ref_np(x, ids, wts, *deq, True)
    err = np.linalg.norm(got - want, axis=1) / np.maximum(np.linalg.norm(want, axis=1), 1e-30)
    assert np.median(err) < 1e-5 and err.max() < 3e-2, err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sum_over_k_skips_other_ranks_entries(dtype, rng):
    """``launch_moe_sum`` into a NaN-filled output: each token's rows of this rank's experts
    summed in float32; the rows of entries routed elsewhere (-1, E) are NaN and never read."""
    T, K, H, E = 7, 3, 300, 4  # H not a multiple of the column block
    ids = rng.integers(-1, E + 1, T * K)
    ids[:K] = -1  # a token routed nowhere here sums to 0
    y = rng.standard_normal((T * K, H)).astype(np.float32)
    y[(ids < 0) | (ids >= E)] = np.nan
    yt = paddle.to_tensor(y).astype(dtype)
    out = paddle.full([T, H], float("nan"), "float32")
    launch_moe_sum(yt, paddle.to_tensor(ids.astype(np.int64)), E, out)
    rows = yt.astype("float32").numpy().astype(np.float64)
    want = np.where(((ids >= 0) & (ids < E))[:, None], rows, 0).reshape(T, K, H).sum(1)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=1e-6)
    assert (out.numpy()[0] == 0).all()
