import filecmp
import json
import os

import numpy as np
import pytest

from fastdeploy.config import ModelConfig
from fastdeploy.model_executor.ops.fp8_numerics import E4M3_TO_F32
from fastdeploy.model_executor.safetensors_io import SafeTensorsFile, save_file
from fastdeploy.tools import make_tiny_model as mtm
from fastdeploy.tools import tiny_checkpoint as tck


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    mtm.main([a, "--seed", "3"])
    mtm.main([b, "--seed", "3"])
    mtm.main([c, "--seed", "4"])
    names = sorted(os.listdir(a))
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    match, mismatch, err = filecmp.cmpfiles(a, b, names, shallow=False)
    assert match == names and not mismatch and not err
    assert not filecmp.cmp(os.path.join(a, "model.safetensors"), os.path.join(c, "model.safetensors"), shallow=False)


def test_options_and_tensor_shapes(tmp_path):
    d = str(tmp_path / "m")
    mtm.main([d, "--num-layers", "3", "--sliding-window", "8", "--swa-layers", "0,2"])
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.num_hidden_layers == 3 and cfg.sliding_window == 8 and cfg.swa_layer_ids == [0, 2]
    f = SafeTensorsFile(os.path.join(d, "model.safetensors"))
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    assert f.shape("model.layers.0.self_attn.kv_a_proj_with_mqa.weight") == (512 + 64, h)
    assert f.shape("model.layers.1.self_attn.kv_b_proj.weight") == (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), 512)
    assert f.shape("model.layers.2.mlp.experts.7.down_proj.weight") == (h, cfg.moe_intermediate_size)
    assert f.dtype("model.layers.0.mlp.gate_proj.weight") == "BF16"
    assert f.dtype("model.layers.1.mlp.gate.e_score_correction_bias") == "F32"
    assert "model.layers.0.mlp.gate.weight" not in f.keys()  # first_k_dense_replace = 1
    w = f.get("lm_head.weight")
    assert w.dtype == np.float32 and np.isfinite(w).all() and w.std() > 0


@pytest.mark.parametrize("ids, want", [("all", [0, 1, 2, 3]), ("none", [])])
def test_all_none(tmp_path, ids, want):
    d = str(tmp_path / ids)
    mtm.main([d, "--swa-layers", ids])
    assert ModelConfig.from_pretrained(d).swa_layer_ids == want


@pytest.mark.parametrize(
    "args", [["--swa-layers", "0,x"], ["--swa-layers", "9"], ["--num-layers", "0"], ["--sliding-window", "0"]]
)
def test_bad_cli(tmp_path, args, capsys):
    with pytest.raises(SystemExit):
        mtm.main([str(tmp_path / "x"), *args])
    assert "--" in capsys.readouterr().err


