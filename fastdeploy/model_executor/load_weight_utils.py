"""Load Hugging Face safetensors checkpoints (one file or index-sharded) into the model.

DeepSeek-V3 names map one to one onto the model's parameter names. FP8 e4m3 weights with a
``<name>_scale_inv`` tensor (one float32 per 128 x 128 block) are de-quantized at load, unless
the model keeps that weight FP8 (a uint8 parameter with its own ``<name>_scale_inv``, see
``layers/linear.py``): then codes and scales are copied as stored.
The target model skips the multi-token-prediction layers (``model.layers.{num_hidden_layers + i}``);
the draft model (``models/deepseek_mtp.py``) loads them and nothing else. Under
tensor parallelism each rank reads only its slice of each tensor (a parameter's ``tp_shard``),
and skips the routed experts other ranks hold; an FP8 tensor is cut at its 128-blocks.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import paddle
from tqdm import tqdm

from fastdeploy.model_executor.ops.fp8_numerics import FP8_BLOCK, dequant_fp8_blocks
from fastdeploy.model_executor.safetensors_io import SafeTensorsFile


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensor."""


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, s) for s in shards]
    else:
        files = sorted(os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise CheckpointError(f"checkpoint shard {os.path.basename(missing[0])} listed in the index is missing")
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def dequant_fp8_block(codes: np.ndarray, scale_inv: np.ndarray, name: str) -> np.ndarray:
    """e4m3 codes [out, in] x scale_inv [ceil(out/128), ceil(in/128)] -> float32 [out, in]; a
    CheckpointError naming the tensor when the scales do not fit."""
    try:
        return dequant_fp8_blocks(codes, scale_inv)
    except ValueError as e:
        raise CheckpointError(f"tensor {name}_scale_inv {e} for {name}") from None


def fp8_block_scales(scale_inv: SafeTensorsFile, s: str, shard: tuple | None, rank: int) -> np.ndarray:
    """The block scales covering this rank's slice; the slice must start and end on 128-blocks."""
    if shard is None:
        return scale_inv.get(s)
    dim, start, end, full = shard
    if start % FP8_BLOCK or (end % FP8_BLOCK and end < full):
        raise CheckpointError(
            f"FP8 tensor {s[: -len('_scale_inv')]}: rank {rank}'s slice [{start}, {end}) of dim {dim} does not fall on "
            f"{FP8_BLOCK}-blocks; choose a tensor_parallel_size that splits it at {FP8_BLOCK}"
        )
    return scale_inv.get(s, dim, start // FP8_BLOCK, -(-end // FP8_BLOCK))


class _Target:
    """Where one checkpoint tensor goes: parameter ``name`` (``param``), whole or slice ``index``
    of a stacked parameter (routed experts)."""

    def __init__(self, params: dict, name: str, index: int | None) -> None:
        self.name, self.index, self.param = name, index, params[name]

    @property
    def shape(self) -> list[int]:
        return list(self.param.shape[1:] if self.index is not None else self.param.shape)

    def set(self, value: np.ndarray) -> None:
        t = paddle.to_tensor(value).astype(self.param.dtype)
        if self.index is None:
            self.param.set_value(t)
        else:
            with paddle.no_grad():
                self.param[self.index] = t


def load_fp8_kept(target: _Target, scale: _Target, k: str, codes: np.ndarray, dtype: str, sources: dict, shard, rank):
    """Copy FP8 codes into ``target`` and their block scales into ``scale``."""
    s = k + "_scale_inv"
    if dtype != "F8_E4M3" or s not in sources:
        raise CheckpointError(
            f"tensor {k} is {dtype}{'' if s in sources else ' without ' + s}: the model keeps this weight FP8 "
            "(--quantization fp8) and needs F8_E4M3 codes with their _scale_inv"
        )
    scales = fp8_block_scales(sources[s], s, shard, rank)
    if list(scales.shape) != scale.shape:
        raise CheckpointError(f"tensor {s} has shape {list(scales.shape)}, the model expects {scale.shape}")
    target.set(np.ascontiguousarray(codes, np.uint8))
    scale.set(np.ascontiguousarray(scales, np.float32))


def load_weights(
    model: paddle.nn.Layer, model_dir: str, num_hidden_layers: int | None, show_progress: bool = True
) -> int:
    """Copy every checkpoint tensor (this rank's slice of it) into its parameter (of the same name,
    or a slice of a stacked one: ``model.checkpoint_target``, None for a tensor another model or
    rank loads; its rows reordered where ``model.checkpoint_row_order`` says); errors name the
    tensor (and the rank). Tensors of layers >= ``num_hidden_layers``
    are skipped (None: none). Returns the bytes read from the checkpoint."""
    params = dict(model.named_parameters())
    where = getattr(model, "checkpoint_target", lambda name: (name, None))
    row_order = getattr(model, "checkpoint_row_order", lambda name, rows: None)
    rank = getattr(getattr(model, "tp", None), "rank", 0)
    sources: dict[str, SafeTensorsFile] = {}
    for path in checkpoint_files(model_dir):
        f = SafeTensorsFile(path)
        for k in f.keys():
            sources[k] = f
    mtp = re.compile(r"model\.layers\.(\d+)\.")
    targets: dict[str, _Target] = {}
    filled: dict[str, int] = {}  # parameter -> tensors loaded into it
    stacked: set[str] = set()
    for k in sources:
        m = mtp.match(k)
        if k.endswith("_scale_inv") or (m and num_hidden_layers is not None and int(m.group(1)) >= num_hidden_layers):
            continue
        t = where(k)
        if t is None:  # another rank's expert
            continue
        if t[0] not in params:
            raise CheckpointError(f"unexpected tensor {k} in the checkpoint (no such parameter in the model)")
        targets[k] = _Target(params, *t)
        filled[t[0]] = filled.get(t[0], 0) + 1
        if t[1] is not None:
            stacked.add(t[0])
    kept_scales = {k for k in params if k.endswith("_scale_inv")}  # loaded with their FP8 weight
    missing = sorted(set(params) - set(filled) - kept_scales)
    partial = sorted(n for n in stacked if filled[n] != params[n].shape[0])
    if missing or partial:
        name = getattr(model, "checkpoint_name", lambda p: p)
        first = (
            name(missing[0])
            if missing
            else f"{partial[0]} (only {filled[partial[0]]} of its {params[partial[0]].shape[0]} experts)"
        )
        raise CheckpointError(f"tensor {first} is missing from the checkpoint ({len(missing) + len(partial)} missing)")
    for k in tqdm(sorted(targets), desc="loading weights", unit="tensor", disable=not show_progress):
        f, t = sources[k], targets[k]
        shard = getattr(t.param, "tp_shard", None) if t.index is None else None  # (dim, start, end, full size)
        expected = t.shape
        if shard is not None:
            expected[shard[0]] = shard[3]
        if list(f.shape(k)) != expected:
            rk = f" (tensor-parallel rank {rank})" if shard is not None and shard[3] != shard[2] - shard[1] else ""
            raise CheckpointError(f"tensor {k} has shape {list(f.shape(k))}, the model expects {expected}{rk}")
        x = f.get(k) if shard is None else f.get(k, *shard[:3])
        order = row_order(k, x.shape[0])
        if order is not None:
            if t.param.dtype == paddle.uint8 and (order // FP8_BLOCK != np.arange(len(order)) // FP8_BLOCK).any():
                raise CheckpointError(
                    f"tensor {k}: rope_interleave=false moves rows across 128-row FP8 scale blocks, which a "
                    "weight kept in FP8 cannot do; serve it with --quantization none"
                )
            x = x[order]
        if t.param.dtype == paddle.uint8:  # kept FP8: codes and scales as the checkpoint stores them
            s_name, s_index = where(k + "_scale_inv")
            scale = _Target(params, s_name, s_index)
            load_fp8_kept(t, scale, k, x, f.dtype(k), sources, shard, rank)
            continue
        if f.dtype(k) == "F8_E4M3":
            s = k + "_scale_inv"
            if s not in sources:
                raise CheckpointError(f"FP8 tensor {k} has no {s}")
            x = dequant_fp8_block(x, fp8_block_scales(sources[s], s, shard, rank), k)
        t.set(x.astype(np.float32))
    for layer in model.sublayers(include_self=True):  # weights derived from the loaded ones
        hook = getattr(layer, "process_weights_after_loading", None)
        if callable(hook):
            hook()
    return sum(f.bytes_read for f in set(sources.values()))


def parameter_bytes(model: paddle.nn.Layer) -> dict[str, int]:
    """Bytes of the model's parameters on this rank, by dtype name."""
    out: dict[str, int] = {}
    for p in model.parameters():
        name = str(p.dtype).replace("paddle.", "")
        out[name] = out.get(name, 0) + int(np.prod(p.shape)) * p.element_size()
    return out
