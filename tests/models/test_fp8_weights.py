"""FP8 block weights kept FP8 (docs/design.md §4.8): a DeepSeek-V3-format FP8 checkpoint written by
``make_tiny_model --fp8`` loads as e4m3 codes plus block scales; the MLP blocks match the float64
numpy blocks that quantize the projections' inputs the same way, and the logits move from the
de-quantized model's by the activation quantization's error, measured here."""

import json

import numpy as np
import paddle
import pytest
from model_harness import Harness, position_errors

from fastdeploy.config import ModelConfig, resolve_quantization
from fastdeploy.model_executor.layers.linear import FP8Linear, LinearBase
from fastdeploy.model_executor.load_weight_utils import CheckpointError, parameter_bytes
from fastdeploy.model_executor.models.deepseek_v3_reference import forward, load_np, mlp, moe
from fastdeploy.model_executor.safetensors_io import SafeTensorsFile
from fastdeploy.tools.make_tiny_model import main as make_tiny_cli
from fastdeploy.tools.make_tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """Full-attention layers only (one dense, one MoE), written through the command line: a full
    layer's float32 cache adds no rounding, so the comparison sees the weights and activations."""
    d = str(tmp_path_factory.mktemp("fp8"))
    make_tiny_cli([d, "--fp8", "--num-layers", "2", "--swa-layers", "none", "--seed", "5"])
    return d


