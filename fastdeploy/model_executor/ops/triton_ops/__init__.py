"""Triton kernels and the launcher that feeds them paddle tensors."""

from fastdeploy.model_executor.ops.triton_ops.launcher import enable_compat_before_triton

enable_compat_before_triton()  # runs before any kernel module of this package imports triton
