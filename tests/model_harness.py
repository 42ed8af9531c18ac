"""Drive the paddle model step by step with hand-built batches (no engine), for model tests."""

from __future__ import annotations

import numpy as np

from fastdeploy.config import CacheConfig, FDConfig, KernelConfig, ModelConfig
from fastdeploy.model_executor.forward_meta import ForwardMeta, ForwardMetaBuilder
from fastdeploy.model_executor.load_weight_utils import load_weights
from fastdeploy.model_executor.models.deepseek_mtp import DeepseekV3MTP
from fastdeploy.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM, layer_kv_specs


class Harness:
    """A loaded model, NaN-poisoned caches in the layouts the backends declare, and per-request
    block tables drawn at random, a different one in each KV cache group (``tables[group][rid]``).
    ``kernels`` picks the implementations (default: the CPU reference path); ``mtp``: the
    checkpoint's MTP layer too (``self.mtp``, its cache the last)."""

    def __init__(
        self,
        model_dir: str,
        block_size: int = 16,
        num_blocks: int = 64,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
        kernels: KernelConfig | None = None,
        quantization: str = "none",
        mtp: bool = False,
    ) -> None:
        self.cfg = ModelConfig.from_pretrained(model_dir)
        self.cfg.quantization = quantization
        self.cfg.mtp_layers = int(mtp)
        self.kernels = kernels or KernelConfig()
        cache_config = CacheConfig(block_size, num_blocks, kv_cache_dtype=kv_cache_dtype)
        fd = FDConfig(model_config=self.cfg, cache_config=cache_config, kernel_config=self.kernels)
        self.model = DeepseekV3ForCausalLM(fd)
        load_weights(self.model, model_dir, self.cfg.num_hidden_layers, show_progress=False)
        backends = self.model.attention_backends()
        self.mtp = None
        if mtp:
            self.mtp = DeepseekV3MTP(fd, self.model)
            load_weights(self.mtp, model_dir, None, show_progress=False)
            backends += [b for b in self.mtp.attention_backends() if b.kind not in {x.kind for x in backends}]
        self.caches = []
        for spec in layer_kv_specs(self.cfg, cache_config):
            self.caches.append(spec.allocate(num_blocks, block_size, poison=True))
        self.builder = ForwardMetaBuilder(block_size, backends, self.kernels)
        self.block_size = block_size
        groups = list(self.cfg.kv_cache_groups)
        self.free = {g: list(np.random.default_rng([seed, i]).permutation(num_blocks)) for i, g in enumerate(groups)}
        self.tables: dict[str, dict[str, list[int]]] = {g: {} for g in groups}
        self.lens: dict[str, int] = {}

    def share_prefix(self, src: str, dst: str, n_tokens: int) -> None:
        """dst starts with src's first n_tokens already cached (whole blocks, as a prefix hit)."""
        assert n_tokens % self.block_size == 0
        for tables in self.tables.values():
            tables[dst] = list(tables[src][: n_tokens // self.block_size])
        self.lens[dst] = n_tokens

    def build_meta(self, batch: list[tuple[str, list[int]]], decode: set[str] = frozenset()) -> ForwardMeta:
        """ForwardMeta for one step of (request, new token ids), growing each request's blocks."""
        ids, enc, dec = [], [], []
        rows: dict[str, list[list[int]]] = {g: [] for g in self.tables}
        for rid, toks in batch:
            start = self.lens.get(rid, 0)
            for g, tables in self.tables.items():
                table = tables.setdefault(rid, [])
                while len(table) * self.block_size < start + len(toks):
                    table.append(int(self.free[g].pop()))
                rows[g].append(table)
            ids += toks
            enc.append(0 if rid in decode else len(toks))
            dec.append(start)
            self.lens[rid] = start + len(toks)
        return self.builder.build(ids, enc, dec, rows)

    def step(self, batch: list[tuple[str, list[int]]], decode: set[str] = frozenset()) -> dict[str, np.ndarray]:
        """Run one step: each (request, new token ids); returns float64 logits [n, vocab] per request."""
        meta = self.build_meta(batch, decode)
        hidden = self.model(meta, self.caches[: self.cfg.num_hidden_layers])
        logits = self.model.compute_logits(hidden).numpy().astype(np.float64)
        cu = meta.cu_seqlens_q
        return {rid: logits[cu[b] : cu[b + 1]] for b, (rid, _) in enumerate(batch)}

    def prefill(self, rid: str, toks: list[int], chunk: int | None = None) -> np.ndarray:
        """Logits [len(toks), vocab] of a prefill, in chunks of ``chunk`` tokens."""
        chunk = chunk or len(toks)
        parts = [self.step([(rid, toks[s : s + chunk])])[rid] for s in range(0, len(toks), chunk)]
        return np.concatenate(parts)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def position_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Relative error of each position's logits."""
    return np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)


def assert_close_with_routing_flips(got: np.ndarray, want: np.ndarray, median: float, p90: float) -> np.ndarray:
    """Quantized caches move logits a little everywhere and, where an MoE top-k choice flips, a lot
    at a few positions; bound the typical and the 90th-percentile position error."""
    e = position_errors(got, want)
    assert np.median(e) < median, (np.median(e), e)
    assert np.quantile(e, 0.9) < p90, (np.quantile(e, 0.9), e)
    return e
