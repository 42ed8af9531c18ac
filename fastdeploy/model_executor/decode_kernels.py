"""The Triton kernels one decode step of the FP8 model launches, in launch order: what
``benchmarks/bench_decode_step.py`` times, and what a CPU test (``tests/models/
test_decode_kernel_list.py``) checks against the kernels the model really launches, so the
benchmark cannot drift from the model. ``_combine_kernel`` follows the sparse MLA kernel when it
splits the keys, and is left out of the lists."""

from __future__ import annotations

from fastdeploy.model_executor.ops.triton_ops.expert_sort_kernel import ALIGN_KERNEL_MAX
from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import tuned_config

HIDDEN, ROUTED_TOPK = 7168, 8  # DeepSeek-V3's hidden size and experts a token

STEP_START = ["_swa_indexer_kernel", "_swa_indexer_kernel"]  # the step plans' window indices
STEP_END = ["_rms_norm_kernel", "_prepare_kernel", "_cuts_kernel", "_compact_kernel", "_draw_kernel"]  # the sampler


def linear_kernels(M: int) -> list[str]:
    """A W8A8 linear: small M quantizes its activations inside the GEMM (``tuned_config``)."""
    return ([] if tuned_config(M, HIDDEN, HIDDEN)["fuse_quant"] else ["_act_quant_kernel"]) + ["_w8a8_gemm_kernel"]


def attn_kernels(M: int, swa: bool) -> list[str]:
    """input norm, q_a, q norm, q_b, kv_a, kv norm; the FP8 cache write (SWA layers); sparse MLA;
    o_proj."""
    norm, lin = ["_rms_norm_kernel"], linear_kernels(M)
    rope = ["_rope_kernel"]
    return (
        norm + lin + norm + lin + lin + norm + rope + (["_write_kernel"] if swa else []) + ["_sparse_mla_kernel"] + lin
    )


def mlp_kernels(M: int, moe: bool) -> list[str]:
    """The post-attention norm, the routed experts (MoE layers), then the dense MLP or shared
    expert: gate, up, down."""
    chunks = ["_align_count_kernel", "_align_scan_kernel", "_align_starts_kernel", "_align_scatter_kernel"]
    align = ["_moe_align_kernel"] if M * ROUTED_TOPK <= ALIGN_KERNEL_MAX else chunks
    gemms = ["_act_quant_kernel", "_moe_gemm_kernel"] * 2
    routed = ["_moe_route_kernel"] + align + gemms + ["_moe_sum_kernel"]
    routed = routed if moe else []
    return ["_rms_norm_kernel"] + routed + linear_kernels(M) * 3
