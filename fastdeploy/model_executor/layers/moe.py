"""The dense MLP and DeepSeek-V3's MoE block (sigmoid scoring, bias-corrected group-limited
top-k, normalised and scaled routing weights, shared experts).

The routed experts' weights are stacked per projection (w1 gate, w3 up [E, I, H]; w2 down
[E, H, I]; with FP8 weights e4m3 codes plus ``*_scale_inv`` block scales) and run as one fused
MoE (``ops/triton_ops/fused_moe.py``: Triton kernels on GPU, the per-expert reference on CPU).
The checkpoint's per-expert tensors load into their slice (``checkpoint_target``).

Tensor parallel (docs/design.md §4.9): a dense MLP splits its intermediate features; the MoE
block gives each rank n_routed_experts / N whole experts, which it runs for all tokens, splits the
shared experts like a dense MLP, and all-reduces routed and shared parts once. Expert parallel
(``dispatch``, ``layers/moe_dispatch.py``): each rank holds its own tokens (attention
data-parallel) and n_routed_experts / EP whole experts; the tokens are gathered for the local
experts and the sums come back to their rank; the shared experts run whole on every rank."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy.config import ModelConfig
from fastdeploy.distributed.parallel import TPGroup
from fastdeploy.model_executor.layers.linear import ColumnParallelLinear, FP8Linear, RowParallelLinear
from fastdeploy.model_executor.layers.moe_dispatch import AllGatherDispatch
from fastdeploy.model_executor.ops.fp8_numerics import FP8_BLOCK
from fastdeploy.model_executor.ops.triton_ops.fused_moe import fused_moe, fused_moe_ref
from fastdeploy.model_executor.ops.triton_ops.moe_route_kernel import launch_moe_route


class MLP(nn.Layer):
    """down(silu(gate(x)) * up(x)), intermediate features split over ``tp``; ``reduce`` False
    leaves the partial sums to the caller."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        tp: TPGroup,
        dtype: str,
        what: str = "intermediate_size",
        reduce: bool = True,
        fp8: FP8Linear | None = None,
    ) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, inter, tp, what, dtype=dtype, fp8=fp8)
        self.up_proj = ColumnParallelLinear(hidden, inter, tp, what, dtype=dtype, fp8=fp8)
        self.down_proj = RowParallelLinear(inter, hidden, tp, what, dtype=dtype, reduce=reduce, fp8=fp8)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Layer):
    """Router: [T, hidden] -> (expert ids int64 [T, k], weights float32 [T, k])."""

    def __init__(self, cfg: ModelConfig, dtype: str, triton: bool = False) -> None:
        super().__init__()
        self.triton = triton  # the routing after the router GEMM as one launch (moe_route_kernel)
        if cfg.scoring_func != "sigmoid" or cfg.topk_method != "noaux_tc":
            raise ValueError(
                f"config keys 'scoring_func'={cfg.scoring_func!r} / 'topk_method'={cfg.topk_method!r}: only "
                "'sigmoid' / 'noaux_tc' (DeepSeek-V3) are supported"
            )
        if cfg.n_routed_experts % cfg.n_group:
            raise ValueError(f"config key 'n_group'={cfg.n_group} must divide n_routed_experts={cfg.n_routed_experts}")
        if cfg.topk_group * (cfg.n_routed_experts // cfg.n_group) < cfg.num_experts_per_tok:
            raise ValueError(
                f"config keys 'topk_group'={cfg.topk_group} groups of {cfg.n_routed_experts // cfg.n_group} experts "
                f"hold fewer than 'num_experts_per_tok'={cfg.num_experts_per_tok}"
            )
        self.cfg = cfg
        # float32, as the routing computes: casting a bf16 weight every call cost a launch and 7 MB
        # of traffic a layer (the values are the checkpoint's either way)
        self.weight = self.create_parameter([cfg.n_routed_experts, cfg.hidden_size], dtype="float32")
        self.e_score_correction_bias = self.create_parameter([cfg.n_routed_experts], dtype="float32", is_bias=True)

    def forward(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        c = self.cfg
        T = x.shape[0]
        logits = paddle.matmul(x.astype("float32"), self.weight, transpose_y=True)
        if self.triton:
            ids = paddle.empty([T, c.num_experts_per_tok], "int64")
            w = paddle.empty([T, c.num_experts_per_tok], "float32")
            bias = self.e_score_correction_bias.detach()
            launch_moe_route(
                logits.detach(), bias, ids, w, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor
            )
            return ids, w
        scores = F.sigmoid(logits)
        choice = scores + self.e_score_correction_bias
        grouped = choice.reshape([T, c.n_group, -1])
        group_scores = paddle.topk(grouped, k=min(2, grouped.shape[-1]), axis=-1)[0].sum(axis=-1)
        top_groups = paddle.topk(group_scores, k=c.topk_group, axis=-1)[1]
        group_mask = paddle.zeros([T, c.n_group], "float32")
        ones = paddle.ones(top_groups.shape, "float32")  # a tensor: a float value would be uploaded
        group_mask = paddle.put_along_axis(group_mask, top_groups, ones, axis=1)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape([T, -1])
        masked = paddle.where(expert_mask > 0, choice, paddle.full_like(choice, float("-inf")))
        ids = paddle.topk(masked, k=c.num_experts_per_tok, axis=-1)[1]
        w = paddle.take_along_axis(scores, ids, axis=1)
        if c.num_experts_per_tok > 1 and c.norm_topk_prob:
            w = w / (w.sum(axis=-1, keepdim=True) + 1e-20)
        return ids, w * c.routed_scaling_factor


STACKED = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class DeepseekV3MoE(nn.Layer):
    """``dispatch``: expert parallel over its group, the routed experts split over it; ``tp``
    then splits only the shared expert (its ranks hold the same tokens: each dispatches its
    share of the rows, and the rows come back by an all-gather)."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPGroup,
        dtype: str,
        fp8: FP8Linear | None = None,
        triton: bool = False,
        dispatch: AllGatherDispatch | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.dispatch = tp, dispatch
        self.gate = MoEGate(cfg, dtype, triton)
        experts = dispatch.group if dispatch is not None else tp
        self.expert_range = experts.shard(cfg.n_routed_experts, "n_routed_experts")
        E = self.expert_range[1] - self.expert_range[0]
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        zero = nn.initializer.Constant(0)
        for name, shape in (("w1", [E, inter, h]), ("w3", [E, inter, h]), ("w2", [E, h, inter])):
            w = self.create_parameter(shape, dtype="uint8" if fp8 else dtype, default_initializer=zero)
            w.stop_gradient = True  # filled slice by slice at load; the kernels take it by DLPack
            w.tp_shard = (0, *self.expert_range, cfg.n_routed_experts)  # this rank's experts of all
            setattr(self, name, w)
            if fp8:
                blocks = [E, -(-shape[1] // FP8_BLOCK), -(-shape[2] // FP8_BLOCK)]
                sc = self.create_parameter(blocks, dtype="float32", default_initializer=zero)
                sc.stop_gradient = True
                sc.tp_shard = w.tp_shard
                setattr(self, name + "_scale_inv", sc)
        self.fp8 = fp8 is not None
        self.routed = fused_moe if triton else fused_moe_ref
        shared = cfg.moe_intermediate_size * (cfg.n_shared_experts or 0)
        self.shared_experts = (
            MLP(cfg.hidden_size, shared, tp, dtype, "moe_intermediate_size * n_shared_experts", reduce=False, fp8=fp8)
            if shared
            else None
        )

    def checkpoint_target(self, expert: int, proj: str, suffix: str) -> tuple[str, int] | None:
        """(parameter name within this block, slice index) for expert ``expert``'s ``proj``
        tensor (``suffix`` "" or "_scale_inv"); None for another rank's expert."""
        lo, hi = self.expert_range
        if not lo <= expert < hi:
            return None
        return STACKED[proj] + suffix, expert - lo

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        ids, w = self.gate(x)
        scales = [getattr(self, n + "_scale_inv") for n in ("w1", "w3", "w2")] if self.fp8 else []
        lo, weights = self.expert_range[0], (self.w1, self.w3, self.w2, *scales)
        if self.dispatch is None:  # this rank's experts' part of every token: summed over TP
            out = self.routed(x, ids - lo, w, *weights)
            if self.shared_experts is not None:
                out = out + self.shared_experts(x).astype("float32")
            return self.tp.all_reduce(out).astype(x.dtype)
        out = self.expert_parallel(x, ids, w, weights)  # whole sums of this rank's tokens
        if self.shared_experts is not None:
            out = out + self.tp.all_reduce(self.shared_experts(x).astype("float32"))
        return out.astype(x.dtype)

    def expert_parallel(self, x: paddle.Tensor, ids: paddle.Tensor, w: paddle.Tensor, weights: tuple) -> paddle.Tensor:
        """Every rank's tokens through the local experts, the sums back to their rank: float32
        [T, H]. Under TP, rank t of the group dispatches rows [t * c, (t + 1) * c) (c = ceil(T /
        TP)) and the group all-gathers the results."""
        lo, tp, T = self.expert_range[0], self.tp, x.shape[0]
        if tp.world_size > 1:
            c = -(-T // tp.world_size)
            a, b = min(tp.rank * c, T), min((tp.rank + 1) * c, T)
            x, ids, w = x[a:b], ids[a:b], w[a:b]
        d = self.dispatch.prepare(x, ids, w)
        out = self.dispatch.finalize(self.routed(d.x, d.ids - lo, d.w, *weights), d)
        if tp.world_size == 1:
            return out
        pad = c - out.shape[0]
        if pad:
            out = paddle.concat([out, paddle.zeros([pad, out.shape[1]], out.dtype)])
        return tp.all_gather_rows(out)[:T]
