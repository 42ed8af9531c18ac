"""Configuration: the model's config.json (DeepSeek-V3 + SWA keys) and the engine's settings.

SWA keys follow docs/design.md §4.1: the window W counts the current token; ``window_attn_skip_freq``
(Megatron-Core) or ``layer_types`` (Hugging Face) marks the SWA layers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
INDEXED = "indexed_attention"  # DSA layers: DeepSeek-V3.2's lightning indexer picks their keys
FULL_GROUP, SWA_GROUP = "full", "swa"  # KV cache groups (docs/design.md §4.2)


@dataclass
class ModelConfig:
    """A DeepSeek-V3 style config.json, with the SWA layers resolved per layer."""

    model_dir: str = ""
    architectures: list[str] = field(default_factory=lambda: ["DeepseekV3ForCausalLM"])
    hidden_size: int = 7168
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    n_routed_experts: int | None = 256
    n_shared_experts: int | None = 1
    num_experts_per_tok: int | None = 8
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    n_group: int = 8
    topk_group: int = 4
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-6
    vocab_size: int = 129280
    max_position_embeddings: int = 163840
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    num_nextn_predict_layers: int = 0
    hidden_act: str = "silu"
    # True (Hugging Face's default, DeepSeek's checkpoints): the rope dims of q and k come out of
    # their projections as interleaved pairs; false: as two halves (NeoX), as DeepSeek-V3.2's
    # indexer and GLM-5 store them. The loader reorders a false checkpoint's rope rows to pairs.
    rope_interleave: bool = True
    attention_bias: bool = False
    # DSA (DeepSeek-V3.2's lightning indexer, docs/design.md §4.17): the keys an indexed layer
    # attends, its index heads and their width; the indexer's rope is NeoX halves unless
    # indexer_rope_interleave (DeepSeek's 2025-11 fix; GLM-5 and dots3 set true)
    index_topk: int = 2048
    index_n_heads: int = 64
    index_head_dim: int = 128
    indexer_rope_interleave: bool = False
    # one flag a layer (decoder layers, then MTP layers): 1 where the layer is indexed (DSA)
    index_flags: list[int] = field(default_factory=list)
    # SWA, resolved by _resolve_swa: W (None without a window) and one flag per layer.
    sliding_window: int | None = None
    window_attn_skip_freq: list[int] = field(default_factory=list)
    swa_rope_theta: float | None = None
    # Weights: "fp8" when config.json's quantization_config says DeepSeek's FP8 block format
    # (checkpoint_quant); how the model keeps them (quantization, resolved by EngineArgs).
    checkpoint_quant: str | None = None
    quantization: str = "none"
    # MTP layers the engine runs as its draft model (0 without speculation; set by FDConfig from
    # its SpeculativeConfig): their ids follow the decoder layers' (docs/design.md §4.16)
    mtp_layers: int = 0
    # the dtype the model runs in (resolved: float32, bfloat16 or float16; EngineArgs resolves "auto")
    dtype: str = "float32"

    @classmethod
    def from_pretrained(cls, model_dir: str) -> ModelConfig:
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        cfg = cls.from_dict(raw)
        cfg.model_dir = model_dir
        return cfg

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in fields(cls)} - {
            "sliding_window",
            "window_attn_skip_freq",
            "model_dir",
            "checkpoint_quant",
            "quantization",
            "mtp_layers",
            "index_flags",
        }
        _refuse_unsupported(raw)
        raw = _rope_from_parameters(raw)
        cfg = cls(**{k: v for k, v in raw.items() if k in names})
        cfg.checkpoint_quant = _checkpoint_quant(raw.get("quantization_config"))
        if cfg.q_lora_rank is not None and cfg.q_lora_rank <= 0:
            raise ValueError(f"config key 'q_lora_rank' must be null or positive, got {cfg.q_lora_rank!r}")
        _resolve_swa(cfg, raw)
        _resolve_indexed(cfg, raw)
        _check_mlp_layer_types(cfg, raw.get("mlp_layer_types"))
        return cfg

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_groups(self) -> dict[str, list[int]]:
        """Layer ids of each KV cache group that the model has (``full``, ``swa``): the decoder
        layers, then the MTP layers the engine runs (``mtp_layers``)."""
        groups: dict[str, list[int]] = {}  # DSA layers keep every token: the full group
        for i in range(self.num_hidden_layers + self.mtp_layers):
            groups.setdefault(SWA_GROUP if self.is_swa_layer(i) else FULL_GROUP, []).append(i)
        return groups

    def is_swa_layer(self, layer_id: int) -> bool:
        """True when layer ``layer_id`` (0-based; MTP layers follow the main ones) is SWA."""
        if not 0 <= layer_id < len(self.window_attn_skip_freq):
            raise IndexError(f"layer_id {layer_id} outside 0..{len(self.window_attn_skip_freq) - 1}")
        return self.window_attn_skip_freq[layer_id] == 1

    def is_indexed_layer(self, layer_id: int) -> bool:
        """True when layer ``layer_id`` is a DSA layer (DeepSeek-V3.2's lightning indexer)."""
        return 0 <= layer_id < len(self.index_flags) and self.index_flags[layer_id] == 1

    @property
    def swa_layer_ids(self) -> list[int]:
        return [i for i, f in enumerate(self.window_attn_skip_freq) if f == 1]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    """Keys of Hugging Face's DeepseekV3 config this engine does not implement, refused by name
    rather than silently computed another way."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config key 'hidden_act'={act!r}: only 'silu' is supported (the MLPs and experts fuse SiLU)")
    if raw.get("attention_bias"):
        raise ValueError("config key 'attention_bias'=true: attention projections with biases are not supported")
    if raw.get("tie_word_embeddings"):
        raise ValueError("config key 'tie_word_embeddings'=true: an LM head tied to the embedding is not supported")
    if not isinstance(raw.get("rope_interleave", True), bool):
        raise ValueError(f"config key 'rope_interleave' must be true or false, got {raw['rope_interleave']!r}")
    if raw.get("mlp_bias"):
        raise ValueError("config key 'mlp_bias'=true: MLPs with biases are not supported")


def _rope_from_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Transformers 5 writes the rotary settings as ``rope_parameters`` (``rope_type``,
    ``rope_theta`` and YaRN's keys): read as ``rope_theta`` / ``rope_scaling``. Beside an older
    ``rope_theta`` or ``rope_scaling`` that says otherwise, refused by name."""
    rp = raw.get("rope_parameters")
    if rp is None:
        return raw
    if not isinstance(rp, dict):
        raise ValueError(f"config key 'rope_parameters' must be an object, got {rp!r}")
    theta = rp.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = rp.get("rope_type", rp.get("type", "default"))
    scaling = None if kind == "default" else {**{k: v for k, v in rp.items() if k != "rope_theta"}, "type": kind}
    old_theta, old = raw.get("rope_theta"), raw.get("rope_scaling")
    same = old is None or (
        scaling is not None
        and old.get("type", old.get("rope_type")) == kind
        and all(old.get(k) == scaling.get(k) for k in ("factor", "mscale", "mscale_all_dim", "attention_factor"))
    )
    if (old_theta is not None and old_theta != theta) or not same:
        raise ValueError(
            f"config keys 'rope_parameters'={rp!r} and 'rope_theta' / 'rope_scaling' ({old_theta!r}, {old!r}) disagree"
        )
    return {**raw, "rope_theta": theta, "rope_scaling": old if old is not None else scaling}


def _check_mlp_layer_types(cfg: ModelConfig, kinds: Any) -> None:
    """DeepSeek-V3.2's ``mlp_layer_types`` ("dense" / "sparse" a layer) must say what
    first_k_dense_replace and moe_layer_freq say: other per-layer MLP kinds are refused."""
    if kinds is None:
        return
    want = [
        "sparse" if cfg.n_routed_experts and i >= cfg.first_k_dense_replace and i % cfg.moe_layer_freq == 0 else "dense"
        for i in range(cfg.num_hidden_layers)
    ]
    if list(kinds) != want:
        raise ValueError(
            f"config key 'mlp_layer_types'={kinds!r} disagrees with first_k_dense_replace="
            f"{cfg.first_k_dense_replace} / moe_layer_freq={cfg.moe_layer_freq} ({want!r}); other per-layer MLP "
            "kinds are not supported"
        )


def _checkpoint_quant(qc: Any) -> str | None:
    """``quantization_config`` -> "fp8" for DeepSeek's 128 x 128 block FP8, None when absent."""
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "fp8":
        raise ValueError(f"config key 'quantization_config.quant_method'={method!r}: only 'fp8' is supported")
    block = qc.get("weight_block_size", [128, 128])
    if list(block) != [128, 128]:
        raise ValueError(f"config key 'quantization_config.weight_block_size'={block!r}: only [128, 128] is supported")
    return "fp8"


QUANTIZATIONS = ("auto", "fp8", "none")


def resolve_dtype(setting: str, on_gpu: bool) -> str:
    """``--dtype``: auto is bfloat16 on a GPU and float32 on CPU, where paddle's CPU build has no
    16-bit matmul (a bfloat16 model would load and then fail every request)."""
    if setting == "auto":
        return "bfloat16" if on_gpu else "float32"
    if setting not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {setting!r}")
    if setting != "float32" and not on_gpu:
        raise ValueError(f"dtype {setting!r} needs a GPU: paddle's CPU kernels have no {setting} matmul; use float32")
    return setting


def resolve_quantization(setting: str, cfg: ModelConfig, on_gpu: bool) -> str:
    """How to keep the weights: ``auto`` keeps an FP8 checkpoint FP8 on GPU and de-quantizes it on
    CPU; ``fp8`` needs an FP8 checkpoint; ``none`` de-quantizes at load."""
    if setting not in QUANTIZATIONS:
        raise ValueError(f"quantization: unknown value {setting!r}; choose one of {QUANTIZATIONS}")
    if setting == "fp8" and cfg.checkpoint_quant != "fp8":
        raise ValueError(
            "quantization: 'fp8' needs an FP8 checkpoint (config.json quantization_config.quant_method 'fp8'); "
            f"{cfg.model_dir or 'this model'} has none"
        )
    if setting == "auto":
        return "fp8" if cfg.checkpoint_quant == "fp8" and on_gpu else "none"
    return setting


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _window_from_sliding_window(v: Any) -> int | None:
    """``sliding_window``: an int W (HF), or [left, right] (PaddleFleet / Megatron): W = left + 1."""
    if v is None:
        return None
    if _is_int(v):
        if v <= 0:
            raise ValueError(f"config key 'sliding_window' must be a positive int, got {v!r}")
        return v
    return _window_from_pair("sliding_window", v)


def _window_from_pair(key: str, v: Any) -> int | None:
    if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_int(x) for x in v)):
        raise ValueError(f"config key {key!r} must be [left, right] ints, got {v!r}")
    left, right = v
    if left == -1 and right in (-1, 0):
        return None  # Megatron's "no window"
    if right != 0:
        raise ValueError(f"config key {key!r} must have right extent 0 (causal), got {v!r}")
    if left < 0:
        raise ValueError(f"config key {key!r} must have left extent >= 0, got {v!r}")
    return left + 1


