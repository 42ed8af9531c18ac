"""MLABackendBase: what the full-layer and the SWA backends share (docs/design.md §4.2, §4.7).

A backend owns one kind of attention layer, end to end:
- ``kv_spec``: its cache layout (group, dtype, bytes a token, last dim), which the runner's sizing
  and allocation, ``tools/plan`` and the test harness read; nothing else spells a layout;
- ``plan_step``: its kind's plan of each step (``step_plan.StepPlan``), made once a step by the
  step builder and read by every layer of the kind from ``meta.attn[kind]``;
- ``forward``: write the step's latent into the cache, then run each token group of the plan in
  its form:
  - ``mha``: prefill requests in MHA form. The keys in view (the window, or the whole context, then
    the chunk itself) are read back from the cache, so they carry exactly the rounding that
    decodes will read (FP8 records for SWA layers), decompressed through W_UK and W_UV, and
    attended with 192-wide QK and 128-wide PV per head (``mla_prefill``);
  - otherwise absorbed: q_nope through W_UK, sparse MLA over the latent (576 / 512 wide) through
    the step's provider (``sparse_mla_attention``), the latent output through W_UV.
Both forms give the per-head value output [n, H, v_head_dim], which goes into o_proj.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import paddle

from fastdeploy.config import CacheConfig, KernelConfig
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.sparse_mla_providers import provider_for
from fastdeploy.model_executor.layers.attention.step_plan import StepPlan, TokenGroup
from fastdeploy.model_executor.ops.triton_ops.mla_fp8_cache import (
    RECORD_BYTES,
    dequant_mla_fp8_cache,
    dequant_mla_fp8_cache_ref,
    write_mla_fp8_cache,
    write_mla_fp8_cache_ref,
)
from fastdeploy.model_executor.ops.triton_ops.mla_prefill import mla_prefill_attention, mla_prefill_ref

LATENT_WIDTH = 576  # kv_c (512) then k_pe (64): a latent cache entry in the model dtype or bf16
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class IndexedCache(NamedTuple):
    """A DSA layer's two cache tensors: ``kv`` its latent (FP8 records or 576 values) and
    ``index`` its indexer keys (``ops/triton_ops/lightning_indexer.py``)."""

    kv: paddle.Tensor
    index: paddle.Tensor


@dataclass(frozen=True)
class KVSpec:
    """One layer's KV cache layout: its KV cache ``group`` (block pool), element ``dtype``,
    ``bytes_per_token`` (all of the layer's tensors) and ``last_dim``; the tensor is [num_blocks,
    block_size, 1, last_dim]. ``index``: a DSA layer's second tensor, its indexer keys, in the
    same group and blocks (None for other layers)."""

    group: str
    dtype: str
    bytes_per_token: int
    last_dim: int
    index: KVSpec | None = None

    @classmethod
    def records(cls, group: str) -> KVSpec:
        """The 656-byte FP8 record of docs/design.md §4.4, as uint8."""
        return cls(group, "uint8", RECORD_BYTES, RECORD_BYTES)

    @classmethod
    def latent(cls, group: str, dtype: str) -> KVSpec:
        """576 latent values in ``dtype``."""
        return cls(group, dtype, LATENT_WIDTH * _ITEMSIZE[dtype], LATENT_WIDTH)

    def with_index(self, head_dim: int, fp8: bool) -> KVSpec:
        """This layout plus a DSA layer's indexer keys of width ``head_dim``: e4m3 codes and a
        float32 scale (head_dim + 4 bytes), or head_dim values in this layout's dtype."""
        d = head_dim + 4 if fp8 else head_dim
        index = (
            KVSpec(self.group, "uint8", d, d) if fp8 else KVSpec(self.group, self.dtype, d * _ITEMSIZE[self.dtype], d)
        )
        return replace(self, bytes_per_token=self.bytes_per_token + index.bytes_per_token, index=index)

    def shape(self, num_blocks: int, block_size: int) -> list[int]:
        return [num_blocks, block_size, 1, self.last_dim]

    def allocate(self, num_blocks: int, block_size: int, poison: bool = False) -> paddle.Tensor | IndexedCache:
        """The layer's cache: zeros, or with ``poison`` NaN everywhere (every byte 0xFF in a uint8
        tensor: NaN codes, scales and rope); an IndexedCache when the layer has indexer keys."""
        fill = (0xFF if self.dtype == "uint8" else float("nan")) if poison else 0
        kv = paddle.full(self.shape(num_blocks, block_size), fill, dtype=self.dtype)
        return kv if self.index is None else IndexedCache(kv, self.index.allocate(num_blocks, block_size, poison))


