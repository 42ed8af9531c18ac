"""``sparse_mla_attention``: one interface, three providers (DESIGN.md §4, §7).

- ``flashmla``: FlashMLA's sparse kernels (sm_90), when ``flash_mla`` imports and paddle has
  CUDA. Decode: ``flash_mla_with_kvcache`` on the FP8 cache with ``indices`` (the whole batch as
  one request, b = 1, s_q = T). Prefill: ``flash_mla_sparse_fwd`` over a bf16 gather of the
  slots the indices name. Heads are zero-padded to 64 or 128 and sliced back; index rows are
  padded with -1 to FlashMLA's topk multiple (64 decode, 128 prefill).
- ``triton``: the project's kernel (``ops/triton_ops/sparse_mla_kernel.py``).
- ``reference``: paddle ops over the de-quantized cache; the CPU default.

The provider is chosen once (by name, ``FD_SPARSE_MLA_PROVIDER``, or automatically) and logged.
"""

from __future__ import annotations

import logging
import os

import paddle

from fastdeploy.model_executor.ops.triton_ops.launcher import can_run_triton, interpret_mode
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache import RECORD_BYTES, dequant_mla_fp8_cache_ref
from fastdeploy.model_executor.ops.triton_ops.sparse_mla_kernel import (
    default_num_splits,
    launch_sparse_mla,
    tuned_config,
)

logger = logging.getLogger("fastdeploy")

PROVIDERS = ("flashmla", "triton", "reference")
_chosen: str | None = None


def _flashmla_importable() -> bool:
    try:
        import flash_mla  # noqa: F401
    except ImportError:
        return False
    return True


def select_provider(name: str | None = None) -> str:
    """Resolve a provider name; ``None``/``"auto"`` picks once (env ``FD_SPARSE_MLA_PROVIDER``
    first) and remembers the choice."""
    global _chosen
    if name is None or name == "auto":
        if _chosen is None:
            env = os.environ.get("FD_SPARSE_MLA_PROVIDER", "auto")
            _chosen = _auto() if env == "auto" else select_provider(env)
            logger.info("sparse MLA attention provider: %s", _chosen)
        return _chosen
    if name not in PROVIDERS:
        raise ValueError(f"unknown sparse MLA provider {name!r}; choose one of {PROVIDERS} or 'auto'")
    if name == "flashmla" and not _flashmla_importable():
        raise ValueError("sparse MLA provider 'flashmla' asked for, but the flash_mla package does not import")
    if name == "triton" and not can_run_triton():
        raise ValueError("sparse MLA provider 'triton' needs a CUDA build of paddle or TRITON_INTERPRET=1")
    return name


def _auto() -> str:
    gpu = can_run_triton() and not interpret_mode()
    if gpu and _flashmla_importable():
        return "flashmla"
    return "triton" if gpu else "reference"


def topk_multiple(provider: str, is_prefill: bool) -> int:
    """Index rows must be a multiple of this for ``provider`` (FlashMLA: 64 decode, 128 prefill)."""
    if provider == "flashmla":
        return 128 if is_prefill else 64
    return 1


def _check(q: paddle.Tensor, kv_cache: paddle.Tensor, indices: paddle.Tensor) -> None:
    if q.ndim != 3 or q.shape[-1] != 576:
        raise ValueError(f"sparse_mla_attention: q must be [T, H, 576], got {list(q.shape)}")
    if kv_cache.dtype != paddle.uint8 or kv_cache.shape[-1] != RECORD_BYTES:
        raise ValueError(
            f"sparse_mla_attention: kv_cache must be uint8 [..., 656], got {kv_cache.dtype} {kv_cache.shape}"
        )
    if indices.ndim != 2 or indices.shape[0] != q.shape[0]:
        raise ValueError(f"sparse_mla_attention: indices must be [T={q.shape[0]}, topk], got {list(indices.shape)}")


