"""Checkpoint loading: FP8 block-quantized weights, shards, and named errors."""

import json
import os
import shutil

import numpy as np
import pytest
from model_harness import Harness, assert_close_with_routing_flips, rel

from fastdeploy.config import FDConfig, ModelConfig
from fastdeploy.distributed.parallel import TPGroup
from fastdeploy.model_executor.load_weight_utils import (
    CheckpointError,
    checkpoint_files,
    dequant_fp8_block,
    fp8_block_scales,
    load_weights,
)
from fastdeploy.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
from fastdeploy.model_executor.models.deepseek_v3_reference import forward, load_np
from fastdeploy.model_executor.ops.fp8_numerics import E4M3_TO_F32
from fastdeploy.model_executor.safetensors_io import SafeTensorsFile, save_file
from fastdeploy.tools.make_tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("base")), seed=7)


def read_all(d):
    f = SafeTensorsFile(os.path.join(d, "model.safetensors"))
    return {k: (f.dtype(k), f.get(k)) for k in f.keys()}


def copy_meta(src, dst):
    os.makedirs(dst, exist_ok=True)
    for n in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, n), dst)


def fp8_quantize(w: np.ndarray):
    """Per 128x128 block: scale_inv = amax / 448, codes = nearest e4m3 of w / scale_inv."""
    rows, cols = w.shape
    br, bc = -(-rows // 128), -(-cols // 128)
    scale = np.zeros((br, bc), np.float32)
    codes = np.zeros(w.shape, np.uint8)
    finite = np.where(np.isfinite(E4M3_TO_F32), E4M3_TO_F32, np.inf)
    pos = np.argsort(finite)
    for i in range(br):
        for j in range(bc):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = max(np.abs(blk).max() / 448, 1e-12)
            scale[i, j] = s
            x = blk / s
            idx = np.abs(finite[None, None, pos[:254]] - x[..., None]).argmin(-1)
            codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = pos[:254][idx]
    return codes, scale


def test_fp8_checkpoint_is_dequantized_at_load(base_dir, tmp_path, rng):
    """Projection weights stored as e4m3 + 128x128 scale_inv: the model must equal the float64
    reference run on the de-quantized weights (the load adds no error of its own)."""
    d = str(tmp_path / "fp8")
    copy_meta(base_dir, d)
    out, deq = {}, load_np(base_dir)
    for k, (dt, x) in read_all(base_dir).items():
        if x.ndim == 2 and "proj" in k:
            codes, s = fp8_quantize(x)
            out[k] = ("F8_E4M3", codes)
            out[k + "_scale_inv"] = ("F32", s)
            deq[k] = dequant_fp8_block(codes, s, k).astype(np.float64)
        else:
            out[k] = (dt, x)
    save_file(os.path.join(d, "model.safetensors"), out)
    ids = [int(x) for x in rng.integers(0, 500, 40)]
    got = Harness(d).prefill("a", ids)
    cfg = json.load(open(os.path.join(d, "config.json")))
    windows = [cfg["sliding_window"] if f else None for f in cfg["window_attn_skip_freq"]]
    assert_close_with_routing_flips(got, forward(deq, cfg, ids, windows, fp8_kv=True), 1e-2, 5e-2)
    assert rel(got, Harness(base_dir).prefill("a", ids)) > 1e-3  # the weights did change


def test_sharded_checkpoint_with_index_and_mtp_layer(base_dir, tmp_path, rng):
    d = str(tmp_path / "sharded")
    copy_meta(base_dir, d)
    tensors = read_all(base_dir)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    mtp = "model.layers.4.self_attn.kv_a_layernorm.weight"  # an MTP layer's tensor: skipped
    shards["model-00002-of-00002.safetensors"].append(mtp)
    tensors[mtp] = ("F32", np.ones(512, np.float32))
    weight_map = {}
    for shard, ks in shards.items():
        save_file(os.path.join(d, shard), {k: tensors[k] for k in ks})
        weight_map.update({k: shard for k in ks})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    ids = [int(x) for x in rng.integers(0, 500, 30)]
    assert rel(Harness(d).prefill("a", ids), Harness(base_dir).prefill("a", ids)) < 1e-6
    os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        checkpoint_files(d)


def _broken(base_dir, tmp_path, edit):
    d = str(tmp_path / "broken")
    copy_meta(base_dir, d)
    t = read_all(base_dir)
    edit(t)
    save_file(os.path.join(d, "model.safetensors"), t)
    return d


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop("model.layers.2.self_attn.kv_b_proj.weight"), "model.layers.2.self_attn.kv_b_proj.weight"),
        (
            lambda t: t.update({"model.layers.0.self_attn.extra.weight": ("F32", np.ones(3, np.float32))}),
            "unexpected tensor model.layers.0.self_attn.extra.weight",
        ),
        (lambda t: t.update({"lm_head.weight": ("F32", np.ones((3, 3), np.float32))}), "lm_head.weight has shape"),
        (
            lambda t: t.update({"model.norm.weight": ("F8_E4M3", np.ones(128, np.uint8))}),
            "no model.norm.weight_scale_inv",
        ),
    ],
)
def test_bad_checkpoints_name_the_tensor(base_dir, tmp_path, edit, match):
    d = _broken(base_dir, tmp_path, edit)
    with pytest.raises(CheckpointError, match=match):
        Harness(d)


