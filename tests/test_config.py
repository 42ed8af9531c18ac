import json

import pytest

from fastdeploy.config import CacheConfig, FDConfig, ModelConfig, ParallelConfig, SchedulerConfig


def cfg(**kw):
    base = {"num_hidden_layers": 8}
    base.update(kw)
    return ModelConfig.from_dict(base)


def test_list_form():
    c = cfg(sliding_window=128, window_attn_skip_freq=[1, 1, 1, 0, 1, 1, 1, 0])
    assert c.sliding_window == 128
    assert c.swa_layer_ids == [0, 1, 2, 4, 5, 6]
    assert c.is_swa_layer(0) and not c.is_swa_layer(3)


def test_int_form_equals_list_form_and_window_size_equals_sliding_window():
    a = cfg(sliding_window=128, window_attn_skip_freq=[1, 1, 1, 0, 1, 1, 1, 0])
    b = cfg(window_size=[127, 0], window_attn_skip_freq=4)
    assert b.window_attn_skip_freq == a.window_attn_skip_freq
    assert [i for i in range(8) if not b.is_swa_layer(i)] == [3, 7]
    assert b.sliding_window == a.sliding_window == 128


def test_sliding_window_pair_means_left_plus_one():
    assert cfg(sliding_window=[128, 0], window_attn_skip_freq=2).sliding_window == 129


def test_int_one_means_all_full():
    c = cfg(sliding_window=16, window_attn_skip_freq=1)
    assert c.swa_layer_ids == []


def test_layer_types():
    types = ["sliding_attention", "full_attention"] * 4
    c = cfg(sliding_window=16, layer_types=types)
    assert c.swa_layer_ids == [0, 2, 4, 6]
    both = cfg(sliding_window=16, layer_types=types, window_attn_skip_freq=[1, 0] * 4)
    assert both.window_attn_skip_freq == c.window_attn_skip_freq


def test_window_alone_means_all_swa_and_nothing_means_none():
    assert cfg(sliding_window=16).swa_layer_ids == list(range(8))
    c = cfg()
    assert c.swa_layer_ids == [] and c.sliding_window is None


def test_mtp_flags_accepted():
    c = cfg(sliding_window=16, num_nextn_predict_layers=1, window_attn_skip_freq=[1] * 9)
    assert c.is_swa_layer(8)
    with pytest.raises(IndexError):
        c.is_swa_layer(9)


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"sliding_window": 16, "window_attn_skip_freq": [1, 0, 1]}, "window_attn_skip_freq"),
        ({"sliding_window": 16, "window_attn_skip_freq": [1, 0, 2, 0, 1, 0, 1, 0]}, "window_attn_skip_freq"),
        ({"sliding_window": 16, "window_attn_skip_freq": [1, 0, True, 0, 1, 0, 1, 0]}, "window_attn_skip_freq"),
        ({"sliding_window": 16, "window_attn_skip_freq": 0}, "window_attn_skip_freq"),
        ({"sliding_window": 16, "window_attn_skip_freq": -2}, "window_attn_skip_freq"),
        ({"sliding_window": 16, "window_attn_skip_freq": "2"}, "window_attn_skip_freq"),
        ({"window_attn_skip_freq": [1, 0] * 4}, "window_attn_skip_freq"),
        ({"sliding_window": 0, "window_attn_skip_freq": [1, 0] * 4}, "sliding_window"),
        ({"sliding_window": -5}, "sliding_window"),
        ({"sliding_window": [16, 4]}, "sliding_window"),
        ({"sliding_window": [16]}, "sliding_window"),
        ({"window_size": [15, 1]}, "window_size"),
        ({"window_size": [-3, 0]}, "window_size"),
        ({"sliding_window": 16, "window_size": [31, 0]}, "window_size"),
        ({"sliding_window": 16, "layer_types": ["sliding_attention", "global"] * 4}, "layer_types"),
        ({"sliding_window": 16, "layer_types": ["sliding_attention"] * 3}, "layer_types"),
        ({"layer_types": ["sliding_attention"] * 8}, "layer_types"),
        (
            {"sliding_window": 16, "layer_types": ["sliding_attention"] * 8, "window_attn_skip_freq": [1, 0] * 4},
            "layer_types",
        ),
        ({"sliding_window": 16, "swa_rope_theta": -1.0}, "swa_rope_theta"),
        ({"q_lora_rank": 0}, "q_lora_rank"),
    ],
)
def test_invalid_values_name_the_key(kw, key):
    with pytest.raises(ValueError, match=key):
        cfg(**kw)


