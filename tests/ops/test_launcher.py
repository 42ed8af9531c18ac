"""Stores of a Triton kernel launched on paddle tensors land in paddle's memory."""

import numpy as np
import paddle
import pytest
import triton
import triton.language as tl

from fastdeploy.model_executor.ops.triton_ops import launcher


@triton.jit
def _affine_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m).to(tl.float32)
    tl.store(y_ptr + offs, (x * 2 + 1).to(y_ptr.dtype.element_ty), mask=m)


@pytest.mark.parametrize("dtype", ["int32", "uint8", "float32", "bfloat16"])
def test_stores_land_in_paddle(dtype, rng):
    n = 300
    src = rng.integers(0, 100, n).astype(np.float32)
    x = paddle.to_tensor(src).astype(dtype)
    y = paddle.full([n], 77, dtype=dtype)
    launcher.launch(_affine_kernel, (triton.cdiv(n, 128),), x, y, n, BLOCK=128)
    want = src * 2 + 1
    got = y.astype("float32").numpy()
    if dtype == "uint8":
        want = want.astype(np.uint8)
    np.testing.assert_allclose(got, want, rtol=2**-7)


def test_rejects_strided_view():
    x = paddle.arange(16, dtype="float32").reshape([4, 4]).transpose([1, 0])
    y = paddle.zeros([16])
    assert not x.is_contiguous()  # the case under test: a strided view
    with pytest.raises(ValueError, match="contiguous"):
        launcher.launch(_affine_kernel, (1,), x, y, 16, BLOCK=16)


def test_cpu_paddle_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not launcher.can_run_triton()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        launcher.launch(_affine_kernel, (1,), paddle.zeros([4]), paddle.zeros([4]), 4, BLOCK=4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launcher.can_run_triton()


def test_compat_is_only_enabled_for_cuda_paddle(monkeypatch):
    calls = []
    monkeypatch.setattr(launcher, "_ensure_paddle_compat", lambda: calls.append(1))
    launcher.enable_compat_before_triton()  # interpreter: nothing
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    launcher.enable_compat_before_triton()  # CPU paddle: nothing
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    launcher.enable_compat_before_triton()
    assert calls == [1]
