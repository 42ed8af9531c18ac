"""The rotary kernel (interpreter) against float64 numpy of DeepSeek's interleaved rotary, and
the layer's two forms against each other."""

import numpy as np
import paddle
import pytest
from ref import rope_ref

from fastdeploy.model_executor.layers.rotary_embedding import DeepseekRotaryEmbedding
from fastdeploy.model_executor.ops.triton_ops.rotary_kernel import launch_rope


@pytest.mark.parametrize("T, H, nope, lora", [(5, 3, 128, 512), (1, 1, 16, 32), (0, 2, 16, 32)])
def test_kernel_matches_float64(T, H, nope, lora, rng):
    """Only the last 64 columns of q and k rotate; positions below 0 and past the table clip to
    its ends; outputs NaN-poisoned first."""
    P, half = 40, 32
    q = rng.standard_normal((T, H, nope + 2 * half)).astype(np.float32)
    k = rng.standard_normal((T, lora + 2 * half)).astype(np.float32)
    ang = rng.uniform(0, 6.3, (P, half))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pos = rng.integers(0, P, T)
    if T > 2:
        pos[0], pos[1] = -1, P + 7
    q_out = paddle.full([T, H, 2 * half], float("nan"), "float32")
    k_out = paddle.full([T, 2 * half], float("nan"), "float32")
    t = paddle.to_tensor
    launch_rope(t(pos.astype(np.int64)), t(q), t(k), t(cos), t(sin), q_out, k_out)
    at = np.clip(pos, 0, P - 1)
    c, s = cos[at].astype(np.float64), sin[at].astype(np.float64)
    want_q = rope_ref(q[:, :, nope:].astype(np.float64), c[:, None], s[:, None])
    want_k = rope_ref(k[:, lora:].astype(np.float64), c, s)
    np.testing.assert_allclose(q_out.numpy(), want_q, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(k_out.numpy(), want_k, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_forms_agree(dtype, rng):
    """DeepseekRotaryEmbedding(triton=True) equals the paddle form with YaRN scaling on."""
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0}
    ref = DeepseekRotaryEmbedding(64, 10000.0, scaling, 256)
    fused = DeepseekRotaryEmbedding(64, 10000.0, scaling, 256, triton=True)
    q = paddle.to_tensor(rng.standard_normal((6, 4, 192)).astype(np.float32)).astype(dtype)
    k = paddle.to_tensor(rng.standard_normal((6, 576)).astype(np.float32)).astype(dtype)
    pos = paddle.to_tensor(np.array([0, 1, 63, 64, 200, 255], np.int64))
    tol = 1e-6 if dtype == "float32" else 1e-2
    for a, b in zip(ref(pos, q, k), fused(pos, q, k), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a.astype("float32").numpy(), b.astype("float32").numpy(), rtol=tol, atol=tol)
