"""EngineArgs: the one list of the engine's settings.

The server's flags are generated from its fields (``--max-num-seqs`` is ``max_num_seqs``, with
the field's help text and default), the offline ``LLM(**kwargs)`` takes the same names, and
``create_config`` builds every config by keyword. ``add_dataclass_args`` does the same for any
settings dataclass (the server's own, in ``api_server``).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastdeploy.config import (
    KV_CACHE_DTYPES,
    MLA_PREFILL_FORMS,
    QUANTIZATIONS,
    CacheConfig,
    FDConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    resolve_dtype,
    resolve_quantization,
)
from fastdeploy.model_executor.kernel_select import INDEX_KERNEL_BACKENDS, KERNEL_BACKENDS, select_kernels
from fastdeploy.model_executor.ops.triton_ops.launcher import interpret_mode
from fastdeploy.tools.tiny_checkpoint import TINY_PRESET, resolve_model
from fastdeploy.worker.kv_sizing import on_gpu

DTYPES = ("auto", "float32", "bfloat16", "float16")


def setting(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A settings field: its default, the help text of its flag and, optionally, its choices."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class EngineArgs:
    model: str = setting(TINY_PRESET, f"checkpoint directory, or the preset {TINY_PRESET} (built on first use)")
    dtype: str = setting("auto", "model dtype; auto: bfloat16 on GPU, float32 on CPU", DTYPES)
    max_model_len: int | None = setting(None, "longest prompt + output in tokens; None: max_position_embeddings")
    max_num_seqs: int = setting(64, "most requests in one step")
    max_num_batched_tokens: int = setting(2048, "most tokens in one step (the token budget)")
    block_size: int = setting(64, "tokens per KV cache block (a power of two)")
    num_gpu_blocks_override: int | None = setting(None, "KV cache blocks; None: sized from memory")
    gpu_memory_utilization: float = setting(0.9, "share of GPU memory the engine may use, KV cache included")
    enable_prefix_caching: bool = setting(False, "reuse the KV blocks of earlier requests' identical prefixes")
    enable_chunked_prefill: bool = setting(True, "split long prompts over steps under the token budget")
    swa_full_tokens_ratio: float | None = setting(
        None, "SWA-layer KV blocks per full-layer block; None: what max_num_seqs requests' windows need"
    )
    kv_cache_dtype: str = setting(
        "auto", "full-attention layers' KV cache (SWA layers always use the FP8 record)", KV_CACHE_DTYPES
    )
    tensor_parallel_size: int = setting(
        1, "ranks the model is split over; started here, or taken from paddle.distributed.launch"
    )
    dist_timeout: float = setting(60.0, "seconds a tensor-parallel rank may stay silent before the driver exits")
    data_parallel_size: int = setting(
        1,
        "engine cores, each scheduling its own requests with its own KV cache on its own tensor_parallel_size "
        "ranks, behind one front that routes requests (least loaded, longest routed prefix first)",
    )
    enable_expert_parallel: bool = setting(
        False,
        "split the routed experts over all data_parallel_size x tensor_parallel_size ranks (each MoE layer "
        "gathers every rank's tokens; the cores step together, in turn, without speculation or capture); "
        "off: each data-parallel core holds every expert",
    )
    data_parallel_rpc_port: int | None = setting(
        None,
        "under paddle.distributed.launch: the port on rank 0's host where the front listens for the other "
        "data-parallel cores; None: the launcher's master port + 1",
    )
    kernel_backend: str = setting(
        "auto",
        "the Triton kernels (window indexer, FP8 cache write and read, MHA-form prefill, W8A8 FP8 GEMM, "
        "fused MoE) or their paddle references; auto: Triton on a CUDA paddle, references on CPU; "
        "triton on CPU needs TRITON_INTERPRET=1",
        KERNEL_BACKENDS,
    )
    sparse_mla_provider: str = setting(
        "auto",
        "SWA and full layers' absorbed (sparse MLA) attention; auto: flashmla where it imports on GPU, else triton "
        "when Triton kernels run, else reference",
        ("auto", "flashmla", "triton", "reference"),
    )
    quantization: str = setting(
        "auto",
        "weights of an FP8 checkpoint: fp8 keeps them FP8 (W8A8 block GEMM), none de-quantizes at load; auto: "
        "fp8 when Triton kernels run, else none",
        QUANTIZATIONS,
    )
    cuda_graph_batch_sizes: str | list[int] | None = setting(
        None,
        "comma-separated batch sizes (LLM(...) also takes a list of ints) a pure-decode step is padded up to "
        "(each captured as a CUDA graph on a CUDA build of paddle); None: 1, 2, 4, then multiples of 8 up to "
        "max_num_seqs on CUDA, none on CPU; '' none",
    )
    enforce_eager: bool = setting(False, "never capture CUDA graphs (buckets still pad decode batches)")
    cuda_graph_capture: bool = setting(
        False,
        "capture each bucket's pure-decode step as a CUDA graph at start and replay it (a CUDA build of paddle; "
        "elsewhere the captured step is re-run, which checks its contract and saves nothing); off by default until "
        "timed on a CUDA build of paddle; with speculative decoding, verify steps too",
    )
    async_scheduling: bool = setting(
        True,
        "overlap the host's work with the device's: step N+1 is scheduled and built while step N runs, and step N's "
        "outputs are taken while N+1 runs (tokens unchanged); --no-async-scheduling runs each step in turn",
    )
    mla_prefill_form: str = setting(
        "auto",
        "how prefill tokens attend: mha (keys decompressed, 192/128 wide per head), absorbed (MQA over the "
        "latent, as decodes), auto: per request by a cost model priced at the sparse-MLA provider's own "
        "measured rates (an H200's for flashmla / triton, a 2-core CPU's for reference)",
        MLA_PREFILL_FORMS,
    )
    index_kernel_backend: str = setting(
        "auto",
        "DSA (DeepSeek-V3.2) layers' index key write, logits and top-k: reference (paddle ops), triton (the Triton "
        "kernels, with kernel_backend triton or auto on GPU) or auto (triton where the Triton kernels run on a GPU, "
        "else reference)",
        INDEX_KERNEL_BACKENDS,
    )
    speculative_config: str | None = setting(
        None,
        'speculative decoding, a JSON object: {"method": "mtp", "num_speculative_tokens": k} drafts k tokens a '
        "step with the checkpoint's MTP module and verifies them in one target step (greedy and sampled output "
        "unchanged); None: off",
    )

    kv_transfer_config: str | None = setting(
        None,
        'prefill/decode disaggregation, a JSON object: {"kv_connector": "MooncakeConnector" | "NixlConnector", '
        '"kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_ip": HOST, "kv_timeout": S}: this instance '
        "sends computed prompts' KV blocks to, or receives them from, another instance; None: off",
    )

    def create_config(self) -> FDConfig:
        """Every config, built by keyword; a ValueError names the bad setting."""
        model_config = ModelConfig.from_pretrained(resolve_model(self.model))
        kernels = select_kernels(
            self.kernel_backend, self.sparse_mla_provider, self.mla_prefill_form, self.index_kernel_backend
        )
        model_config.quantization = resolve_quantization(self.quantization, model_config, kernels.triton)
        model_config.dtype = resolve_dtype(self.dtype, on_gpu())
        return FDConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_dtype=self.kv_cache_dtype,
                enable_prefix_caching=self.enable_prefix_caching,
                swa_full_tokens_ratio=self.swa_full_tokens_ratio,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                enable_chunked_prefill=self.enable_chunked_prefill,
                max_model_len=self.max_model_len,
                cuda_graph_batch_sizes=batch_sizes(
                    self.cuda_graph_batch_sizes, self.max_num_seqs, kernels.triton and not interpret_mode()
                ),
                enforce_eager=self.enforce_eager,
                cuda_graph_capture=self.cuda_graph_capture,
                async_scheduling=self.async_scheduling,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                dist_timeout=self.dist_timeout,
                data_parallel_size=self.data_parallel_size,
                enable_expert_parallel=self.enable_expert_parallel,
                data_parallel_rpc_port=self.data_parallel_rpc_port,
            ),
            kernel_config=kernels,
            speculative_config=SpeculativeConfig.parse(self.speculative_config),
            kv_transfer_config=KVTransferConfig.parse(self.kv_transfer_config),
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def batch_sizes(text: str | Sequence[int] | None, max_num_seqs: int, on_cuda: bool) -> tuple[int, ...]:
    """``--cuda-graph-batch-sizes``: the listed sizes (comma-separated, or a sequence of ints from
    ``LLM(...)``), or (None) vLLM's ladder on CUDA: 1, 2, 4, then every multiple of 8, up to
    max_num_seqs (always included); none on CPU."""
    if text is not None and not isinstance(text, str):
        if any(isinstance(x, bool) or not isinstance(x, int) for x in text):
            raise ValueError(f"cuda_graph_batch_sizes must be integers, got {list(text)!r}")
        return tuple(sorted(set(text)))
    if text is None:
        if not on_cuda:
            return ()
        return tuple(
            sorted({n for n in [1, 2, 4, *range(8, max_num_seqs + 1, 8)] if n <= max_num_seqs} | {max_num_seqs})
        )
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"cuda_graph_batch_sizes must be comma-separated integers, got {text!r}") from None


def _flag_type(hint: Any) -> type:
    """int for ``int | None`` and the like: the hint's first type that is not None (a flag's text
    is parsed as that; ``str | list[int] | None`` is a str on the command line)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _none_or(kind: type):
    def parse(text: str):
        return None if text == "None" else kind(text)

    parse.__name__ = kind.__name__
    return parse


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> argparse.ArgumentParser:
    """One ``--flag-name`` per field of the settings dataclass ``cls``: its type, default, help and
    choices; bools get ``--x`` / ``--no-x``. Use with ArgumentDefaultsHelpFormatter to show defaults."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = _flag_type(hints[f.name])
        optional = kind is not hints[f.name]
        kw: dict[str, Any] = {"default": f.default, "help": f.metadata.get("help", "")}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _none_or(kind) if optional else kind
            if f.metadata.get("choices"):
                kw["choices"] = f.metadata["choices"]
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)
    return parser