def test_checkpoint_format(fp8_dir):
    cfg = json.load(open(f"{fp8_dir}/config.json"))
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    f = SafeTensorsFile(f"{fp8_dir}/model.safetensors")
    fp8 = {k for k in f.keys() if f.dtype(k) == "F8_E4M3"}
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in fp8
    assert "model.layers.1.mlp.experts.0.down_proj.weight" in fp8 and "model.layers.1.mlp.gate.weight" not in fp8
    assert "lm_head.weight" not in fp8 and "model.embed_tokens.weight" not in fp8
    for k in fp8:
        rows, cols = f.shape(k)
        assert list(f.shape(k + "_scale_inv")) == [-(-rows // 128), -(-cols // 128)]
        assert f.dtype(k + "_scale_inv") == "F32"


def test_kept_fp8_matches_float64_and_bounds_activation_error(fp8_dir, rng):
    cfg = json.load(open(f"{fp8_dir}/config.json"))
    w = load_np(fp8_dir)
    h = Harness(fp8_dir, quantization="fp8")
    # The MLP blocks (dense, then MoE with its shared expert) on random hidden states against the
    # float64 MLPs that quantize the projections' inputs the same way. Rows agree to float32
    # rounding unless float32 and float64 put an activation on either side of an e4m3 rounding
    # boundary: that row moves by up to ~1e-2 (a few rows in a hundred).
    x = rng.standard_normal((64, cfg["hidden_size"]))
    for i, block in enumerate((mlp, lambda x, w, p, act_fp8: moe(x, w, p, cfg, act_fp8))):
        with paddle.no_grad():
            got = h.model.model.layers[i].mlp(paddle.to_tensor(x, "float32")).numpy()
        e = position_errors(got, block(x.astype(np.float32).astype(np.float64), w, f"model.layers.{i}.mlp.", True))
        assert np.median(e) < 1e-5 and e.max() < 0.1, (i, e)
        plain = position_errors(got, block(x, w, f"model.layers.{i}.mlp.", False))
        assert np.median(plain) > 1e-3, (i, plain)  # the activations really are quantized

    # Whole model: logits within the activation quantization's error of the de-quantized model,
    # which itself matches the float64 model. (Logits against the float64 model with quantized
    # activations are not compared: one rounding-boundary case early in the prompt moves every
    # later position through attention.)
    ids = [int(x) for x in rng.integers(0, 500, 40)]
    got = h.prefill("a", ids)
    dequantized = Harness(fp8_dir, quantization="none").prefill("a", ids)
    assert position_errors(dequantized, forward(w, cfg, ids)).max() < 1e-4
    act = position_errors(got, dequantized)
    # measured over 12 prompts: median 0.051-0.062, 90th percentile 0.068-0.081; the maximum reaches
    # 0.78 where the activation error flips an MoE routing choice
    assert 3e-3 < np.median(act) < 0.1 and np.quantile(act, 0.9) < 0.15, act

    attn = h.model.model.layers[0].self_attn
    assert attn.q_b_proj.weight.dtype == paddle.uint8 and attn.q_b_proj.weight_scale_inv.dtype == paddle.float32
    kept, deq = parameter_bytes(h.model), parameter_bytes(Harness(fp8_dir).model)
    f = SafeTensorsFile(f"{fp8_dir}/model.safetensors")
    fp8_elems = sum(int(np.prod(f.shape(k))) for k in f.keys() if f.dtype(k) == "F8_E4M3")
    assert kept["uint8"] == fp8_elems  # one byte a weight
    assert deq["float32"] - kept["float32"] == 4 * fp8_elems - 4 * sum(
        int(np.prod(f.shape(k))) for k in f.keys() if k.endswith("_scale_inv")
    )


def test_kernel_path_linear_equals_reference(fp8_dir, rng):
    """An FP8 linear on the Triton path (interpreter) gives the reference path's output."""
    h = Harness(fp8_dir, quantization="fp8")
    ref = h.model.model.layers[1].mlp.shared_experts.down_proj
    lin = LinearBase(ref.in_features, ref.out_features, "float32", FP8Linear(triton=True))
    lin.weight.set_value(ref.weight)
    lin.weight_scale_inv.set_value(ref.weight_scale_inv)
    x = paddle.to_tensor(rng.standard_normal((7, ref.in_features)), "float32")
    want = ref(x).numpy()
    np.testing.assert_allclose(lin(x).numpy(), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_captured_gemms_take_the_captured_configs(rng, monkeypatch):
    """Inside ``captured_gemms`` an FP8 linear asks tuned_config for the captured step's config
    (here M 20 through descriptors, K split in two, where the eager config is the pointer
    kernel); both answers equal float64, and the linear is eager again after the block, also
    when the block raises."""
    from fastdeploy.model_executor.layers.linear import captured_gemms
    from fastdeploy.model_executor.ops.triton_ops import fp8_gemm
    from fastdeploy.model_executor.ops.triton_ops.fp8_gemm_kernel import tuned_config

    asked = []

    def spy(M, N, K, captured=False):
        asked.append(tuned_config(M, N, K, captured=captured))
        return asked[-1]

    monkeypatch.setattr(fp8_gemm, "tuned_config", spy)
    lin = LinearBase(3072, 200, "float32", FP8Linear(triton=True))
    codes = rng.integers(0, 256, (200, 3072)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    lin.weight.set_value(paddle.to_tensor(codes))
    lin.weight_scale_inv.set_value(paddle.to_tensor(rng.uniform(1e-3, 1e-2, (2, 24)).astype(np.float32)))
    x = paddle.to_tensor(rng.standard_normal((20, 3072)), "float32")
    ref = LinearBase(3072, 200, "float32", FP8Linear(triton=False))
    ref.weight.set_value(lin.weight)
    ref.weight_scale_inv.set_value(lin.weight_scale_inv)
    want = ref(x).numpy()
    with captured_gemms(lin):
        got_captured = lin(x).numpy()
    got_eager = lin(x).numpy()
    assert asked[0].get("tma") and asked[0]["split_k"] == 2 and "tma" not in asked[1]
    for got in (got_captured, got_eager):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    with pytest.raises(RuntimeError), captured_gemms(lin):
        raise RuntimeError("a failed capture")
    lin(x)
    assert "tma" not in asked[-1]


def test_bad_settings_and_checkpoints_named(fp8_dir, tmp_path):
    plain = make_tiny_model(str(tmp_path / "plain"), num_layers=1)
    cfg = ModelConfig.from_pretrained(plain)
    with pytest.raises(ValueError, match="quantization: 'fp8' needs an FP8 checkpoint"):
        resolve_quantization("fp8", cfg, on_gpu=True)
    with pytest.raises(ValueError, match="quantization: unknown value 'int4'"):
        resolve_quantization("int4", cfg, on_gpu=True)
    fp8_cfg = ModelConfig.from_pretrained(fp8_dir)
    assert resolve_quantization("auto", fp8_cfg, on_gpu=True) == "fp8"
    assert resolve_quantization("auto", fp8_cfg, on_gpu=False) == "none"
    assert resolve_quantization("auto", cfg, on_gpu=True) == "none"
    with pytest.raises(ValueError, match="quantization_config.quant_method"):
        ModelConfig.from_dict({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="weight_block_size"):
        ModelConfig.from_dict({"quantization_config": {"quant_method": "fp8", "weight_block_size": [1, 128]}})
    # a model that keeps FP8 weights, given a bf16 checkpoint: the error names the tensor
    raw = json.load(open(f"{plain}/config.json"))
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    json.dump(raw, open(f"{plain}/config.json", "w"))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.\S+ is BF16 without .*--quantization fp8"):
        Harness(plain, quantization="fp8")


def test_engine_serves_an_fp8_checkpoint_kept_fp8(fp8_dir, caplog):
    """``--quantization fp8`` through the engine: the runner logs the weights' bytes by dtype and
    greedy generation gives the same tokens as driving the model step by step."""
    from fastdeploy import LLM, SamplingParams

    with caplog.at_level("INFO", logger="fastdeploy"):
        llm = LLM(model=fp8_dir, quantization="fp8", block_size=16, num_gpu_blocks_override=64, max_model_len=256)
    assert llm.engine.config.model_config.quantization == "fp8"
    assert any("weights on rank 0" in r.getMessage() and "uint8" in r.getMessage() for r in caplog.records)
    prompt = [5, 17, 99, 3, 42, 8]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, temperature=0))[0]
    h = Harness(fp8_dir, quantization="fp8")
    logits = h.prefill("a", prompt)
    want = [int(np.argmax(logits[-1]))]
    for _ in range(5):
        want.append(int(np.argmax(h.step([("a", want[-1:])], decode={"a"})["a"][-1])))
    assert list(out.outputs[0].token_ids) == want


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_moe_block_kernel_path_equals_reference(fp8_dir, quantization, rng):
    """The MoE block (router, fused routed experts, shared expert) on the Triton path through the
    interpreter against the reference path, with the checkpoint's experts loaded into the
    stacked weights."""
    from fastdeploy.config import KernelConfig

    ref = Harness(fp8_dir, quantization=quantization).model.model.layers[1].mlp
    kern = Harness(fp8_dir, quantization=quantization, kernels=KernelConfig(triton=True)).model.model.layers[1].mlp
    assert kern.routed.__name__ == "fused_moe" and ref.routed.__name__ == "fused_moe_ref"
    x = paddle.to_tensor(rng.standard_normal((23, ref.w1.shape[2])), "float32")
    with paddle.no_grad():
        want, got = ref(x).numpy(), kern(x).numpy()
    e = position_errors(got, want)
    assert np.median(e) < 1e-5 and e.max() < (3e-2 if quantization == "fp8" else 1e-5), e


def test_missing_expert_named(tmp_path):
    """Every routed expert's tensors land in the stacked weights; a checkpoint without one of them
    is an error naming the stacked weight and how many experts it got."""
    import os

    from fastdeploy.tools.tiny_checkpoint import tiny_weights, write_safetensors

    d = make_tiny_model(str(tmp_path / "m"), num_layers=2, swa_layers=[])
    cfg = json.load(open(f"{d}/config.json"))
    w = tiny_weights(cfg, 0)
    h = Harness(d)
    moe_block = h.model.model.layers[1].mlp
    f = SafeTensorsFile(f"{d}/model.safetensors")
    e3 = f.get("model.layers.1.mlp.experts.3.up_proj.weight")
    np.testing.assert_array_equal(moe_block.w3[3].numpy(), e3)  # expert 3's up_proj in slice 3
    del w["model.layers.1.mlp.experts.3.up_proj.weight"]
    os.remove(f"{d}/model.safetensors")
    write_safetensors(f"{d}/model.safetensors", w)
    n = cfg["n_routed_experts"]
    with pytest.raises(CheckpointError, match=rf"model\.layers\.1\.mlp\.w3 \(only {n - 1} of its {n} experts\)"):
        Harness(d)
