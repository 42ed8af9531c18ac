"""The routing kernel (interpreter) against a float64 numpy definition of DeepSeek-V3's
``noaux_tc`` routing, and against the model's paddle form (``MoEGate``) on the same logits:
DeepSeek-V3's shape (256 experts in 8 groups, top-4 groups, top-8), the tiny model's (8 in 4,
top-2 groups, top-2), groups of one expert, experts not a power of two, top-k not one either."""

import numpy as np
import paddle
import pytest
from ref import moe_route_ref

from fastdeploy.model_executor.ops.triton_ops.moe_route_kernel import launch_moe_route


@pytest.mark.parametrize(
    "T, E, n_group, topk_group, top_k, norm",
    [
        (5, 256, 8, 4, 8, True),
        (7, 8, 4, 2, 2, True),
        (3, 12, 3, 2, 3, False),
        (4, 6, 6, 4, 4, True),
        (1, 64, 1, 1, 6, True),
    ],
)
def test_matches_the_definition(T, E, n_group, topk_group, top_k, norm, rng):
    z = rng.standard_normal((T, E)).astype(np.float32) * 2
    bias = (0.1 * rng.standard_normal(E)).astype(np.float32)
    ids = paddle.full([T, top_k], -7, "int64")
    ws = paddle.full([T, top_k], float("nan"), "float32")
    launch_moe_route(paddle.to_tensor(z), paddle.to_tensor(bias), ids, ws, n_group, topk_group, norm, 2.5)
    want_ids, want_w = moe_route_ref(z, bias, n_group, topk_group, top_k, norm, 2.5)
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    np.testing.assert_allclose(ws.numpy(), want_w, rtol=1e-5, atol=1e-6)


def test_matches_the_model_gate(rng):
    """The paddle MoEGate (router GEMM, then its ops) and the kernel on that GEMM's logits."""
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.layers.moe import MoEGate

    cfg = ModelConfig(hidden_size=64, n_routed_experts=32, n_group=4, topk_group=2, num_experts_per_tok=4)
    cfg.norm_topk_prob, cfg.routed_scaling_factor = True, 2.5
    gate = MoEGate(cfg, "float32")
    gate.weight.set_value(rng.standard_normal((32, 64)).astype(np.float32) / 8)
    gate.e_score_correction_bias.set_value((0.1 * rng.standard_normal(32)).astype(np.float32))
    x = paddle.to_tensor(rng.standard_normal((9, 64)).astype(np.float32))
    want_ids, want_w = gate(x)
    z = paddle.matmul(x, gate.weight.detach(), transpose_y=True)
    ids, ws = paddle.empty([9, 4], "int64"), paddle.empty([9, 4], "float32")
    launch_moe_route(z, gate.e_score_correction_bias.detach(), ids, ws, 4, 2, True, 2.5)
    np.testing.assert_array_equal(np.sort(ids.numpy(), 1), np.sort(want_ids.numpy(), 1))
    order = np.argsort(ids.numpy(), 1), np.argsort(want_ids.numpy(), 1)
    np.testing.assert_allclose(
        np.take_along_axis(ws.numpy(), order[0], 1), np.take_along_axis(want_w.numpy(), order[1], 1), rtol=1e-5
    )
