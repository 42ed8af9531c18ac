"""The one way a Triton kernel of this project is launched (docs/design.md §5).

- ``TRITON_INTERPRET=1`` (CPU tests): the interpreter accepts only torch tensors, so paddle
  tensors become zero-copy ``torch.from_dlpack`` views and the kernel's stores land in paddle's
  memory.
- A CUDA build of paddle: ``paddle.enable_compat(scope={"triton"})`` makes Triton accept paddle
  tensors directly.
- torch tensors (the GPU benchmarks, which have no paddle) pass through unchanged.
"""

from __future__ import annotations

import os
from typing import Any

_compat_enabled = False


def interpret_mode() -> bool:
    """Whether Triton runs in its interpreter (TRITON_INTERPRET=1), read at each call; Triton
    itself reads the variable when it defines the kernels, so set it before importing them."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _is_paddle_tensor(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("paddle")


def _to_torch_view(x: Any) -> Any:
    import torch

    if not x.is_contiguous():
        raise ValueError("Triton launcher needs contiguous paddle tensors (got a strided view)")
    return torch.from_dlpack(x)


def _ensure_paddle_compat() -> None:
    global _compat_enabled
    if not _compat_enabled:
        import paddle

        paddle.enable_compat(scope={"triton"}, silent=True)
        _compat_enabled = True


def enable_compat_before_triton() -> None:
    """On a CUDA build of paddle, turn on paddle's torch proxy for Triton before Triton is first
    imported (paddle's documented order); a no-op without paddle (GPU benchmarks) or on CPU."""
    if interpret_mode():
        return
    try:
        import paddle
    except ImportError:
        return
    if paddle.is_compiled_with_cuda():
        _ensure_paddle_compat()


def stride(x: Any, dim: int) -> int:
    """Element stride of a paddle (``strides``) or torch (``stride()``) tensor along ``dim``."""
    return int(x.strides[dim]) if hasattr(x, "strides") else int(x.stride(dim))


def launch(kernel: Any, grid: tuple, *args: Any, **meta: Any) -> None:
    """Run ``kernel[grid](*args, **meta)``, making paddle tensor arguments acceptable to Triton."""
    if any(_is_paddle_tensor(a) for a in args):
        if interpret_mode():
            args = tuple(_to_torch_view(a) if _is_paddle_tensor(a) else a for a in args)
        else:
            import paddle

            if not paddle.is_compiled_with_cuda():
                raise RuntimeError(
                    "Triton kernels need a CUDA build of paddle, or TRITON_INTERPRET=1 to run them "
                    "in Triton's interpreter on CPU"
                )
            _ensure_paddle_compat()
    kernel[grid](*args, **meta)


def can_run_triton() -> bool:
    """True where a paddle tensor can go through ``launch``: the interpreter or a CUDA paddle."""
    if interpret_mode():
        return True
    try:
        import paddle

        return bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0
    except Exception:  # pragma: no cover - paddle always imports where the package is installed
        return False
