"""MoE dispatch and combine over an expert-parallel group (``../shared/DESIGN.md`` §U; vLLM's
``FusedMoEPrepareAndFinalize`` role, its ``allgather_reducescatter`` backend).

With attention data-parallel, each rank holds its own tokens and 1 / EP of the routed experts.
``prepare`` all-gathers every rank's tokens, top-k ids and weights (counts first, each rank's rows
padded to the largest count with zero weights, so a rank with no tokens, a dummy step, still takes
part); every rank runs its local experts over all of them; ``finalize`` sums the partial outputs
over ranks and keeps this rank's rows: a reduce-scatter on NCCL, an all-reduce plus the rank's
slice on gloo (which has no reduce-scatter; the same numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from fastdeploy.distributed.parallel import TPGroup


@dataclass
class Dispatched:
    """Every rank's tokens, each rank's padded to n rows: x [R * n, H], ids int64 [R * n, k],
    w float32 [R * n, k] (padding rows: weight 0); ``tokens`` this rank's own count."""

    x: paddle.Tensor
    ids: paddle.Tensor
    w: paddle.Tensor
    tokens: int


class AllGatherDispatch:
    """``group``: the expert-parallel ranks (all of them hold different tokens)."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group

    def prepare(self, x: paddle.Tensor, ids: paddle.Tensor, w: paddle.Tensor) -> Dispatched:
        """x [T, H], top-k ids [T, k] and weights [T, k] of this rank's tokens -> every rank's."""
        T = x.shape[0]
        counts = self.group.all_gather_rows(paddle.to_tensor([T], dtype="int64"))
        n = max(int(counts.max()), 1)  # the host reads the counts once a layer (not a captured step)
        pad = n - T
        if pad:
            x = paddle.concat([x, paddle.zeros([pad, x.shape[1]], x.dtype)])
            ids = paddle.concat([ids, paddle.zeros([pad, ids.shape[1]], ids.dtype)])
            w = paddle.concat([w, paddle.zeros([pad, w.shape[1]], w.dtype)])
        g = self.group
        return Dispatched(g.all_gather_rows(x), g.all_gather_rows(ids), g.all_gather_rows(w), T)

    def finalize(self, out: paddle.Tensor, d: Dispatched) -> paddle.Tensor:
        """This rank's partial outputs of every rank's tokens [R * n, H] -> the sums over ranks
        of this rank's own tokens [T, H]."""
        return self.group.reduce_scatter_rows(out)[: d.tokens]
