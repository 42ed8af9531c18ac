"""Sparse MLA providers: one interface, three objects, for SWA and full layers alike
(docs/design.md §4.5). A provider owns what differs between them: its index-row multiple, its
per-step metadata (FlashMLA's decode schedule, dense decodes over a bf16 latent cache), whether
decodes and prefills go in separate calls, its kernel calls, and the rates the prefill cost model
(``prefill_form.py``) prices its absorbed form at.

- ``flashmla``: FlashMLA's kernels (sm_90), when ``flash_mla`` imports and paddle has CUDA.
  Decode: ``flash_mla_with_kvcache`` on the FP8 cache with ``indices`` (the whole batch as one
  request, b = 1, s_q = T), or, over a full layer's bf16 latent cache, its dense decode on the
  paged cache. Prefill: ``flash_mla_sparse_fwd`` over a bf16 gather of the slots the indices
  name. Heads are zero-padded to 64 or 128 and sliced back; index rows are padded with -1 to
  FlashMLA's topk multiple (64 decode, 128 prefill).
- ``triton``: the project's kernel (``ops/triton_ops/sparse_mla.py`` and ``sparse_mla_kernel.py``).
- ``reference``: paddle ops over the de-quantized cache (``ops/triton_ops/sparse_mla.py``).

``kernel_select.select_kernels`` chooses the provider's name once at start-up (KernelConfig keeps
the name: it is pickled to the workers); ``provider_for`` turns it into the object, here only.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from fastdeploy.config import KernelConfig
from fastdeploy.model_executor.layers.attention.prefill_form import CPU_REFERENCE_RATES, H200_RATES, PrefillRates
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache import RECORD_BYTES, dequant_mla_fp8_cache
from fastdeploy.model_executor.ops.triton_ops.sparse_mla import sparse_mla_reference, sparse_mla_triton


@dataclass
class DenseDecode:
    """A full layer's decodes for FlashMLA's dense kernel: block_table int32 [n, max_blocks] (the
    full group's rows of the group's requests) and cache_seqlens int32 [n] (tokens cached after
    this step's write)."""

    block_table: paddle.Tensor
    cache_seqlens: paddle.Tensor


class SparseMLAProvider:
    """q [T, H, 576] attending over the cache slots its index rows name. The base class is the
    contract and the defaults (one call for decodes and prefills, no index padding, no step
    metadata); each provider overrides what it does differently."""

    name = ""
    split_decode = False  # decodes and prefills in separate calls (separate kernels)
    keeps_float32 = False  # a float32 q stays float32 (else bf16, as the GPU kernels take it)
    prefill_rates: PrefillRates = H200_RATES  # what the cost model prices both prefill forms at

    def topk_multiple(self, is_prefill: bool) -> int:
        """Index rows must be a multiple of this long."""
        return 1

    @property
    def step_topk_multiple(self) -> int:
        """One multiple that suits both of the provider's kernels, so a step's indices are padded once."""
        return max(self.topk_multiple(False), self.topk_multiple(True))

    def dense_decode(self, cache_dtype: str) -> bool:
        """Whether full layers' decodes over a latent cache of ``cache_dtype`` skip the indices
        (the plan then gives their block-table rows and lengths, ``DenseDecode``)."""
        return False

    def decode_schedule(self) -> object | None:
        """The step's decode schedule, made once a step when the step has decodes."""
        return None

    def check(self, q: paddle.Tensor, kv_cache: paddle.Tensor, indices: paddle.Tensor | None) -> None:
        if q.ndim != 3 or q.shape[-1] != 576:
            raise ValueError(f"sparse_mla_attention: q must be [T, H, 576], got {list(q.shape)}")
        records = kv_cache.dtype == paddle.uint8 and kv_cache.shape[-1] == RECORD_BYTES
        latent = kv_cache.dtype != paddle.uint8 and kv_cache.shape[-1] == 576
        if not (records or latent):
            raise ValueError(
                "sparse_mla_attention: kv_cache must be uint8 [..., 656] or a full layer's [..., 576] latent cache, "
                f"got {kv_cache.dtype} {kv_cache.shape}"
            )
        if indices is not None and (indices.ndim != 2 or indices.shape[0] != q.shape[0]):
            raise ValueError(f"sparse_mla_attention: indices must be [T={q.shape[0]}, topk], got {list(indices.shape)}")

    def attend(
        self,
        q: paddle.Tensor,
        kv_cache: paddle.Tensor,
        indices: paddle.Tensor | None,
        softmax_scale: float,
        is_prefill: bool,
        schedule: object | None,
        dense_decode: DenseDecode | None,
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        raise NotImplementedError


class TritonProvider(SparseMLAProvider):
    name = "triton"

    def attend(self, q, kv_cache, indices, softmax_scale, is_prefill, schedule, dense_decode):
        return sparse_mla_triton(q, kv_cache, _needed(indices, self), softmax_scale)


class ReferenceProvider(SparseMLAProvider):
    name = "reference"
    keeps_float32 = True
    prefill_rates = CPU_REFERENCE_RATES

    def attend(self, q, kv_cache, indices, softmax_scale, is_prefill, schedule, dense_decode):
        return sparse_mla_reference(q, kv_cache, _needed(indices, self), softmax_scale)


class FlashMLAProvider(SparseMLAProvider):
    name = "flashmla"
    split_decode = True

    def topk_multiple(self, is_prefill: bool) -> int:
        return 128 if is_prefill else 64

    def dense_decode(self, cache_dtype: str) -> bool:
        return cache_dtype == "bfloat16"

    def decode_schedule(self) -> object:
        return flashmla_schedule()

    def check(self, q, kv_cache, indices):
        super().check(q, kv_cache, indices)
        if kv_cache.dtype not in (paddle.uint8, paddle.bfloat16):
            raise ValueError(
                "sparse_mla_attention: kv_cache must be uint8 [..., 656] or a full layer's [..., 576] latent cache "
                f"(bf16 for flashmla), got {kv_cache.dtype} {kv_cache.shape}"
            )

    def attend(self, q, kv_cache, indices, softmax_scale, is_prefill, schedule, dense_decode):
        if kv_cache.dtype == paddle.bfloat16 and not is_prefill:
            if dense_decode is None:
                raise ValueError("sparse_mla_attention: FlashMLA decodes over a bf16 latent cache need dense_decode")
            return flashmla_dense_decode(q, kv_cache, dense_decode, softmax_scale, schedule)
        return _flashmla(q, kv_cache, indices, softmax_scale, is_prefill, schedule, self.topk_multiple(is_prefill))


PROVIDERS: dict[str, SparseMLAProvider] = {
    p.name: p for p in (FlashMLAProvider(), TritonProvider(), ReferenceProvider())
}


def provider_for(kernels: KernelConfig | str) -> SparseMLAProvider:
    """The provider object of a KernelConfig (or of a provider name)."""
    name = kernels if isinstance(kernels, str) else kernels.sparse_mla_provider
    if name not in PROVIDERS:
        raise ValueError(f"sparse_mla_attention: unknown provider {name!r}; one of {tuple(PROVIDERS)}")
    return PROVIDERS[name]


def _needed(indices: paddle.Tensor | None, provider: SparseMLAProvider) -> paddle.Tensor:
    if indices is None:
        raise ValueError(f"sparse_mla_attention: provider {provider.name!r} needs indices")
    return indices


def sparse_mla_attention(
    q: paddle.Tensor,
    kv_cache: paddle.Tensor,
    indices: paddle.Tensor | None,
    softmax_scale: float,
    provider: SparseMLAProvider | str,
    is_prefill: bool = False,
    schedule: object | None = None,
    dense_decode: DenseDecode | None = None,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """q bf16 [T, H, 576], kv_cache uint8 [num_blocks, block_size, 1, 656] (SWA layers, or full
    layers with an FP8 cache) or a full layer's [num_blocks, block_size, 1, 576] latent cache,
    indices int32 [T, topk] (-1 = none) -> (out bf16 [T, H, 512], lse float32 [T, H], natural log).

    A float32 q (the CPU model) is accepted too and gives a float32 out: no bf16 rounding on a
    path that does not need it. FlashMLA always computes in bf16.

    ``is_prefill`` picks FlashMLA's prefill kernel and ``schedule`` is its decode schedule for
    the step (the step plan makes it once; None makes one here); with a bf16 latent cache,
    FlashMLA decodes run its dense kernel over ``dense_decode`` (block-table rows and cache
    lengths) and need no indices. The other providers ignore all three."""
    p = provider if isinstance(provider, SparseMLAProvider) else provider_for(provider)
    p.check(q, kv_cache, indices)
    return p.attend(q, kv_cache, indices, softmax_scale, is_prefill, schedule, dense_decode)


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


def _padded_bf16_q(q: paddle.Tensor) -> paddle.Tensor:
    """q [T, H, 576] -> bf16 [T, 64 or 128, 576], the extra heads zero."""
    T, H = q.shape[0], q.shape[1]
    q, hp = q.astype("bfloat16"), _pad_heads(H)
    return paddle.concat([q, paddle.zeros([T, hp - H, 576], dtype=q.dtype)], axis=1) if hp != H else q


def _schedule_args(schedule: object | None) -> tuple[object, dict]:
    """The step's schedule (a new one when None) and the extra keyword releases that return
    (metadata, num_splits) want."""
    sched = flashmla_schedule() if schedule is None else schedule
    if isinstance(sched, tuple):
        return sched[0], {"num_splits": sched[1]}
    return sched, {}


def flashmla_schedule() -> object:
    """FlashMLA's decode schedule object for one step (``get_mla_metadata``)."""
    import flash_mla

    return flash_mla.get_mla_metadata()


def _flashmla(
    q: paddle.Tensor,
    kv_cache: paddle.Tensor,
    indices: paddle.Tensor,
    softmax_scale: float,
    is_prefill: bool,
    schedule: object | None,
    multiple: int,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """FlashMLA is a torch extension: paddle tensors cross as zero-copy dlpack views; index rows
    padded with -1 to ``multiple``."""
    import flash_mla

    H = q.shape[1]
    out_dtype, qp = q.dtype, _padded_bf16_q(q)
    idx = indices.astype("int32")
    idx = paddle.where(idx >= 0, idx, paddle.full_like(idx, -1))  # -1 is the only safe invalid index
    idx = _pad_last(idx, multiple, -1)
    if is_prefill:
        # gather the named slots once (FP8 records de-quantized to bf16), renumber the indices into the gather
        flat = idx.flatten()
        valid = flat >= 0
        uniq, inverse = paddle.unique(paddle.where(valid, flat, paddle.zeros_like(flat)), return_inverse=True)
        rows = kv_cache.reshape([-1, kv_cache.shape[-1]])[uniq]
        kv = (dequant_mla_fp8_cache(rows) if kv_cache.dtype == paddle.uint8 else rows).reshape([-1, 1, 576])
        local = paddle.where(valid, inverse.astype("int32"), paddle.full_like(flat, -1)).reshape(idx.shape)
        out, _max_logits, lse = flash_mla.flash_mla_sparse_fwd(
            _torch(qp), _torch(kv), _torch(local.unsqueeze(1)), softmax_scale, d_v=512
        )
        out, lse = _paddle(out), _paddle(lse)  # [T, hp, 512], [T, hp]
    else:
        sched, extra = _schedule_args(schedule)
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


def flashmla_dense_decode(
    q: paddle.Tensor,
    cache: paddle.Tensor,
    dense: DenseDecode,
    softmax_scale: float,
    schedule: object | None,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """FlashMLA's dense decode for full layers: q [n, H, 576] (one token a request), a bf16 cache
    [num_blocks, block_size, 1, 576], the decodes' block-table rows int32 [n, max_blocks] and cache
    lengths int32 [n] -> (out [n, H, 512] in q's dtype, lse float32 [n, H]). Heads are zero-padded
    to 64 / 128 as for the sparse kernels."""
    import flash_mla

    H = q.shape[1]
    qp = _padded_bf16_q(q)
    sched, extra = _schedule_args(schedule)
    out, lse = flash_mla.flash_mla_with_kvcache(
        _torch(qp.unsqueeze(1)),
        _torch(cache),
        _torch(dense.block_table.astype("int32")),
        _torch(dense.cache_seqlens.astype("int32")),
        head_dim_v=512,
        tile_scheduler_metadata=sched,
        softmax_scale=softmax_scale,
        causal=True,
        **extra,
    )
    lse = _paddle(lse).reshape([q.shape[0], -1])[:, :H]
    return _paddle(out)[:, 0, :H].astype(q.dtype), lse.astype("float32")