def test_tokenizer_and_chat_template(tiny_model_dir):
    from jinja2 import Template
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tiny_model_dir, "tokenizer.json"))
    text = "Hello, sliding window! ü"
    assert tok.decode(tok.encode(text).ids) == text
    tc = json.load(open(os.path.join(tiny_model_dir, "tokenizer_config.json"), encoding="utf-8"))
    cfg = json.load(open(os.path.join(tiny_model_dir, "config.json")))
    assert tok.token_to_id(tc["bos_token"]) == cfg["bos_token_id"]
    assert tok.token_to_id(tc["eos_token"]) == cfg["eos_token_id"]
    out = Template(tc["chat_template"]).render(
        messages=[
            {"role": "system", "content": "S"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
        ],
        add_generation_prompt=True,
        bos_token=tc["bos_token"],
        eos_token=tc["eos_token"],
    )
    assert out == tc["bos_token"] + "S" + tck.USER + "hi" + tck.ASSISTANT + "yo" + tc["eos_token"] + tck.ASSISTANT


def test_preset_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FD_CACHE_DIR", str(tmp_path))
    assert tck.resolve_model("/some/dir") == "/some/dir"
    p = tck.resolve_model(tck.TINY_PRESET)
    mtime = os.path.getmtime(os.path.join(p, "model.safetensors"))
    assert tck.resolve_model(tck.TINY_PRESET) == p
    assert os.path.getmtime(os.path.join(p, "model.safetensors")) == mtime
    assert ModelConfig.from_pretrained(p).swa_layer_ids == [0, 2]


def test_safetensors_roundtrip_and_errors(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    codes = rng.integers(0, 256, (4, 4), dtype=np.uint8)
    p = str(tmp_path / "t.safetensors")
    save_file(p, {"a": ("F32", x), "b": ("BF16", x), "c": ("F8_E4M3", codes), "d": ("I32", np.arange(6).reshape(2, 3))})
    f = SafeTensorsFile(p)
    np.testing.assert_array_equal(f.get("a"), x)
    np.testing.assert_allclose(f.get("b"), x, rtol=2**-8)
    np.testing.assert_array_equal(f.get("c"), codes)
    np.testing.assert_array_equal(f.get("d"), np.arange(6).reshape(2, 3))
    # e4m3: 0x38 = 1.0, 0x7e = 448 (max), 0x7f = NaN, 0x01 = 2^-9 (smallest subnormal)
    assert E4M3_TO_F32[0x38] == 1.0 and E4M3_TO_F32[0x7E] == 448.0 and E4M3_TO_F32[0x01] == 2.0**-9
    assert np.isnan(E4M3_TO_F32[0x7F]) and E4M3_TO_F32[0xB8] == -1.0
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x01")
    with pytest.raises(ValueError, match="too short"):
        SafeTensorsFile(str(bad))
    bad.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header length"):
        SafeTensorsFile(str(bad))


def test_tiny_deepseek_v32_loads_in_hugging_faces_model_and_here(tmp_path):
    """``--dsa-layers all``: DeepSeek-V3.2's own config (model_type deepseek_v32, every layer
    indexed, index_topk / index_n_heads / index_head_dim) and the indexer's weights under HF's
    names, which HF's DeepseekV32ForCausalLM loads with no key missing, unexpected or mismatched
    and runs; the engine reads every layer as indexed. With ``--fp8`` the indexer's wq_b and wk
    are e4m3 with block scales and weights_proj stays bf16, as DeepSeek-V3.2 ships them; with
    ``--mtp`` the MTP layer has its indexer too."""
    import torch
    from transformers import DeepseekV32ForCausalLM

    d = str(tmp_path / "v32")
    mtm.main([d, "--dsa-layers", "all", "--index-topk", "8"])
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["model_type"] == "deepseek_v32" and cfg["layer_types"] == ["indexed_attention"] * 4
    assert (cfg["index_topk"], cfg["index_n_heads"], cfg["index_head_dim"]) == (8, 16, 128)
    assert not any(cfg["window_attn_skip_freq"])
    names = SafeTensorsFile(os.path.join(d, "model.safetensors")).keys()
    assert {n.split("indexer.")[1] for n in names if ".indexer." in n} == {
        "wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight",
    }  # fmt: skip
    model, info = DeepseekV32ForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model(torch.arange(2, 26)[None]).logits
    assert logits.shape == (1, 24, cfg["vocab_size"]) and torch.isfinite(logits).all()
    assert ModelConfig.from_pretrained(d).index_flags == [1] * 4
    d8 = str(tmp_path / "v32_fp8")
    mtm.main([d8, "--dsa-layers", "all", "--fp8", "--mtp"])
    f = SafeTensorsFile(os.path.join(d8, "model.safetensors"))
    x = "model.layers.4.self_attn.indexer."
    assert f.dtype(x + "wq_b.weight") == f.dtype(x + "wk.weight") == "F8_E4M3"
    assert x + "wk.weight_scale_inv" in f.keys() and f.dtype(x + "weights_proj.weight") == "BF16"
    assert ModelConfig.from_pretrained(d8).index_flags == [1] * 5


def test_hybrid_layer_kinds(tmp_path, capsys):
    """Indexed, sliding and full layers in one checkpoint: HF's layer_types names each (the SWA
    flags agree), bad or overlapping ids are refused naming the flag."""
    d = str(tmp_path / "hybrid")
    mtm.main([d, "--dsa-layers", "1,3", "--swa-layers", "0"])
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["layer_types"] == ["sliding_attention", "indexed_attention", "full_attention", "indexed_attention"]
    assert cfg["window_attn_skip_freq"] == [1, 0, 0, 0] and cfg["model_type"] == "deepseek_v3"
    with pytest.raises(ValueError, match=r"DSA layers \[0\] must be layer ids in 0\.\.3 and not SWA layers \[0\]"):
        tck.tiny_config(dsa_layers=[0], swa_layers=[0])
    for args, msg in (
        (["--dsa-layers", "7"], "--dsa-layers: layer id 7 outside 0..3"),
        (["--dsa-layers", "x"], "--dsa-layers: 'x' is not a layer id"),
        (["--dsa-layers", "0", "--swa-layers", "0"], "DSA layers [0] must be layer ids in 0..3 and not SWA layers [0]"),
    ):
        with pytest.raises(SystemExit):
            mtm.main([str(tmp_path / "bad"), *args])
        assert msg in capsys.readouterr().err
