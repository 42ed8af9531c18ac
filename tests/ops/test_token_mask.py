"""The token-bitmask op (structured outputs) against a numpy reference on fresh random bits: the
Triton kernel through the interpreter and the paddle path; rows without a mask, and every
allowed token, unchanged bit for bit; vocabularies that end inside a 32-bit word and a block."""

import numpy as np
import paddle
import pytest
from ref import token_mask_ref

from fastdeploy.model_executor.ops.triton_ops.token_mask import MASKED_LOGIT, apply_token_bitmask, unpack_bitmask


@pytest.mark.parametrize("triton", [True, False])
@pytest.mark.parametrize("V", [64, 4096 + 45, 129 * 7])
def test_apply_token_bitmask(triton, V, rng):
    B = 5
    logits = rng.standard_normal((B, V)).astype(np.float32) * 4
    rows = [3, 0, 4]
    words = rng.integers(-(2**31), 2**31, (len(rows), (V + 31) // 32), dtype=np.int64).astype(np.int32)
    words[1, :] = -1  # a row that allows everything
    want = token_mask_ref(logits, words, rows, MASKED_LOGIT)
    got = apply_token_bitmask(paddle.to_tensor(logits), words, rows, triton).numpy()
    np.testing.assert_array_equal(got, want)  # bit-exact: masked tokens set, the rest untouched
    assert (got[3] == MASKED_LOGIT).sum() > V // 4 and (got[[1, 2]] == logits[[1, 2]]).all()


def test_unpack_bitmask_bit_order():
    words = np.array([[1 | (1 << 31), 2]], np.int64).astype(np.int32)  # tokens 0, 31 and 33
    assert np.flatnonzero(unpack_bitmask(words, 40)[0]).tolist() == [0, 31, 33]


def test_no_rows_is_a_no_op(rng):
    x = paddle.to_tensor(rng.standard_normal((2, 50)).astype(np.float32))
    assert apply_token_bitmask(x, np.zeros((0, 2), np.int32), [], True) is x