def _flags_from_skip_freq(v: Any, n_layers: int, n_mtp: int) -> list[int]:
    key = "window_attn_skip_freq"
    if _is_int(v):
        if v < 1:
            raise ValueError(f"config key {key!r} as an int must be >= 1, got {v!r}")
        return [0 if (i + 1) % v == 0 else 1 for i in range(n_layers)]
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"config key {key!r} must be an int or a list of 0/1, got {v!r}")
    if len(v) not in (n_layers, n_layers + n_mtp):
        raise ValueError(
            f"config key {key!r} has {len(v)} entries, expected num_hidden_layers={n_layers}"
            + (f" or {n_layers + n_mtp} with num_nextn_predict_layers={n_mtp}" if n_mtp else "")
            + f": {list(v)!r}"
        )
    for x in v:
        if not _is_int(x) or x not in (0, 1):
            raise ValueError(f"config key {key!r} entries must be 0 or 1, got {x!r} in {list(v)!r}")
    return list(v)


def _flags_from_layer_types(v: Any, n_layers: int, n_mtp: int) -> list[int]:
    key = "layer_types"
    if not isinstance(v, (list, tuple)) or len(v) not in (n_layers, n_layers + n_mtp):
        raise ValueError(f"config key {key!r} must be a list of num_hidden_layers={n_layers} strings, got {v!r}")
    out = []
    for x in v:
        if x not in (SLIDING, FULL, INDEXED):
            raise ValueError(
                f"config key {key!r} has unknown entry {x!r} (expected {SLIDING!r}, {FULL!r} or {INDEXED!r})"
            )
        out.append(1 if x == SLIDING else 0)
    return out


