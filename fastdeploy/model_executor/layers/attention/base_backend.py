"""MLABackendBase: what the full-layer and the SWA backends share (docs/design.md §4.7).

A backend owns its layer's attention: it writes the step's latent into the cache, then runs each
token group the step builder made for its window (``meta.attn_groups[window]``, 0 for full
layers) in that group's form:
- ``mha``: prefill requests in MHA form. The keys in view (the window, or the whole context, then
  the chunk itself) are read back from the cache, so they carry exactly the rounding that decodes
  will read (FP8 records for SWA layers), decompressed through W_UK and W_UV, and attended with
  192-wide QK and 128-wide PV per head (``mla_prefill``);
- otherwise absorbed: q_nope through W_UK, attention over the latent (576 / 512 wide), the latent
  output through W_UV. How a backend attends absorbed is its own (``absorbed``).
Both forms give the per-head value output [n, H, v_head_dim], which goes into o_proj.
"""

from __future__ import annotations

import paddle

from fastdeploy.config import KernelConfig
from fastdeploy.model_executor.forward_meta import ForwardMeta, TokenGroup
from fastdeploy.model_executor.ops.triton_ops.mla_prefill import mla_prefill_attention, mla_prefill_ref


class MLABackendBase:
    window = 0  # 0: full causal attention; an SWA backend sets its W
    absorbed_on_reference = True  # whether ``absorbed`` runs a paddle reference (sets its q dtype)

    def __init__(self, softmax_scale: float, kernels: KernelConfig) -> None:
        self.softmax_scale = softmax_scale
        self.kernels = kernels
        self.mla_prefill = mla_prefill_attention if kernels.triton else mla_prefill_ref

    # ------------------------------------------------------------ per backend
    def write_cache(self, kv_c: paddle.Tensor, k_pe: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta) -> None:
        raise NotImplementedError

    def read_cache(self, cache: paddle.Tensor, slots: paddle.Tensor) -> paddle.Tensor:
        """float32 [n, 576] entries at slots int64 [n]."""
        raise NotImplementedError

    def absorbed(self, q: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta, group: TokenGroup) -> paddle.Tensor:
        """q [n, H, 576] (absorbed, in ``compute_dtype``) of the group's tokens -> latent float32
        [n, H, 512]."""
        raise NotImplementedError

    # ------------------------------------------------------------ shared
    def compute_dtype(self, model_dtype: paddle.dtype, reference: bool) -> str:
        """bf16 for kernels; a float32 CPU model on a paddle reference keeps float32, so the
        attention adds no rounding beyond the cache's."""
        return "float32" if reference and model_dtype == paddle.float32 else "bfloat16"

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
    ) -> paddle.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, 64] (rotated), kv_c [T, 512], k_pe [T, 64] in the
        model dtype; w_uk float32 [H, nope, 512], w_uv [H, v, 512] -> float32 [T, H, v]."""
        self.write_cache(kv_c, k_pe, cache, meta)
        absorbed_dtype = self.compute_dtype(kv_c.dtype, self.absorbed_on_reference)
        out = None
        for group in meta.attn_groups[self.window]:
            t = group.tokens
            qn, qp = (q_nope, q_pe) if t is None else (q_nope[t], q_pe[t])
            if group.form == "mha":
                o = self.mha(qn, qp, cache, group, w_uk, w_uv)
            else:
                q = paddle.concat([paddle.einsum("thn,hnc->thc", qn.astype("float32"), w_uk), qp.astype("float32")], -1)
                q = q.astype(absorbed_dtype)
                o = paddle.einsum("thc,hvc->thv", self.absorbed(q, cache, meta, group), w_uv)
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
        dt = self.compute_dtype(q_nope.dtype, not self.kernels.triton)
        latent = self.read_cache(cache, keys.slots)  # [S, 576]: the values decodes read
        H, nope, v_dim = w_uk.shape[0], w_uk.shape[1], w_uv.shape[1]
        mm = dt if paddle.is_compiled_with_cuda() else "float32"  # CPU paddle has no bf16 matmul
        lat = latent[:, :512].astype(mm)
        S = lat.shape[0]
        k = paddle.matmul(lat, w_uk.reshape([H * nope, 512]).astype(mm), transpose_y=True)
        v = paddle.matmul(lat, w_uv.reshape([H * v_dim, 512]).astype(mm), transpose_y=True)
        k, v = k.reshape([S, H, nope]).astype(dt), v.reshape([S, H, v_dim]).astype(dt)
        q = paddle.concat([q_nope.astype(dt), q_pe.astype(dt)], axis=-1)
        o = self.mla_prefill(
            q,
            k,
            latent[:, 512:].astype(dt),
            v,
            keys.batch,
            self.softmax_scale,
            self.window,
        )
        return o.astype("float32")
