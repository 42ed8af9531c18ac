"""Attention backends (each owns its KV cache layout and its step plan) and the sparse MLA
interface. ``DSAAttentionBackend`` is importable from here, where the seed PR's callers look."""

from fastdeploy.model_executor.layers.attention.dsa_attention_backend import DSAAttentionBackend
from fastdeploy.model_executor.layers.attention.mla_attention_backend import MLAAttentionBackend

__all__ = ["DSAAttentionBackend", "MLAAttentionBackend"]