def _resolve_swa(cfg: ModelConfig, raw: dict[str, Any]) -> None:
    n, n_mtp = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    w_sw = _window_from_sliding_window(raw.get("sliding_window"))
    w_ws = _window_from_pair("window_size", raw["window_size"]) if raw.get("window_size") is not None else None
    if w_sw is not None and w_ws is not None and w_sw != w_ws:
        raise ValueError(
            f"config keys 'sliding_window'={raw['sliding_window']!r} (W={w_sw}) and "
            f"'window_size'={raw['window_size']!r} (W={w_ws}) disagree"
        )
    window = w_sw if w_sw is not None else w_ws

    sources = []
    if raw.get("window_attn_skip_freq") is not None:
        sources.append(("window_attn_skip_freq", _flags_from_skip_freq(raw["window_attn_skip_freq"], n, n_mtp)))
    if raw.get("layer_types") is not None:
        sources.append(("layer_types", _flags_from_layer_types(raw["layer_types"], n, n_mtp)))
    if len(sources) == 2:
        (ka, a), (kb, b) = sources
        m = min(len(a), len(b))
        if a[:m] != b[:m]:
            raise ValueError(f"config keys {ka!r}={raw[ka]!r} and {kb!r}={raw[kb]!r} disagree on the SWA layers")
        sources.sort(key=lambda s: -len(s[1]))
    if sources:
        flags = sources[0][1] + [0] * (n + n_mtp - len(sources[0][1]))  # MTP layers not listed: full
    else:
        flags = [1 if window is not None else 0] * (n + n_mtp)  # Megatron: a window alone makes every layer SWA

    if any(flags) and window is None:
        key = sources[0][0] if sources else "sliding_window"
        raise ValueError(
            f"config key {key!r} marks SWA layers {[i for i, f in enumerate(flags) if f]} "
            "but no positive window is set ('sliding_window' or 'window_size')"
        )
    cfg.sliding_window = window
    cfg.window_attn_skip_freq = flags
    if cfg.swa_rope_theta is not None and not cfg.swa_rope_theta > 0:
        raise ValueError(f"config key 'swa_rope_theta' must be positive, got {cfg.swa_rope_theta!r}")


