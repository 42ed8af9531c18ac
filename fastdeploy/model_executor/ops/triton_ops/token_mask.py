"""Structured-output token masks on the device (docs/design.md §4.12): a batch's packed
bitmasks (llguidance's int32 words) uploaded once and applied to the logits rows they belong to,
before the sampler. ``apply_token_bitmask`` runs the Triton kernel (``token_mask_kernel.py``) or
the same contract in paddle ops."""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy.model_executor.ops.triton_ops.token_mask_kernel import launch_apply_token_bitmask

# Finite, so the sampler's check for non-finite logits still catches a broken model, and low
# enough that no penalty, bias or temperature lifts it near a real logit (exp of the difference
# is 0 in float32).
MASKED_LOGIT = -1e30


def unpack_bitmask(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [n, vocab_size] from packed int32 words (bit t % 32 of word t // 32, little-endian):
    the kernel's reading of llguidance's masks, for the paddle path and for tests."""
    as_bytes = np.ascontiguousarray(words, np.int32).view(np.uint8).reshape(len(words), -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab_size].astype(bool)


def apply_token_bitmask(logits: paddle.Tensor, words: np.ndarray, rows: list[int], triton: bool) -> paddle.Tensor:
    """logits float32 [B, V] with every token that words[i] (int32 [n, ceil(V / 32)]) does not
    allow set to MASKED_LOGIT in row rows[i]; other rows unchanged. The Triton path writes in
    place and returns ``logits``; the paddle path returns a new tensor."""
    if not rows:
        return logits
    if triton:
        dev_words = paddle.to_tensor(np.ascontiguousarray(words, np.int32), place=logits.place)
        dev_rows = paddle.to_tensor(np.asarray(rows, np.int32), place=logits.place)
        launch_apply_token_bitmask(logits, dev_words, dev_rows, MASKED_LOGIT)
        return logits
    B, V = logits.shape
    keep = np.ones((B, V), bool)
    keep[rows] = unpack_bitmask(words, V)
    mask = paddle.to_tensor(keep, place=logits.place)
    return paddle.where(mask, logits, paddle.full_like(logits, MASKED_LOGIT))
