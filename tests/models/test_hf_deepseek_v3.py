"""Hugging Face's own DeepseekV3 (transformers, a test-only extra) against the engine on tiny random
checkpoints (every layer full attention: HF's model has no window), over the config keys the
engine reads another way than its defaults: YaRN's attention_factor and its mscale combinations,
original_max_position_embeddings absent, rope_interleave false (the rope dims as NeoX halves; the
loader reorders those rows), norm_topk_prob false. Prompt logprobs from a prefill chunked in 16s
equal HF's float32 log-softmax, and the float64 reference model agrees with HF too."""

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor.load_weight_utils import CheckpointError
from fastdeploy.model_executor.models.deepseek_v3_reference import forward, load_np
from fastdeploy.tools.tiny_checkpoint import make_tiny_model


def edit_rope(**kw):
    def edit(c):
        c["rope_scaling"].update(kw)
        for k in [k for k, v in kw.items() if v is None]:
            c["rope_scaling"].pop(k)

    return edit


VARIANTS = {
    "as_written": lambda c: None,
    "rope_interleave_false": lambda c: c.update(rope_interleave=False),
    "attention_factor": edit_rope(attention_factor=1.35),
    "mscale_all_dim_alone": edit_rope(mscale=None),
    "mscale_without_all_dim": edit_rope(mscale=0.707, mscale_all_dim=0),
    "no_original_max_position": edit_rope(original_max_position_embeddings=None, beta_fast=None),
    "neox_and_attention_factor_unnormalized": lambda c: (
        c.update(rope_interleave=False, norm_topk_prob=False),
        c["rope_scaling"].update(attention_factor=0.8),
    ),
}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("hf_base")), seed=11, swa_layers=[])


def variant(base: str, dst: str, edit) -> tuple[str, dict]:
    shutil.copytree(base, dst)
    with open(f"{dst}/config.json") as f:
        cfg = json.load(f)
    edit(cfg)
    with open(f"{dst}/config.json", "w") as f:
        json.dump(cfg, f)
    return dst, cfg


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prompt_logprobs_equal_hugging_face(name, base_dir, tmp_path, rng):
    d, cfg = variant(base_dir, str(tmp_path / name), VARIANTS[name])
    ids = [int(x) for x in rng.integers(2, 500, 48)]
    hf = DeepseekV3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].double().numpy()
    lsm = log_softmax(want)
    llm = LLM(d, block_size=16, max_num_batched_tokens=16)
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": ids}, sp)[0]
    got = np.array([out.prompt_logprobs[p][ids[p]] for p in range(1, len(ids))])
    np.testing.assert_allclose(got, lsm[np.arange(len(ids) - 1), ids[1:]], rtol=0, atol=2e-5)
    assert out.outputs[0].token_ids == [int(np.argmax(want[-1]))]
    ref = forward(load_np(d), cfg, ids)  # the float64 model reads the same keys the same way
    np.testing.assert_allclose(log_softmax(ref), lsm, rtol=0, atol=2e-5)


def test_rope_interleave_false_against_the_unreordered_rows(base_dir, tmp_path, rng):
    """The reorder decides: the same weights read as NeoX halves give other logits than as pairs
    (so the test above would fail without it), and an FP8 weight kept as FP8 whose reordered rows
    would cross a 128-row scale block is refused by name."""
    ids = [int(x) for x in rng.integers(2, 500, 24)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    pairs = LLM(base_dir, block_size=16).generate({"prompt_token_ids": ids}, sp)[0]
    d, _ = variant(base_dir, str(tmp_path / "neox"), lambda c: c.update(rope_interleave=False))
    halves = LLM(d, block_size=16).generate({"prompt_token_ids": ids}, sp)[0]
    diff = max(abs(pairs.prompt_logprobs[p][ids[p]] - halves.prompt_logprobs[p][ids[p]]) for p in range(1, len(ids)))
    assert diff > 1e-2
    fp8 = make_tiny_model(str(tmp_path / "fp8"), seed=11, swa_layers=[], fp8=True)
    d8, _ = variant(fp8, str(tmp_path / "fp8_neox"), lambda c: c.update(rope_interleave=False))
    with pytest.raises(CheckpointError, match=r"q_b_proj\.weight: rope_interleave=false moves rows across 128-row"):
        LLM(d8, block_size=16, quantization="fp8", kernel_backend="triton")
    LLM(d8, block_size=16)  # de-quantized at load: any order


def test_float64_reference_equals_hugging_faces_deepseek_v32(tmp_path, rng):
    """The float64 reference model with DeepSeek-V3.2's indexer (unquantized, as HF computes it)
    against HF's DeepseekV32ForCausalLM on a tiny V3.2 checkpoint (every layer indexed, index_topk
    8, 16 index heads): logits within float32 rounding on a sequence of 4 x index_topk, where the
    selection decides (dense attention is far off), and on one no longer than index_topk, where it
    does not (the reference equals dense attention there)."""
    from transformers import DeepseekV32ForCausalLM

    d = make_tiny_model(str(tmp_path / "v32"), seed=5, dsa_layers=[0, 1, 2, 3], index_topk=8)
    cfg = json.load(open(f"{d}/config.json"))
    hf = DeepseekV32ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    w = load_np(d)
    dense = {**cfg, "layer_types": ["full_attention"] * 4}
    for n in (32, 8):
        ids = [int(x) for x in rng.integers(2, 500, n)]
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].double().numpy()
        got = forward(w, cfg, ids)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
        off = np.abs(forward(w, dense, ids) - want).max()
        assert off > 1e-2 if n > 8 else off < 2e-5 * np.abs(want).max(), (n, off)


