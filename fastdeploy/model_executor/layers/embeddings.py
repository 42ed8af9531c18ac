"""Vocabulary-parallel token embedding and LM head: each rank holds rows [start, end) of the
vocabulary (docs/design.md §4.9)."""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy.distributed.parallel import TPGroup


class VocabParallelEmbedding(nn.Layer):
    """Ids outside this rank's rows contribute zeros; the all-reduce sums the ranks' parts."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: str = "float32") -> None:
        super().__init__()
        self.tp = tp
        self.start, self.end = tp.shard(vocab_size, "vocab_size")
        self.weight = self.create_parameter([self.end - self.start, hidden_size], dtype=dtype)
        self.weight.tp_shard = (0, self.start, self.end, vocab_size)

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        ids = ids.astype("int64")
        if self.tp.world_size == 1:
            return paddle.gather(self.weight, ids)
        mine = (ids >= self.start) & (ids < self.end)
        local = paddle.where(mine, ids - self.start, paddle.zeros_like(ids))
        x = paddle.gather(self.weight, local) * mine.unsqueeze(-1).astype(self.weight.dtype)
        return self.tp.all_reduce(x)


class ParallelLMHead(nn.Layer):
    """logits float32 [T, vocab] = h @ W^T, each rank's vocabulary rows gathered in order."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: str = "float32") -> None:
        super().__init__()
        self.tp = tp
        start, end = tp.shard(vocab_size, "vocab_size")
        self.weight = self.create_parameter([end - start, hidden_size], dtype=dtype)
        self.weight.tp_shard = (0, start, end, vocab_size)

    def forward(self, h: paddle.Tensor) -> paddle.Tensor:
        return self.tp.all_gather_last(paddle.matmul(h, self.weight, transpose_y=True).astype("float32"))