def test_megatron_no_window_pair():
    assert cfg(window_size=[-1, -1]).sliding_window is None


def test_from_pretrained_tiny_has_both_kinds(tiny_model_dir):
    c = ModelConfig.from_pretrained(tiny_model_dir)
    assert c.sliding_window == 32
    assert c.swa_layer_ids and len(c.swa_layer_ids) < c.num_hidden_layers
    assert c.kv_lora_rank == 512 and c.qk_rope_head_dim == 64 and c.q_lora_rank
    assert c.rope_scaling["type"] == "yarn" and c.n_group > 1
    assert c.qk_head_dim == c.qk_nope_head_dim + 64


def test_from_pretrained_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path))


def test_unknown_keys_ignored_and_eos_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "foo": 1, "eos_token_id": [1, 2]}))
    c = ModelConfig.from_pretrained(str(tmp_path))
    assert c.eos_token_ids == [1, 2] and c.model_dir == str(tmp_path)
    assert ModelConfig.from_dict({"num_hidden_layers": 1, "eos_token_id": None}).eos_token_ids == []


@pytest.mark.parametrize(
    "ctor, kw, word",
    [
        (CacheConfig, {"block_size": 48}, "block_size"),
        (CacheConfig, {"block_size": 0}, "block_size"),
        (CacheConfig, {"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
        (CacheConfig, {"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        (CacheConfig, {"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
        (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs"),
        (ParallelConfig, {"tensor_parallel_size": 0}, "tensor_parallel_size"),
        (ParallelConfig, {"dist_timeout": 0}, "dist_timeout"),
        (ParallelConfig, {"data_parallel_size": 0}, "data_parallel_size"),
        (ParallelConfig, {"data_parallel_size": 1.5}, "data_parallel_size"),
    ],
)
def test_engine_config_errors(ctor, kw, word):
    with pytest.raises(ValueError, match=word):
        ctor(**kw)


def test_fdconfig(tiny_model_dir):
    mc = ModelConfig.from_pretrained(tiny_model_dir)
    fd = FDConfig(mc)
    assert fd.scheduler_config.max_model_len == mc.max_position_embeddings
    assert fd.cache_config.block_size == 64 and fd.parallel_config.tensor_parallel_size == 1
    with pytest.raises(ValueError, match="max_model_len"):
        FDConfig(mc, scheduler_config=SchedulerConfig(max_model_len=10**6))
    with pytest.raises(ValueError, match="chunked prefill"):
        FDConfig(mc, scheduler_config=SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=False))


def test_expert_parallel_settings_are_checked(tiny_model_dir, mtp_model_dir):
    """Experts must divide over D x TP; cores in lockstep run neither speculation nor capture
    (each names the setting), and step in turn."""
    from fastdeploy.config import SpeculativeConfig

    mc = ModelConfig.from_pretrained(tiny_model_dir)  # 8 routed experts
    ep = lambda d, tp=1: ParallelConfig(tp, data_parallel_size=d, enable_expert_parallel=True)  # noqa: E731
    with pytest.raises(ValueError, match="n_routed_experts.*3 expert-parallel ranks"):
        FDConfig(mc, parallel_config=ep(3))
    assert FDConfig(mc, parallel_config=ParallelConfig(data_parallel_size=3)).parallel_config.expert_parallel_size == 1
    with pytest.raises(ValueError, match="cuda_graph_capture"):
        FDConfig(mc, scheduler_config=SchedulerConfig(cuda_graph_capture=True), parallel_config=ep(2))
    with pytest.raises(ValueError, match="speculative_config"):
        FDConfig(
            ModelConfig.from_pretrained(mtp_model_dir),
            parallel_config=ep(2),
            speculative_config=SpeculativeConfig("mtp", 1),
        )
    fd = FDConfig(mc, parallel_config=ep(2, 2))
    assert fd.parallel_config.expert_parallel_size == 4 and not fd.scheduler_config.async_scheduling


@pytest.mark.parametrize(
    "text, msg",
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"num_speculative_tokens": 1}', "'method' is required"),
        ('{"method": "eagle"}', "method 'eagle'"),
        ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "mtp", "num_speculative_tokens": 9}', "num_speculative_tokens"),
        ('{"method": "mtp", "num_speculative_tokens": true}', "num_speculative_tokens"),
        ('{"method": "mtp", "k": 2}', "unknown key 'k'"),
    ],
)
def test_speculative_config_errors_name_what_is_wrong(text, msg):
    from fastdeploy.config import SpeculativeConfig

    with pytest.raises(ValueError, match=msg):
        SpeculativeConfig.parse(text)


def test_speculative_config_parses_both_method_names():
    from fastdeploy.config import SpeculativeConfig

    assert SpeculativeConfig.parse(None).k == 0 and SpeculativeConfig.parse("").k == 0
    assert SpeculativeConfig.parse('{"method": "mtp"}').k == 1
    assert SpeculativeConfig.parse({"method": "deepseek_mtp", "num_speculative_tokens": 3}).k == 3


def test_dtype_resolves_once_into_the_model_config():
    """``--dtype``: auto is bfloat16 on a GPU and float32 on CPU; the others pass; anything else is
    refused by name. EngineArgs writes the resolved dtype into ModelConfig.dtype, which the model,
    its KV specs and the TP workers (inside the pickled FDConfig) read."""
    from fastdeploy.config import resolve_dtype

    assert resolve_dtype("auto", on_gpu=True) == "bfloat16"
    assert resolve_dtype("auto", on_gpu=False) == "float32"
    for d in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(d, on_gpu=True) == d
    assert resolve_dtype("float32", on_gpu=False) == "float32"
    for d in ("bfloat16", "float16"):  # paddle's CPU build has no 16-bit matmul: refused at start
        with pytest.raises(ValueError, match=f"^dtype '{d}' needs a GPU: paddle's CPU kernels have no {d} matmul"):
            resolve_dtype(d, on_gpu=False)
    with pytest.raises(ValueError, match="^dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got 'int8'$"):
        resolve_dtype("int8", on_gpu=False)


def test_indexed_layers_come_from_layer_types_or_model_type():
    """DeepSeek-V3.2 (model_type deepseek_v32) indexes every layer, its MTP layer included;
    ``layer_types`` names each layer's kind and may mix all three (an MTP layer it does not list
    is indexed only in a deepseek_v32 model); DSA layers keep every token (the full group)."""
    v32 = cfg(model_type="deepseek_v32", num_nextn_predict_layers=1)
    assert v32.index_flags == [1] * 9 and not v32.swa_layer_ids
    assert (v32.index_topk, v32.index_n_heads, v32.index_head_dim, v32.indexer_rope_interleave) == (
        2048,
        64,
        128,
        False,
    )
    kinds = ["sliding_attention", "indexed_attention", "full_attention", "indexed_attention"] * 2
    mixed = cfg(layer_types=kinds, sliding_window=16, num_nextn_predict_layers=1, index_topk=512)
    assert [i for i in range(9) if mixed.is_indexed_layer(i)] == [1, 3, 5, 7]
    assert mixed.swa_layer_ids == [0, 4] and mixed.index_topk == 512
    mixed.mtp_layers = 1
    assert mixed.kv_cache_groups == {"swa": [0, 4], "full": [1, 2, 3, 5, 6, 7, 8]}
    listed = cfg(layer_types=kinds + ["indexed_attention"], sliding_window=16, num_nextn_predict_layers=1)
    assert listed.is_indexed_layer(8)
    v32_listed = cfg(model_type="deepseek_v32", layer_types=["indexed_attention"] * 8, num_nextn_predict_layers=1)
    assert v32_listed.is_indexed_layer(8)
    assert not any(cfg().index_flags) and not cfg().is_indexed_layer(99)


def test_kv_spec_for_is_a_function_of_the_configs():
    """Each layer's KV layout from the model config (its SWA layers, its dtype) and the cache config
    alone: SWA layers the 656-byte record, full layers 576 values in the model dtype, bf16 or the
    record as kv_cache_dtype says."""
    import dataclasses

    from fastdeploy.model_executor.models.deepseek_v3 import kv_spec_for

    c = cfg(sliding_window=128, window_attn_skip_freq=[1, 0, 1, 0, 1, 0, 1, 0])
    for dtype, size in (("float32", 4), ("bfloat16", 2), ("float16", 2)):
        mc = dataclasses.replace(c, dtype=dtype)
        for kv, want in (
            ("auto", ("full", dtype, 576 * size, 576)),
            ("bf16", ("full", "bfloat16", 1152, 576)),
            ("fp8", ("full", "uint8", 656, 656)),
        ):
            cc = CacheConfig(kv_cache_dtype=kv)
            for layer in range(8):
                s = kv_spec_for(mc, cc, layer)
                got = (s.group, s.dtype, s.bytes_per_token, s.last_dim)
                assert got == (("swa", "uint8", 656, 656) if layer % 2 == 0 else want), (dtype, kv, layer)
                assert s.index is None
    # a DSA layer: the full layers' latent plus its indexer keys (e4m3 + a float32 scale with fp8)
    v32 = cfg(model_type="deepseek_v32")
    for kv, (main, index) in (
        ("fp8", (("full", "uint8", 656 + 132, 656), ("full", "uint8", 132, 132))),
        ("auto", (("full", "float32", 4 * 576 + 4 * 128, 576), ("full", "float32", 512, 128))),
        ("bf16", (("full", "bfloat16", 1152 + 256, 576), ("full", "bfloat16", 256, 128))),
    ):
        s = kv_spec_for(v32, CacheConfig(kv_cache_dtype=kv), 3)
        assert (s.group, s.dtype, s.bytes_per_token, s.last_dim) == main, kv
        i = s.index
        assert (i.group, i.dtype, i.bytes_per_token, i.last_dim) == index, kv
        assert i.index is None


def test_rope_parameters_read_as_rope_scaling():
    """transformers 5's rope_parameters: YaRN's keys become rope_scaling, rope_theta comes along,
    the default type is no scaling; the same values given both ways are accepted."""
    yarn = {"rope_type": "yarn", "rope_theta": 5e4, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0}
    c = cfg(rope_parameters=yarn, rope_theta=None, rope_scaling=None)
    assert c.rope_theta == 5e4 and c.rope_scaling["type"] == "yarn" and c.rope_scaling["factor"] == 40
    assert "rope_theta" not in c.rope_scaling
    plain = cfg(rope_parameters={"rope_type": "default", "rope_theta": 2e4})
    assert plain.rope_theta == 2e4 and plain.rope_scaling is None
    both = cfg(rope_parameters=yarn, rope_theta=5e4, rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0,
                                                                     "mscale_all_dim": 1.0})  # fmt: skip
    assert both.rope_scaling == {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"hidden_act": "gelu"}, "config key 'hidden_act'='gelu': only 'silu' is supported"),
        ({"attention_bias": True}, "config key 'attention_bias'=true: attention projections with biases"),
        ({"tie_word_embeddings": True}, "config key 'tie_word_embeddings'=true: an LM head tied"),
        ({"model_type": "deepseek_v32", "index_topk": 0}, "config key 'index_topk' must be a positive int, got 0"),
        ({"model_type": "deepseek_v32", "index_n_heads": 1.5}, "config key 'index_n_heads' must be a positive int"),
        ({"model_type": "deepseek_v32", "index_head_dim": 32}, "'index_head_dim'=32 is below qk_rope_head_dim=64"),
        (
            {"model_type": "deepseek_v32", "indexer_rope_interleave": "yes"},
            "config key 'indexer_rope_interleave' must be true or false, got 'yes'",
        ),
        (
            {"layer_types": ["indexed_attention"] * 8, "q_lora_rank": None},
            "config key 'q_lora_rank' is null: the indexed \\(DSA\\) layers' indexer reads the q latent",
        ),
        (
            {"layer_types": ["indexed_attention"] * 8, "sliding_window": 64, "window_attn_skip_freq": [1] * 8},
            "disagree on the SWA layers",
        ),
        ({"layer_types": ["linear_attention"] * 8}, "config key 'layer_types' has unknown entry 'linear_attention'"),
        ({"mlp_bias": True}, "config key 'mlp_bias'=true: MLPs with biases are not supported"),
        ({"rope_parameters": [1]}, "config key 'rope_parameters' must be an object"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 40}, "rope_scaling": {"type": "yarn", "factor": 4}},
            "config keys 'rope_parameters'=.* and 'rope_theta' / 'rope_scaling' .* disagree",
        ),
        ({"rope_parameters": {"rope_theta": 5e4}, "rope_theta": 1e4}, "'rope_parameters'=.* disagree"),
        ({"rope_interleave": "no"}, "config key 'rope_interleave' must be true or false, got 'no'"),
    ],
)
def test_keys_computed_another_way_are_refused_by_name(raw, message):
    """Keys of Hugging Face's DeepseekV3 config the engine does not implement fail at load with
    their name, instead of serving a model that silently differs (tests/models/
    test_hf_deepseek_v3.py holds the implemented ones to HF's model)."""
    with pytest.raises(ValueError, match=message):
        cfg(**raw)
    assert cfg(hidden_act="silu", attention_bias=False, tie_word_embeddings=False).rope_interleave is True
    assert cfg(rope_interleave=False).rope_interleave is False