def test_engine_serves_deepseek_v32_as_hugging_face_does(tmp_path, rng):
    """The engine on a tiny V3.2 (every layer indexed, index_topk 16) against HF's
    DeepseekV32ForCausalLM in float32 (its indexer unquantized, as the engine's kv_cache_dtype
    auto path): prompt logprobs of a 64-token prompt (4 x index_topk) prefilled in chunks of 16,
    within float32 rounding (target 2e-3); 64 greedy tokens equal to HF's generate; the same
    tokens again with the prompt a prefix-cache hit and with a whole-prompt prefill. (HF's V3.2
    indexes every layer: hybrids are held to the float64 model, tests/models/test_dsa.py.)"""
    from transformers import DeepseekV32ForCausalLM

    d = make_tiny_model(str(tmp_path / "v32"), seed=9, dsa_layers=[0, 1, 2, 3], index_topk=16)
    ids = [int(x) for x in rng.integers(2, 500, 64)]
    hf = DeepseekV32ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        lsm = log_softmax(hf(torch.tensor([ids])).logits[0].double().numpy())
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids) :].tolist()
    sp = SamplingParams(max_tokens=64, temperature=0.0, prompt_logprobs=0)
    out = LLM(d, block_size=16, max_num_batched_tokens=16).generate({"prompt_token_ids": ids}, sp)[0]
    got = np.array([out.prompt_logprobs[p][ids[p]] for p in range(1, len(ids))])
    np.testing.assert_allclose(got, lsm[np.arange(len(ids) - 1), ids[1:]], rtol=0, atol=5e-5)
    assert out.outputs[0].token_ids == greedy
    cached = LLM(d, block_size=16, enable_prefix_caching=True)
    sp = SamplingParams(max_tokens=64, temperature=0.0)
    first, again = (cached.generate({"prompt_token_ids": ids}, sp)[0] for _ in range(2))
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == greedy
    assert again.num_cached_tokens >= 48


def test_a_config_saved_by_transformers_5_reads_the_same(tmp_path, rng):
    """transformers 5's save_pretrained writes the rotary settings as rope_parameters (rope_scaling
    and rope_theta null) and V3.2's mlp_layer_types: the engine reads them as the original config
    (the same prompt logprobs, YaRN included), and refuses an mlp_layer_types that disagrees with
    first_k_dense_replace by name."""
    from transformers import DeepseekV32ForCausalLM

    d = make_tiny_model(str(tmp_path / "src"), seed=3, dsa_layers=[0, 1, 2, 3], index_topk=8)
    DeepseekV32ForCausalLM.from_pretrained(d, dtype=torch.float32).save_pretrained(str(tmp_path / "hf5"))
    saved = json.load(open(tmp_path / "hf5" / "config.json"))
    assert saved.get("rope_scaling") is None and saved["rope_parameters"]["rope_type"] == "yarn"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{d}/{f}", tmp_path / "hf5" / f)
    ids = [int(x) for x in rng.integers(2, 500, 40)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    a, b = (LLM(p, block_size=16).generate({"prompt_token_ids": ids}, sp)[0] for p in (d, str(tmp_path / "hf5")))
    diff = max(abs(a.prompt_logprobs[p][ids[p]] - b.prompt_logprobs[p][ids[p]]) for p in range(1, len(ids)))
    assert diff < 1e-5
    dst, _ = variant(str(tmp_path / "hf5"), str(tmp_path / "bad"), lambda c: c.update(mlp_layer_types=["sparse"] * 4))
    with pytest.raises(ValueError, match="config key 'mlp_layer_types'=.* disagrees with first_k_dense_replace=1"):
        LLM(dst, block_size=16)
