"""Token embedding and the LM head (vocab-parallel shapes; TP = 1 for now)."""

from __future__ import annotations

import paddle
from paddle import nn


class VocabParallelEmbedding(nn.Layer):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: str = "float32") -> None:
        super().__init__()
        self.weight = self.create_parameter([vocab_size, hidden_size], dtype=dtype)

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        return paddle.gather(self.weight, ids.astype("int64"))


class ParallelLMHead(nn.Layer):
    """logits float32 [T, vocab] = h @ W^T."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: str = "float32") -> None:
        super().__init__()
        self.weight = self.create_parameter([vocab_size, hidden_size], dtype=dtype)

    def forward(self, h: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(h, self.weight, transpose_y=True).astype("float32")
