"""Load Hugging Face safetensors checkpoints (one file or index-sharded) into the model.

DeepSeek-V3 names map one to one onto the model's parameter names. FP8 e4m3 weights with a
``<name>_scale_inv`` tensor (one float32 per 128 x 128 block) are de-quantized at load, unless
the model keeps that weight FP8 (a uint8 parameter with its own ``<name>_scale_inv``, see
``layers/linear.py``): then codes and scales are copied as stored.
Multi-token-prediction layers (``model.layers.{num_hidden_layers + i}``) are skipped. Under
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

from fastdeploy.model_executor.safetensors_io import E4M3_TO_F32, SafeTensorsFile

FP8_BLOCK = 128


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
    """e4m3 codes [out, in] x scale_inv [ceil(out/128), ceil(in/128)] -> float32 [out, in]."""
    rows, cols = codes.shape
    want = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if scale_inv.shape != want:
        raise CheckpointError(f"tensor {name}_scale_inv has shape {scale_inv.shape}, expected {want} for {name}")
    full = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)[:rows, :cols]
    return E4M3_TO_F32[codes] * full


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


def load_fp8_kept(
    params: dict, k: str, codes: np.ndarray, dtype: str, sources: dict, shard: tuple | None, rank: int
) -> None:
    """Copy FP8 codes into parameter ``k`` and their block scales into ``k + "_scale_inv"``."""
    s = k + "_scale_inv"
    if dtype != "F8_E4M3" or s not in sources:
        raise CheckpointError(
            f"tensor {k} is {dtype}{'' if s in sources else ' without ' + s}: the model keeps this weight FP8 "
            "(--quantization fp8) and needs F8_E4M3 codes with their _scale_inv"
        )
    scales = fp8_block_scales(sources[s], s, shard, rank)
    if list(scales.shape) != list(params[s].shape):
        raise CheckpointError(f"tensor {s} has shape {list(scales.shape)}, the model expects {list(params[s].shape)}")
    params[k].set_value(paddle.to_tensor(np.ascontiguousarray(codes, np.uint8)))
    params[s].set_value(paddle.to_tensor(np.ascontiguousarray(scales, np.float32)))


def load_weights(model: paddle.nn.Layer, model_dir: str, num_hidden_layers: int, show_progress: bool = True) -> int:
    """Copy every checkpoint tensor (this rank's slice of it) into the parameter of the same name;
    errors name the tensor (and the rank). Returns the bytes read from the checkpoint."""
    params = dict(model.named_parameters())
    owns = getattr(model, "owns_checkpoint_tensor", lambda name: True)
    rank = getattr(getattr(model, "tp", None), "rank", 0)
    sources: dict[str, SafeTensorsFile] = {}
    for path in checkpoint_files(model_dir):
        f = SafeTensorsFile(path)
        for k in f.keys():
            sources[k] = f
    mtp = re.compile(r"model\.layers\.(\d+)\.")
    names = []
    for k in sources:
        m = mtp.match(k)
        if k.endswith("_scale_inv") or (m and int(m.group(1)) >= num_hidden_layers) or not owns(k):
            continue
        if k not in params:
            raise CheckpointError(f"unexpected tensor {k} in the checkpoint (no such parameter in the model)")
        names.append(k)
    kept_scales = {k for k in params if k.endswith("_scale_inv")}  # loaded with their FP8 weight
    missing = sorted(set(params) - set(names) - kept_scales)
    if missing:
        raise CheckpointError(f"tensor {missing[0]} is missing from the checkpoint ({len(missing)} missing)")
    for k in tqdm(sorted(names), desc="loading weights", unit="tensor", disable=not show_progress):
        f = sources[k]
        p = params[k]
        shard = getattr(p, "tp_shard", None)  # (dim, start, end, full size of dim)
        expected = list(p.shape)
        if shard is not None:
            expected[shard[0]] = shard[3]
        if list(f.shape(k)) != expected:
            where = f" (tensor-parallel rank {rank})" if shard is not None and shard[3] != shard[2] - shard[1] else ""
            raise CheckpointError(f"tensor {k} has shape {list(f.shape(k))}, the model expects {expected}{where}")
        x = f.get(k) if shard is None else f.get(k, *shard[:3])
        if p.dtype == paddle.uint8:  # kept FP8: codes and scales as the checkpoint stores them
            load_fp8_kept(params, k, x, f.dtype(k), sources, shard, rank)
            continue
        if f.dtype(k) == "F8_E4M3":
            s = k + "_scale_inv"
            if s not in sources:
                raise CheckpointError(f"FP8 tensor {k} has no {s}")
            x = dequant_fp8_block(x, fp8_block_scales(sources[s], s, shard, rank), k)
        p.set_value(paddle.to_tensor(x.astype(np.float32)).astype(p.dtype))
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