def _resolve_indexed(cfg: ModelConfig, raw: dict[str, Any]) -> None:
    """The DSA layers: ``layer_types`` entries "indexed_attention"; with ``model_type``
    deepseek_v32, every layer ``layer_types`` does not list (all of them without it, its MTP layer
    included, as DeepSeek-V3.2 ships). An SWA layer is never indexed (the flags' sources agree
    on SWA layers, checked by _resolve_swa)."""
    n = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    kinds = list(raw.get("layer_types") or [])
    v32 = raw.get("model_type") == "deepseek_v32"
    flags = [int(k == INDEXED) for k in kinds] + [int(v32)] * (n - len(kinds))
    for i in range(n):
        if flags[i] and cfg.window_attn_skip_freq[i]:
            raise ValueError(f"config: layer {i} is both an SWA layer and an indexed (DSA) layer")
    cfg.index_flags = flags
    if not any(flags):
        return
    for key in ("index_topk", "index_n_heads", "index_head_dim"):
        v = getattr(cfg, key)
        if not _is_int(v) or v <= 0:
            raise ValueError(f"config key {key!r} must be a positive int, got {v!r}")
    if cfg.index_head_dim < cfg.qk_rope_head_dim:
        raise ValueError(
            f"config key 'index_head_dim'={cfg.index_head_dim} is below qk_rope_head_dim={cfg.qk_rope_head_dim} "
            "(the indexer rotates its first qk_rope_head_dim dims)"
        )
    if not isinstance(cfg.indexer_rope_interleave, bool):
        raise ValueError(
            f"config key 'indexer_rope_interleave' must be true or false, got {cfg.indexer_rope_interleave!r}"
        )
    if not cfg.q_lora_rank:
        raise ValueError("config key 'q_lora_rank' is null: the indexed (DSA) layers' indexer reads the q latent")