def test_empty_dir_and_bad_scale_shape(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        checkpoint_files(str(tmp_path))
    with pytest.raises(CheckpointError, match="w_scale_inv has shape"):
        dequant_fp8_block(np.zeros((130, 10), np.uint8), np.ones((1, 1), np.float32), "w")
    got = dequant_fp8_block(np.full((130, 10), 0x38, np.uint8), np.array([[2.0], [3.0]], np.float32), "w")
    assert got[0, 0] == 2.0 and got[129, 9] == 3.0


def test_fp8_tensors_split_at_128_blocks(base_dir, tmp_path, rng):
    """Under TP an FP8 tensor's slice takes the block scales that cover it; a slice that cuts a
    128-block is an error naming the tensor and the rank."""
    w = rng.standard_normal((256, 384)).astype(np.float32)
    codes, s = fp8_quantize(w)
    path = str(tmp_path / "w.safetensors")
    save_file(path, {"w": ("F8_E4M3", codes), "w_scale_inv": ("F32", s)})
    f = SafeTensorsFile(path)
    full = dequant_fp8_block(codes, s, "w")
    for shard, want in (((0, 128, 256, 256), full[128:]), ((1, 128, 384, 384), full[:, 128:])):
        got = dequant_fp8_block(f.get("w", *shard[:3]), fp8_block_scales(f, "w_scale_inv", shard, 1), "w")
        np.testing.assert_array_equal(got, want)
    with pytest.raises(CheckpointError, match=r"FP8 tensor w: rank 1's slice \[64, 128\) of dim 1"):
        fp8_block_scales(f, "w_scale_inv", (1, 64, 128, 384), 1)
    # the tiny model at TP 2: o_proj's input (4 heads x 32) splits at 64, inside a block
    d = str(tmp_path / "fp8")
    copy_meta(base_dir, d)
    out = {}
    for k, (dt, x) in read_all(base_dir).items():
        if x.ndim == 2 and "proj" in k:
            c, sc = fp8_quantize(x)
            out[k], out[k + "_scale_inv"] = ("F8_E4M3", c), ("F32", sc)
        else:
            out[k] = (dt, x)
    save_file(os.path.join(d, "model.safetensors"), out)
    cfg = ModelConfig.from_pretrained(d)
    model = DeepseekV3ForCausalLM(FDConfig(model_config=cfg), TPGroup(rank=0, world_size=2))
    with pytest.raises(CheckpointError, match=r"o_proj.weight: rank 0's slice \[0, 64\) of dim 1 does not fall on 128"):
        load_weights(model, d, cfg.num_hidden_layers, show_progress=False)