def record_writer(kernels: KernelConfig):
    """The FP8 record writer ``kernels`` picks: the Triton kernel or its paddle reference."""
    return write_mla_fp8_cache if kernels.triton else write_mla_fp8_cache_ref


class MLABackendBase:
    """``softmax_scale``; ``kernels`` the implementation switch; ``num_heads`` this rank's heads
    (the prefill-form cost model counts them); ``model_dtype`` the model's dtype name."""

    window = 0  # 0: full causal attention; an SWA backend sets its W

    def __init__(self, softmax_scale: float, kernels: KernelConfig, num_heads: int, model_dtype: str) -> None:
        self.softmax_scale = softmax_scale
        self.kernels = kernels
        self.provider = provider_for(kernels)  # the sparse MLA provider of absorbed attention
        self.num_heads = num_heads
        self.model_dtype = model_dtype
        self.mla_prefill = mla_prefill_attention if kernels.triton else mla_prefill_ref
        self.write_records = record_writer(kernels)
        self.dequant_records = dequant_mla_fp8_cache if kernels.triton else dequant_mla_fp8_cache_ref

    # ------------------------------------------------------------ per backend
    @property
    def kind(self) -> str:
        """The name of this attention kind (the key of its plan in ``ForwardMeta.attn``)."""
        raise NotImplementedError

    @staticmethod
    def kv_spec(cache_config: CacheConfig, model_dtype: str) -> KVSpec:
        """The kind's cache layout under ``cache_config`` in a model of ``model_dtype``: a pure
        function of the two (``kv_spec_for`` asks it without building a backend)."""
        raise NotImplementedError

    def plan_step(self, meta: ForwardMeta) -> StepPlan:
        raise NotImplementedError

    def write_cache(self, kv_c: paddle.Tensor, k_pe: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta) -> None:
        raise NotImplementedError

    def absorbed(
        self,
        q: paddle.Tensor,
        cache: paddle.Tensor,
        meta: ForwardMeta,
        plan: StepPlan,
        group: TokenGroup,
        selection: paddle.Tensor | None,
    ) -> paddle.Tensor:
        """q [n, H, 576] (absorbed, in ``absorbed_dtype``) of the group's tokens -> latent float32
        [n, H, 512]; ``selection``: a DSA layer's picked slots of every token of the step."""
        raise NotImplementedError

    # ------------------------------------------------------------ shared
    def write_latent(
        self, kv_c: paddle.Tensor, k_pe: paddle.Tensor, slots: paddle.Tensor, cache: paddle.Tensor
    ) -> None:
        """Store each token's [kv_c | k_pe] at its slot int32 [T], in the cache's format: FP8
        records (slot -1 skips), or latent rows, every row written (a static shape, as a captured
        step needs) with slot -1 rows in the cache's last slot, the null block's (no pool hands it
        out)."""
        if cache.dtype == paddle.uint8:
            self.write_records(kv_c, k_pe, slots, cache)
            return
        flat = cache.reshape([-1, cache.shape[-1]])
        slots = paddle.where(slots >= 0, slots, paddle.full_like(slots, flat.shape[0] - 1)).astype("int64")
        flat[slots] = paddle.concat([kv_c, k_pe], axis=-1).astype(cache.dtype)

    def read_cache(self, cache: paddle.Tensor, slots: paddle.Tensor) -> paddle.Tensor:
        """float32 [n, 576] entries at slots int64 [n], FP8 records de-quantized."""
        flat = cache.reshape([-1, cache.shape[-1]])[slots]
        return (self.dequant_records(flat) if cache.dtype == paddle.uint8 else flat).astype("float32")

    def absorbed_dtype(self, model_dtype: paddle.dtype) -> str:
        """bf16 for kernels; a float32 CPU model on the reference provider keeps float32, so the
        attention adds no rounding beyond the cache's."""
        keep = self.provider.keeps_float32
        return "float32" if keep and model_dtype == paddle.float32 else "bfloat16"

    def forward(
        self,
        q_nope: paddle.Tensor,
        q_pe: paddle.Tensor,
        kv_c: paddle.Tensor,
        k_pe: paddle.Tensor,
        cache: paddle.Tensor,
        meta: ForwardMeta,
        w_uk: paddle.Tensor,
        w_uv: paddle.Tensor,
        selection: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, 64] (rotated), kv_c [T, 512], k_pe [T, 64] in the
        model dtype; w_uk float32 [H, nope, 512], w_uv [H, v, 512] -> float32 [T, H, v].
        ``selection`` int32 [T, topk]: the slots a DSA layer's indexer picked for each token."""
        self.write_cache(kv_c, k_pe, cache, meta)
        plan = meta.attn[self.kind]
        dtype = self.absorbed_dtype(kv_c.dtype)
        out = None
        for group in plan.groups:
            t = group.tokens
            qn, qp = (q_nope, q_pe) if t is None else (q_nope[t], q_pe[t])
            if group.form == "mha":
                o = self.mha(qn, qp, cache, group, w_uk, w_uv)
            else:
                q = paddle.concat([paddle.einsum("thn,hnc->thc", qn.astype("float32"), w_uk), qp.astype("float32")], -1)
                o = paddle.einsum(
                    "thc,hvc->thv", self.absorbed(q.astype(dtype), cache, meta, plan, group, selection), w_uv
                )
            if t is None:
                return o
            out = paddle.zeros([q_nope.shape[0], q_nope.shape[1], w_uv.shape[1]], "float32") if out is None else out
            out[t] = o
        return out

    def mha(
        self,
        q_nope: paddle.Tensor,
        q_pe: paddle.Tensor,
        cache: paddle.Tensor,
        group: TokenGroup,
        w_uk: paddle.Tensor,
        w_uv: paddle.Tensor,
    ) -> paddle.Tensor:
        """The group's prefill requests in MHA form -> float32 [n, H, v]."""
        keys = group.mha
        dt = "float32" if not self.kernels.triton and q_nope.dtype == paddle.float32 else "bfloat16"
        latent = self.read_cache(cache, keys.slots)  # [S, 576]: the values decodes read
        H, nope, v_dim = w_uk.shape[0], w_uk.shape[1], w_uv.shape[1]
        mm = dt if paddle.is_compiled_with_cuda() else "float32"  # CPU paddle has no bf16 matmul
        lat = latent[:, :512].astype(mm)
        S = lat.shape[0]
        k = paddle.matmul(lat, w_uk.reshape([H * nope, 512]).astype(mm), transpose_y=True)
        v = paddle.matmul(lat, w_uv.reshape([H * v_dim, 512]).astype(mm), transpose_y=True)
        k, v = k.reshape([S, H, nope]).astype(dt), v.reshape([S, H, v_dim]).astype(dt)
        q = paddle.concat([q_nope.astype(dt), q_pe.astype(dt)], axis=-1)
        o = self.mla_prefill(q, k, latent[:, 512:].astype(dt), v, keys.batch, self.softmax_scale, self.window)
        return o.astype("float32")
