"""DeepSeek-V3's multi-token-prediction (MTP) module, the engine's draft model (docs/design.md §4.16).

The checkpoint's ``model.layers.{num_hidden_layers}``: from the target's final-normed hidden state
h_t and the embedding of token t + 1,

    x = eh_proj([enorm(embed(t + 1)), hnorm(h_t)])      (concatenated: [T, 2 * hidden])
    x = decoder layer (MLA attention, MoE) over x at position t
    logits = head(shared_head.norm(x))

predicts token t + 2. Its decoder layer is a full one, or an SWA layer when its
``window_attn_skip_freq`` entry says so, with its own KV cache (an extra layer in its group:
same block tables and slots as the target's layers). The embedding and the output head are the
target's (DeepSeek-V3 shares them; the checkpoint's copies under the MTP layer are not loaded).
Run on its own output for further drafts, the previous pass's ``x`` takes h_t's place.
"""

from __future__ import annotations

import re

import numpy as np
import paddle
from paddle import nn

from fastdeploy.config import FDConfig, KernelConfig, ModelConfig
from fastdeploy.distributed.parallel import TPGroup
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.base_backend import MLABackendBase
from fastdeploy.model_executor.layers.linear import ReplicatedLinear
from fastdeploy.model_executor.layers.normalization import RMSNorm
from fastdeploy.model_executor.models.deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3ForCausalLM,
    fp8_linears,
    rope_row_order,
)

__all__ = ["DeepseekV3MTP", "DeepseekV3MTPLayer"]

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the target's: not loaded


class SharedHead(nn.Layer):
    def __init__(self, cfg: ModelConfig, dtype: str) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DeepseekV3MTPLayer(DeepseekV3DecoderLayer):
    """One MTP layer: a decoder layer (id ``layer_id`` >= num_hidden_layers) with enorm, hnorm,
    eh_proj and shared_head.norm."""

    def __init__(
        self, cfg: ModelConfig, layer_id: int, dtype: str, kernels: KernelConfig, tp: TPGroup, kv_cache_dtype: str
    ) -> None:
        super().__init__(cfg, layer_id, dtype, kernels, tp, kv_cache_dtype)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * h, h, dtype, fp8_linears(cfg, kernels))
        self.shared_head = SharedHead(cfg, dtype)

    def forward(  # type: ignore[override]
        self, embeds: paddle.Tensor, hidden: paddle.Tensor, cache: paddle.Tensor, meta: ForwardMeta
    ) -> paddle.Tensor:
        """embeds [T, hidden] (of the next tokens), hidden [T, hidden] -> the layer's output [T, hidden]."""
        x = self.eh_proj(paddle.concat([self.enorm(embeds), self.hnorm(hidden.astype(embeds.dtype))], axis=-1))
        return super().forward(x, cache, meta)


class DeepseekV3MTP(nn.Layer):
    """The draft model over a loaded target: ``cfg.mtp_layers`` MTP layers, the target's
    embedding and LM head."""

    def __init__(self, fd_config: FDConfig, target: DeepseekV3ForCausalLM, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup()
        cfg, kernels = fd_config.model_config, fd_config.kernel_config
        dtype, kv_cache_dtype = cfg.dtype, fd_config.cache_config.kv_cache_dtype
        self.config, self.tp = cfg, tp
        self.first = cfg.num_hidden_layers
        self.layers = nn.LayerList(
            [DeepseekV3MTPLayer(cfg, self.first + i, dtype, kernels, tp, kv_cache_dtype) for i in range(cfg.mtp_layers)]
        )
        self._target = (target,)  # not a sublayer: its parameters are the target's

    @property
    def target(self) -> DeepseekV3ForCausalLM:
        return self._target[0]

    def checkpoint_row_order(self, name: str, rows: int) -> np.ndarray | None:
        return rope_row_order(self.config, name, rows)

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        """Where checkpoint tensor ``name`` loads (as ``DeepseekV3ForCausalLM.checkpoint_target``):
        an MTP layer's tensors into ``layers.{i}``; None for every other tensor, the shared
        embedding and head, and other ranks' experts."""
        m = _LAYER.match(name)
        i = int(m.group(1)) - self.first if m else -1
        if not 0 <= i < len(self.layers) or m.group(2) in SHARED:
            return None
        rest = m.group(2)
        e = re.match(r"mlp\.experts\.(\d+)\.(\w+_proj)\.weight(_scale_inv)?$", rest)
        if e is None:
            return f"layers.{i}.{rest}", None
        t = self.layers[i].mlp.checkpoint_target(int(e.group(1)), e.group(2), e.group(3) or "")
        return None if t is None else (f"layers.{i}.mlp.{t[0]}", t[1])

    def checkpoint_name(self, param: str) -> str:
        """The checkpoint tensor a parameter loads from (for error messages)."""
        m = re.match(r"layers\.(\d+)\.(.+)$", param)
        return f"model.layers.{self.first + int(m.group(1))}.{m.group(2)}" if m else param

    def attention_backends(self) -> list[MLABackendBase]:
        return [layer.self_attn.attn_backend for layer in self.layers]

    def forward(
        self, ids: paddle.Tensor, hidden: paddle.Tensor, meta: ForwardMeta, cache: paddle.Tensor
    ) -> paddle.Tensor:
        """ids int64 [T] (each row's next token), hidden [T, hidden] (the target's final-normed
        hidden states, or the previous pass's output) -> the MTP layer's output [T, hidden]."""
        with paddle.no_grad():
            return self.layers[0](self.target.model.embed_tokens(ids), hidden, cache, meta)

    def compute_logits(self, x: paddle.Tensor, rows: paddle.Tensor) -> paddle.Tensor:
        """float32 [n, vocab] of x[rows], through shared_head.norm and the target's head."""
        with paddle.no_grad():
            return self.target.lm_head(self.layers[0].shared_head.norm(x[rows]))
