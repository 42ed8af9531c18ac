"""Triton kernel applying structured-output token masks to logits in place; paddle-free.

A mask row is llguidance's packed bitmask: int32 words, bit ``t % 32`` of word ``t // 32`` set
when token t is allowed. Each (mask row, chunk) program sets the disallowed tokens of its logits
row to MASKED, reading only the mask words (the logits are written, never read).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops.launcher import launch, stride

BLOCK = 4096  # tokens a program covers: 32 programs a row at DeepSeek-V3's 129,280


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    logits_stride,
    words_ptr,
    words_stride,
    rows_ptr,
    V,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + r).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = t < V
    w = tl.load(words_ptr + r * words_stride + (t >> 5), mask=ok, other=-1)
    allowed = ((w >> (t & 31)) & 1) != 0  # arithmetic shift: the & 1 keeps only bit t % 32
    tl.store(logits_ptr + row * logits_stride + t, MASKED, mask=ok & ~allowed)


def launch_apply_token_bitmask(logits, words, rows, masked: float) -> None:
    """logits float32 [B, V] in place: row rows[i] keeps only the tokens words[i] allows
    (words int32 [n, ceil(V / 32)], rows int32 [n])."""
    n, V = int(words.shape[0]), int(logits.shape[1])
    if n:
        grid = (n, triton.cdiv(V, BLOCK))
        args = (logits, stride(logits, 0), words, stride(words, 0), rows, V)
        launch(_apply_token_bitmask_kernel, grid, *args, MASKED=masked, BLOCK=BLOCK)