KV_CACHE_DTYPES = ("auto", "bf16", "fp8")


def swa_blocks_per_request(sliding_window: int, chunk: int, block_size: int) -> int:
    """The most SWA blocks a request holds at once: its window before a chunk plus the chunk,
    ceil((W - 1 + chunk) / block_size), plus one for a window that straddles a block edge."""
    return -(-(sliding_window - 1 + chunk) // block_size) + 1


@dataclass
class CacheConfig:
    """KV cache settings. ``num_gpu_blocks_override`` None means: size from memory at start-up.
    ``kv_cache_dtype`` is the full-attention layers' cache format (SWA layers always keep the
    656-byte FP8 record): auto (the model dtype), bf16 or fp8. ``swa_full_tokens_ratio``: SWA
    pool blocks per full pool block; None: what max_num_seqs requests can hold at once."""

    block_size: int = 64
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = False
    swa_full_tokens_ratio: float | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.block_size) or self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size!r}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override <= 0:
            raise ValueError(f"num_gpu_blocks_override must be positive, got {self.num_gpu_blocks_override!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.swa_full_tokens_ratio is not None and not 0 < self.swa_full_tokens_ratio:
            raise ValueError(f"swa_full_tokens_ratio must be positive, got {self.swa_full_tokens_ratio!r}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None
    cuda_graph_batch_sizes: tuple[int, ...] = ()  # pure-decode batch buckets, ascending (docs/design.md §4.12)
    enforce_eager: bool = False
    cuda_graph_capture: bool = False  # capture each bucket's decode step (docs/design.md §4.11)
    async_scheduling: bool = True  # build step N+1 while step N runs (docs/design.md §4.18)

    def __post_init__(self) -> None:
        for k in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be positive, got {getattr(self, k)!r}")
        sizes = tuple(self.cuda_graph_batch_sizes)
        if any(not _is_int(n) or not 1 <= n <= self.max_num_seqs for n in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(
                f"cuda_graph_batch_sizes must be ascending distinct batch sizes in 1..max_num_seqs "
                f"({self.max_num_seqs}), got {list(sizes)}"
            )

    @property
    def swa_chunk_tokens(self) -> int:
        """The most tokens past its window a request's SWA blocks cover: one step's budget, or
        with async scheduling two (the running step's window stays until that step is taken)."""
        return self.max_num_batched_tokens * (2 if self.async_scheduling else 1)

    def bucket_for(self, n: int) -> int:
        """The batch size a pure-decode step of n requests runs as: the smallest bucket >= n, or
        n when none is (no buckets, or more requests than the largest)."""
        return next((b for b in self.cuda_graph_batch_sizes if b >= n), n)


SPEC_METHODS = ("mtp", "deepseek_mtp")  # FastDeploy's name, vLLM's


def json_object(text: str | dict, name: str) -> dict:
    """A setting's JSON object (a dict passes as is); ValueError naming ``name`` otherwise."""
    raw = text
    if isinstance(text, str):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{name}: must be a JSON object, got {raw!r}")
    return raw


@dataclass
class SpeculativeConfig:
    """``--speculative-config`` (docs/design.md §4.16): ``method`` "mtp" drafts with the
    checkpoint's multi-token-prediction module, ``num_speculative_tokens`` (k) tokens a step, by
    running it on its own drafts; None: no speculation."""

    method: str | None = None
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if self.method is None:
            return
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not one of {list(SPEC_METHODS)}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )

    @property
    def k(self) -> int:
        """Drafts a step (0 without speculation)."""
        return self.num_speculative_tokens if self.method else 0

    @classmethod
    def parse(cls, text: str | dict | None) -> SpeculativeConfig:
        """The flag's JSON object (or a dict): ``{"method": "mtp", "num_speculative_tokens": k}``."""
        if text is None or text == "":
            return cls()
        raw = json_object(text, "speculative_config")
        unknown = sorted(set(raw) - {"method", "num_speculative_tokens"})
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (method, num_speculative_tokens)")
        if "method" not in raw:
            raise ValueError("speculative_config: 'method' is required (\"mtp\")")
        return cls(raw["method"], raw.get("num_speculative_tokens", 1))


MAX_SPECULATIVE_TOKENS = 8

KV_CONNECTORS = ("MooncakeConnector", "NixlConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """``--kv-transfer-config`` (vLLM's JSON; docs/design.md §4.20): ``kv_connector`` the transfer
    engine (None: no transfer), ``kv_role`` whether this instance sends prompts' KV (producer,
    a prefill instance), receives it (consumer, a decode instance) or both, ``kv_ip`` the host
    its transfer endpoint binds, ``kv_timeout`` seconds a transfer may take, ``kv_push`` when a
    prefill instance sends a prompt's blocks: ``end`` (one batch once the first token is drawn)
    or ``layer`` (each layer's as the prompt's last step finishes that layer)."""

    kv_connector: str | None = None
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_timeout: float = 30.0
    kv_push: str = "end"

    def __post_init__(self) -> None:
        if self.kv_connector is not None and self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config: kv_connector {self.kv_connector!r} is not one of {KV_CONNECTORS}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role {self.kv_role!r} is not one of {KV_ROLES}")
        if not (isinstance(self.kv_timeout, (int, float)) and self.kv_timeout > 0):
            raise ValueError(f"kv_transfer_config: kv_timeout must be positive, got {self.kv_timeout!r}")
        if self.kv_push not in ("end", "layer"):
            raise ValueError(f"kv_transfer_config: kv_push {self.kv_push!r} is not one of ('end', 'layer')")

    @classmethod
    def parse(cls, text: str | None) -> KVTransferConfig:
        """The JSON object of ``--kv-transfer-config`` (None: no transfer); ValueError naming a bad key."""
        if text is None:
            return cls()
        raw = json_object(text, "kv_transfer_config")
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key {unknown[0]!r}")
        if "kv_connector" not in raw:
            raise ValueError(f"kv_transfer_config: 'kv_connector' is required (one of {KV_CONNECTORS})")
        return cls(**raw)


@dataclass
class ParallelConfig:
    """``tensor_parallel_size`` ranks split the model (docs/design.md §4.9); a rank that stops
    answering for ``dist_timeout`` seconds stops the driver. ``data_parallel_size`` engine cores
    each schedule their own requests on their own TP group (§4.19); with
    ``enable_expert_parallel`` the routed experts are split over all D x TP ranks (each MoE layer
    gathers every rank's tokens), without it each core is a whole replica."""

    tensor_parallel_size: int = 1
    dist_timeout: float = 60.0
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_rpc_port: int | None = None  # under a launcher: where the front listens for the cores

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout must be positive, got {self.dist_timeout!r}")

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the routed experts are split over (1: not expert parallel)."""
        return self.data_parallel_size * self.tensor_parallel_size if self.enable_expert_parallel else 1

    @property
    def lockstep(self) -> bool:
        """Whether the data-parallel engine cores step together: their MoE layers gather every
        core's tokens, so a core with nothing to run takes a dummy step (§4.19)."""
        return self.data_parallel_size > 1 and self.enable_expert_parallel


SPARSE_MLA_PROVIDERS = ("flashmla", "triton", "reference")
MLA_PREFILL_FORMS = ("auto", "mha", "absorbed")


@dataclass(frozen=True)
class KernelConfig:
    """Which implementation runs, decided once at start-up (``kernel_select.select_kernels``) and
    passed down; nothing below reads the environment to decide again.

    triton: the window indexer, the FP8 cache writer and the cache de-quantizer run as Triton
    kernels (on GPU, or in Triton's interpreter), else as their paddle references.
    sparse_mla_provider: who computes SWA layers' sparse MLA attention (one of SPARSE_MLA_PROVIDERS).
    mla_prefill_form: how prefill tokens attend (docs/design.md §4.7): ``mha`` (keys decompressed
    through W_UK / W_UV), ``absorbed`` (MQA over the latent, as decodes), or ``auto``: per request
    by the cost model in ``layers/attention/prefill_form.py``.
    index_triton: DSA layers' index key write, logits and top-k as Triton kernels (with
    ``triton``); ``select_kernels`` turns it on where the Triton kernels run on a GPU.
    The default is the CPU reference path."""

    triton: bool = False
    sparse_mla_provider: str = "reference"
    mla_prefill_form: str = "auto"
    index_triton: bool = False

    def __post_init__(self) -> None:
        if self.sparse_mla_provider not in SPARSE_MLA_PROVIDERS:
            raise ValueError(
                f"sparse_mla_provider must be one of {SPARSE_MLA_PROVIDERS}, got {self.sparse_mla_provider!r}"
            )
        if self.mla_prefill_form not in MLA_PREFILL_FORMS:
            raise ValueError(f"mla_prefill_form must be one of {MLA_PREFILL_FORMS}, got {self.mla_prefill_form!r}")
        if self.index_triton and not self.triton:
            raise ValueError(
                "index_kernel_backend 'triton' needs the Triton kernels (kernel_backend triton, or auto on GPU)"
            )


@dataclass
class FDConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kernel_config: KernelConfig = field(default_factory=KernelConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kv_transfer_config: KVTransferConfig = field(default_factory=KVTransferConfig)

    def __post_init__(self) -> None:
        sc, mc = self.scheduler_config, self.model_config
        if self.speculative_config.k:
            if mc.num_nextn_predict_layers < 1:
                raise ValueError(
                    "speculative_config: method 'mtp' drafts with the checkpoint's MTP module, but its config.json "
                    "has num_nextn_predict_layers=0 (no MTP layer)"
                )
            mc.mtp_layers = 1  # DeepSeek-V3 ships one; k > 1 runs it on its own drafts
        n = self.parallel_config.tensor_parallel_size
        splits = {  # what tensor parallelism splits (docs/design.md §4.9)
            "num_attention_heads": mc.num_attention_heads,
            "vocab_size": mc.vocab_size,
            "intermediate_size": mc.intermediate_size,
            "n_routed_experts": mc.n_routed_experts or 0,
            "moe_intermediate_size": mc.moe_intermediate_size * (mc.n_shared_experts or 0),
        }
        for key, v in splits.items():
            if v % n:
                raise ValueError(f"config key {key!r}={v} does not divide over tensor_parallel_size={n}")
        pc = self.parallel_config
        if pc.enable_expert_parallel and (mc.n_routed_experts or 0) % pc.expert_parallel_size:
            raise ValueError(
                f"config key 'n_routed_experts'={mc.n_routed_experts} does not divide over the "
                f"{pc.expert_parallel_size} expert-parallel ranks (data_parallel_size x tensor_parallel_size)"
            )
        if self.kv_transfer_config.kv_connector is not None and pc.data_parallel_size > 1:
            raise ValueError("kv_transfer_config: not with data_parallel_size > 1; not built yet")  # design.md §4.20
        if pc.lockstep:  # every core runs one forward a loop turn (docs/design.md §4.19)
            if self.speculative_config.k:
                raise ValueError(
                    "speculative_config: not with data_parallel_size > 1 and enable_expert_parallel (a draft pass "
                    "is a forward the other engine cores would have to mirror; not built yet)"
                )
            if sc.cuda_graph_capture:
                raise ValueError(
                    "cuda_graph_capture: not with enable_expert_parallel over data-parallel ranks (the MoE "
                    "dispatch reads every rank's token count on the host)"
                )
            sc.async_scheduling = False  # one forward a step, in turn (the cores' lockstep counts steps)
        if sc.max_model_len is None:
            sc.max_model_len = mc.max_position_embeddings
        elif sc.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len={sc.max_model_len} exceeds the model's max_position_embeddings="
                f"{mc.max_position_embeddings}"
            )
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < sc.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={sc.max_num_batched_tokens} < max_model_len={sc.max_model_len} "
                "needs chunked prefill (enable_chunked_prefill)"
            )
