"""RMSNorm's Triton kernel (interpreter) against float64 numpy, and the layer's two forms
against each other."""

import numpy as np
import paddle
import pytest
import torch
from ref import rms_norm_ref

from fastdeploy.model_executor.layers.normalization import RMSNorm
from fastdeploy.model_executor.ops.triton_ops.rms_norm_kernel import launch_rms_norm


@pytest.mark.parametrize("M, N", [(1, 7168), (5, 512), (3, 100), (0, 64)])
def test_kernel_matches_float64(M, N, rng):
    """Rows strided (a slice of a wider tensor, as kv_a's first 512 columns), N not a power of
    two, outputs NaN-poisoned first, a row of huge values and a row of zeros."""
    wide = (rng.standard_normal((M, N + 37)) * rng.uniform(0.1, 10, (M, 1))).astype(np.float32)
    if M > 2:
        wide[1] *= 1e18
        wide[2] = 0
    w = rng.uniform(0.5, 1.5, N).astype(np.float32)
    x = torch.from_numpy(wide)[:, :N]  # strided rows (paddle views reach the kernel contiguous)
    out = torch.full((M, N), float("nan"))
    launch_rms_norm(x, torch.from_numpy(w), out, 1e-6)
    got = out.numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, rms_norm_ref(wide[:, :N], w, 1e-6), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_forms_agree(dtype, rng):
    """RMSNorm(triton=True) equals the paddle form on [B, T, N] input: exactly up to the last
    rounding into the output dtype."""
    x = paddle.to_tensor(rng.standard_normal((2, 3, 320)).astype(np.float32)).astype(dtype)
    ref, fused = RMSNorm(320, 1e-6, "float32"), RMSNorm(320, 1e-6, "float32", triton=True)
    w = paddle.to_tensor(rng.uniform(0.5, 1.5, 320).astype(np.float32))
    ref.weight.set_value(w)
    fused.weight.set_value(w)
    a, b = ref(x).astype("float32").numpy(), fused(x).astype("float32").numpy()
    assert b.shape == (2, 3, 320)
    want = rms_norm_ref(x.astype("float32").numpy(), w.numpy(), 1e-6)
    tol = 1e-6 if dtype == "float32" else 8e-3
    np.testing.assert_allclose(b, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
