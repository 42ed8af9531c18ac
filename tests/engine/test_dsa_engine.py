"""DSA layers (DeepSeek-V3.2's lightning indexer) through the engine: greedy tokens unchanged by
captured decode buckets (padding rows in the null block), by MTP speculation (the V3.2 MTP layer
is indexed too) and by the FP8 weights path, with the KV blocks all back in the pool."""

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.tools.make_tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def v32_mtp_dir(tmp_path_factory):
    """Every layer indexed (index_topk 16), its MTP layer too."""
    return make_tiny_model(str(tmp_path_factory.mktemp("v32mtp")), seed=4, dsa_layers=[0, 1, 2, 3], mtp=True)


def prompts(rng, lengths):
    return [{"prompt_token_ids": [int(x) for x in rng.integers(2, 500, n)]} for n in lengths]


def greedy(llm, ps, n=40):
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(ps, sp)]


def assert_pools_full(llm):
    assert all(p.num_free == p.num_blocks for p in llm.engine.block_manager.pools.values())


def test_capture_and_speculation_change_no_token(v32_mtp_dir, rng):
    """Three requests past 4 x index_topk with decode steps captured in buckets of 2 and 4 (three
    rows run as four), and with MTP k = 2: the eager tokens exactly; every block freed."""
    ps = prompts(rng, (70, 9, 33))
    eager = LLM(v32_mtp_dir, block_size=16, cuda_graph_batch_sizes="")
    want = greedy(eager, ps)
    captured = LLM(v32_mtp_dir, block_size=16, cuda_graph_batch_sizes="2,4", cuda_graph_capture=True)
    assert greedy(captured, ps) == want and captured.engine.runner.graphs.replays >= 30
    spec = LLM(v32_mtp_dir, block_size=16, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert greedy(spec, ps) == want
    for llm in (eager, captured, spec):
        assert_pools_full(llm)


def test_fp8_checkpoint_keeps_its_indexer_fp8(tmp_path, rng):
    """An FP8 tiny V3.2 (the indexer's wq_b / wk e4m3 with block scales, weights_proj bf16) kept
    FP8: the indexer's q, k and head weights equal the float64 projections of W8A8 GEMMs (inputs
    quantized per 128 columns), within float32 rounding; the engine serves it with an FP8 cache,
    every block back in the pool after."""
    import json

    import numpy as np
    import paddle

    from fastdeploy.model_executor.models.deepseek_v3_reference import indexer_qkw, load_np, rope_angles

    d = make_tiny_model(str(tmp_path / "v32fp8"), seed=4, dsa_layers=[0, 1, 2, 3], fp8=True)
    llm = LLM(d, block_size=16, quantization="fp8", kv_cache_dtype="fp8")
    attn = llm.engine.runner.model.model.layers[1].self_attn
    assert attn.indexer.wq_b.weight.dtype == attn.indexer.wk.weight.dtype == paddle.uint8
    assert attn.indexer.weights_proj.weight.dtype == paddle.float32
    cfg, w = json.load(open(f"{d}/config.json")), load_np(d)
    T = 20
    x = rng.standard_normal((T, cfg["hidden_size"])).astype(np.float32)
    q_lat = rng.standard_normal((T, cfg["q_lora_rank"])).astype(np.float32)
    with paddle.no_grad():
        got = attn.indexer(paddle.to_tensor(x), paddle.to_tensor(q_lat), paddle.arange(T))
    ang, mult = rope_angles(np.arange(T), cfg["qk_rope_head_dim"], cfg["rope_theta"], cfg.get("rope_scaling"),
                            cfg["max_position_embeddings"])  # fmt: skip
    want = indexer_qkw(x.astype(np.float64), q_lat.astype(np.float64), w, "model.layers.1.self_attn.", cfg, ang, mult,
                       act_fp8=True)  # fmt: skip
    for g, v in zip(got, want, strict=True):
        e = np.abs(g.numpy() - v).max() / np.abs(v).max()
        assert e < 1e-3, e
    plain = indexer_qkw(x.astype(np.float64), q_lat.astype(np.float64), w, "model.layers.1.self_attn.", cfg, ang, mult)
    assert np.abs(got[0].numpy() - plain[0]).max() > 1e-2 * np.abs(plain[0]).max()  # really quantized
    out = llm.generate(prompts(rng, (50,)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
    assert_pools_full(llm)
