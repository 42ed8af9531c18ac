"""The one implementation switch: which kernels run, decided once at start-up and logged.

``select_kernels`` turns the three settings (``--kernel-backend``, ``--sparse-mla-provider``,
``--mla-prefill-form``) into a ``KernelConfig`` that the runner hands to the model and the step
builder. Nothing below it chooses an implementation again, from the environment or a module
global; the launcher reads ``TRITON_INTERPRET`` only for how a chosen Triton kernel launches (in
the interpreter, with float32 dots).

- kernel_backend ``auto``: Triton kernels on a CUDA build of paddle, paddle references on CPU;
  ``triton``: Triton kernels (on CPU only in Triton's interpreter, ``TRITON_INTERPRET=1``; slow,
  for tests); ``reference``: paddle references.
- sparse_mla_provider ``auto``: ``flashmla`` on a GPU where ``flash_mla`` imports, else ``triton``
  when Triton kernels run, else ``reference``; SWA and full layers' absorbed attention both go
  through it.
- mla_prefill_form: ``auto`` (the cost model of ``layers/attention/prefill_form.py``), ``mha`` or
  ``absorbed``.
- index_kernel_backend: DSA layers' index key write, logits and top-k, ``auto`` (the Triton kernels
  where Triton kernels run on a GPU, else paddle ops), ``reference`` (paddle ops) or ``triton``
  (with the Triton kernels, the interpreter included). ``auto`` takes the kernels on a GPU since
  the H100 run of 2026-12-07 (benchmarks/README.md: 1.9-10.6x the reference pick, except one
  long row alone, 0.8x).
"""

from __future__ import annotations

import logging

from fastdeploy.config import MLA_PREFILL_FORMS, SPARSE_MLA_PROVIDERS, KernelConfig
from fastdeploy.model_executor.ops.triton_ops.launcher import can_run_triton, interpret_mode

logger = logging.getLogger("fastdeploy")

KERNEL_BACKENDS = ("auto", "triton", "reference")


def flashmla_importable() -> bool:
    try:
        import flash_mla  # noqa: F401
    except ImportError:
        return False
    return True


def _check_provider(name: str) -> None:
    if name not in SPARSE_MLA_PROVIDERS:
        raise ValueError(
            f"sparse_mla_provider: unknown provider {name!r}; choose one of {SPARSE_MLA_PROVIDERS} or 'auto'"
        )
    if name == "flashmla" and not flashmla_importable():
        raise ValueError("sparse_mla_provider: 'flashmla' asked for, but the flash_mla package does not import")
    if name == "triton" and not can_run_triton():
        raise ValueError("sparse_mla_provider: 'triton' needs a CUDA build of paddle or TRITON_INTERPRET=1")


INDEX_KERNEL_BACKENDS = ("auto", "reference", "triton")


def select_kernels(
    kernel_backend: str = "auto",
    sparse_mla_provider: str = "auto",
    mla_prefill_form: str = "auto",
    index_kernel_backend: str = "auto",
) -> KernelConfig:
    """Resolve the settings into a KernelConfig and log it; a ValueError names a bad setting."""
    gpu = can_run_triton() and not interpret_mode()
    if kernel_backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend: unknown backend {kernel_backend!r}; choose one of {KERNEL_BACKENDS}")
    if kernel_backend == "triton" and not can_run_triton():
        raise ValueError("kernel_backend: 'triton' needs a CUDA build of paddle or TRITON_INTERPRET=1")
    triton = gpu if kernel_backend == "auto" else kernel_backend == "triton"
    if sparse_mla_provider == "auto":
        provider = "flashmla" if gpu and flashmla_importable() else "triton" if triton else "reference"
    else:
        _check_provider(sparse_mla_provider)
        provider = sparse_mla_provider
    if mla_prefill_form not in MLA_PREFILL_FORMS:
        raise ValueError(f"mla_prefill_form: unknown form {mla_prefill_form!r}; choose one of {MLA_PREFILL_FORMS}")
    if index_kernel_backend not in INDEX_KERNEL_BACKENDS:
        raise ValueError(
            f"index_kernel_backend: unknown backend {index_kernel_backend!r}; choose one of {INDEX_KERNEL_BACKENDS}"
        )
    kernels = KernelConfig(
        triton=triton,
        sparse_mla_provider=provider,
        mla_prefill_form=mla_prefill_form,
        index_triton=index_kernel_backend == "triton" or (index_kernel_backend == "auto" and triton and gpu),
    )
    logger.info(
        "kernels: %s for the window indexer, the FP8 cache, MLA prefill and full layers; sparse MLA attention "
        "provider: %s; prefill form: %s",
        "Triton" + (" (interpreter)" if triton and interpret_mode() else "") if triton else "paddle references",
        provider,
        mla_prefill_form,
    )
    return kernels