def sparse_mla_attention(
    q: paddle.Tensor,
    kv_cache: paddle.Tensor,
    indices: paddle.Tensor,
    softmax_scale: float,
    provider: str | None = None,
    is_prefill: bool = False,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """q bf16 [T, H, 576], kv_cache uint8 [num_blocks, block_size, 1, 656], indices int32
    [T, topk] (-1 = none) -> (out bf16 [T, H, 512], lse float32 [T, H], natural log).

    A float32 q (the CPU model) is accepted too and gives a float32 out: no bf16 rounding on a
    path that does not need it. FlashMLA always computes in bf16.

    ``is_prefill`` picks FlashMLA's prefill kernel; the other providers ignore it."""
    _check(q, kv_cache, indices)
    name = select_provider(provider)
    if name == "flashmla":
        return _flashmla(q, kv_cache, indices, softmax_scale, is_prefill)
    if name == "triton":
        return sparse_mla_triton(q, kv_cache, indices, softmax_scale)
    return sparse_mla_reference(q, kv_cache, indices, softmax_scale)


def sparse_mla_triton(
    q: paddle.Tensor,
    kv_cache: paddle.Tensor,
    indices: paddle.Tensor,
    softmax_scale: float,
    num_splits: int | None = None,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """The Triton provider; ``num_splits`` None picks split-KV for small batches."""
    T, H = q.shape[0], q.shape[1]
    out = paddle.empty([T, H, 512], dtype=q.dtype)
    lse = paddle.empty([T, H], dtype="float32")
    idx = indices.astype("int32").contiguous()
    if num_splits is None:
        cfg = tuned_config(T, H)
        num_splits = default_num_splits(T, H, idx.shape[1], cfg["block_h"], cfg["block_n"])
    partial = partial_lse = None
    if num_splits > 1:
        partial = paddle.empty([T, num_splits, H, 512], dtype="float32")
        partial_lse = paddle.empty([T, num_splits, H], dtype="float32")
    launch_sparse_mla(
        q.contiguous(),
        kv_cache,
        idx,
        out,
        lse,
        softmax_scale,
        num_splits=num_splits,
        partial=partial,
        partial_lse=partial_lse,
    )
    return out, lse


def sparse_mla_reference(
    q: paddle.Tensor, kv_cache: paddle.Tensor, indices: paddle.Tensor, softmax_scale: float, chunk: int = 128
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Paddle reference in float32, ``chunk`` tokens at a time to bound the gathered memory."""
    records = kv_cache.reshape([-1, RECORD_BYTES])
    outs, lses = [], []
    for s in range(0, q.shape[0], chunk):
        idx = indices[s : s + chunk].astype("int64")
        ok = idx >= 0
        kv = dequant_mla_fp8_cache_ref(records[idx.clip(min=0).flatten()]).astype("float32")
        kv = kv.reshape(list(idx.shape) + [576])
        kv = paddle.where(ok.unsqueeze(-1), kv, paddle.zeros_like(kv))  # never let a masked slot's bytes in
        qf = q[s : s + chunk].astype("float32")
        logits = paddle.einsum("thd,tkd->thk", qf, kv) * softmax_scale
        logits = paddle.where(ok.unsqueeze(1), logits, paddle.full_like(logits, float("-inf")))
        lse = paddle.logsumexp(logits, axis=-1)
        has = ok.any(axis=-1, keepdim=True)
        p = paddle.where(has.unsqueeze(-1), paddle.exp(logits - lse.unsqueeze(-1)), paddle.zeros_like(logits))
        outs.append(paddle.einsum("thk,tkd->thd", p, kv[..., :512]).astype(q.dtype))
        lses.append(paddle.where(has, lse, paddle.full_like(lse, float("inf"))))
    if not outs:
        return paddle.empty([0, q.shape[1], 512], q.dtype), paddle.empty([0, q.shape[1]], "float32")
    return paddle.concat(outs), paddle.concat(lses)


# ---------------------------------------------------------------- FlashMLA


def _pad_heads(h: int) -> int:
    if h > 128:
        raise ValueError(f"FlashMLA sparse kernels take at most 128 heads per call, got {h}")
    return 64 if h <= 64 else 128


def _pad_last(x: paddle.Tensor, multiple: int, value: int) -> paddle.Tensor:
    k = x.shape[-1]
    extra = -k % multiple
    if extra == 0:
        return x
    return paddle.concat([x, paddle.full(list(x.shape[:-1]) + [extra], value, dtype=x.dtype)], axis=-1)


def _torch(x: paddle.Tensor):
    import torch

    return torch.from_dlpack(x.contiguous())


def _paddle(x) -> paddle.Tensor:
    return paddle.from_dlpack(x.contiguous())


def _flashmla(
    q: paddle.Tensor, kv_cache: paddle.Tensor, indices: paddle.Tensor, softmax_scale: float, is_prefill: bool
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """FlashMLA is a torch extension: paddle tensors cross as zero-copy dlpack views."""
    import flash_mla

    T, H = q.shape[0], q.shape[1]
    out_dtype, q = q.dtype, q.astype("bfloat16")
    hp = _pad_heads(H)
    qp = paddle.concat([q, paddle.zeros([T, hp - H, 576], dtype=q.dtype)], axis=1) if hp != H else q
    idx = indices.astype("int32")
    idx = paddle.where(idx >= 0, idx, paddle.full_like(idx, -1))  # -1 is the only safe invalid index
    idx = _pad_last(idx, topk_multiple("flashmla", is_prefill), -1)
    if is_prefill:
        # gather the named slots once, de-quantize to bf16, and renumber the indices into the gather
        flat = idx.flatten()
        valid = flat >= 0
        uniq, inverse = paddle.unique(paddle.where(valid, flat, paddle.zeros_like(flat)), return_inverse=True)
        kv = dequant_mla_fp8_cache_ref(kv_cache.reshape([-1, RECORD_BYTES])[uniq]).reshape([-1, 1, 576])
        local = paddle.where(valid, inverse.astype("int32"), paddle.full_like(flat, -1)).reshape(idx.shape)
        out, _max_logits, lse = flash_mla.flash_mla_sparse_fwd(
            _torch(qp), _torch(kv), _torch(local.unsqueeze(1)), softmax_scale, d_v=512
        )
        out, lse = _paddle(out), _paddle(lse)  # [T, hp, 512], [T, hp]
    else:
        sched = flash_mla.get_mla_metadata()
        extra = {}
        if isinstance(sched, tuple):  # releases that return (metadata, num_splits)
            sched, extra["num_splits"] = sched
        out, lse = flash_mla.flash_mla_with_kvcache(
            _torch(qp.unsqueeze(0)),
            _torch(kv_cache),
            None,
            None,
            head_dim_v=512,
            tile_scheduler_metadata=sched,
            softmax_scale=softmax_scale,
            causal=False,
            is_fp8_kvcache=True,
            indices=_torch(idx.unsqueeze(0)),
            **extra,
        )
        out = _paddle(out)[0]  # [T, hp, 512]
        lse = _paddle(lse)[0].transpose([1, 0])  # [hp, T] -> [T, hp]
    return out[:, :H].astype(out_dtype), lse[:, :H].astype("float32")
