"""The offline API and the engine: batching, chunked prefill, preemption, prefix caching, stops."""

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.config import FDConfig, KernelConfig, ModelConfig
from fastdeploy.engine.args import EngineArgs
from fastdeploy.model_executor.models.deepseek_v3 import layer_kv_specs
from fastdeploy.worker.kv_sizing import group_bytes_per_block, num_blocks_for

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=200, max_model_len=1024)


def prompts(rng, lens):
    return [{"prompt_token_ids": [int(x) for x in rng.integers(2, 500, n)]} for n in lens]


def test_generate_text_and_ids(llm):
    out = llm.generate(["Hello", {"prompt_token_ids": [5, 6, 7]}], GREEDY)
    assert len(out) == 2
    assert out[0].prompt_token_ids[0] == llm.get_tokenizer().bos_token_id
    for o in out:
        c = o.outputs[0]
        assert len(c.token_ids) == 12 and c.finish_reason == "length" and o.finished
        assert c.text == llm.get_tokenizer().decode(c.token_ids)  # the whole text at the finish
    assert out[1].prompt_token_ids == [5, 6, 7]


def test_batched_equals_alone(llm, rng):
    ps = prompts(rng, [3, 40, 100, 130])  # some beyond 3W (W = 32)
    together = llm.generate(ps, GREEDY)
    for p, t in zip(ps, together, strict=True):
        assert llm.generate([p], GREEDY)[0].outputs[0].token_ids == t.outputs[0].token_ids


def test_logprobs_and_seed(llm):
    sp = SamplingParams(max_tokens=5, temperature=0.8, seed=11, logprobs=2)
    a = llm.generate(["Once upon"], sp)[0].outputs[0]
    b = llm.generate(["Once upon"], sp)[0].outputs[0]
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == 5
    for tok, lp in zip(a.token_ids, a.logprobs, strict=True):
        assert tok in lp and all(v <= 0 for v in lp.values())


def test_stop_token_ids_and_strings(llm):
    first = llm.generate(["Hello"], GREEDY)[0].outputs[0]
    stop_at = first.token_ids[3]
    out = llm.generate(["Hello"], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.outputs[0].token_ids == first.token_ids[: first.token_ids.index(stop_at) + 1]
    assert out.outputs[0].finish_reason == "stop"
    text = first.text
    if len(text) > 4:
        s = text[2:4]
        o = llm.generate(["Hello"], SamplingParams(max_tokens=12, temperature=0, stop=[s]))[0].outputs[0]
        assert o.finish_reason == "stop" and o.text == text[: text.find(s)]


def test_eos_stops(llm, monkeypatch):
    first = llm.generate(["Hello"], GREEDY)[0].outputs[0]
    eng = llm.engine
    monkeypatch.setattr(eng, "eos_token_ids", [first.token_ids[2]])
    out = llm.generate(["Hello"], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == first.token_ids[:3]


@pytest.mark.parametrize("chunk", [16, 32, 48])
def test_chunked_prefill_budget_same_tokens(llm, chunk, rng):
    ps = prompts(rng, [70, 100])
    want = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)]
    small = LLM(
        model="tiny-mla-swa",
        block_size=16,
        num_gpu_blocks_override=200,
        max_model_len=1024,
        max_num_batched_tokens=chunk,
    )
    assert [o.outputs[0].token_ids for o in small.generate(ps, GREEDY)] == want


def test_preemption_completes_with_same_tokens(llm, rng):
    ps = prompts(rng, [40, 35, 45, 40])  # all four fit when admitted, then outgrow the 12 blocks
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(ps, sp)]
    tiny = LLM(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=12, max_model_len=150)
    got = tiny.generate(ps, sp)
    assert [o.outputs[0].token_ids for o in got] == want
    eng = tiny.engine
    assert sum(r.num_preemptions for r in eng.preempted_log) > 0
    assert {g: p.num_free for g, p in eng.block_manager.pools.items()} == {"full": 12, "swa": 12}


def test_prefix_caching_same_tokens_and_hits(rng):
    shared = [int(x) for x in rng.integers(2, 500, 48)]
    ps = [{"prompt_token_ids": shared[:n] + [int(x) for x in rng.integers(2, 500, 9)]} for n in (16, 32, 48)]
    off = LLM(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=100, max_model_len=512)
    on = LLM(
        model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=100, max_model_len=512, enable_prefix_caching=True
    )
    want = [o.outputs[0].token_ids for o in off.generate(ps, GREEDY)]
    on.generate([{"prompt_token_ids": shared + [1, 2, 3]}], GREEDY)  # warm the cache
    got = on.generate(ps, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == want
    assert [o.num_cached_tokens for o in got] == [16, 32, 48]
    assert on.engine.block_manager.prefix_hits >= 96


def test_bad_requests(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [3] * 2000}], GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [3, 99999]}], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"tokens": [1]}], GREEDY)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValueError, match="max-model-len"):
        LLM(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=2, max_model_len=512)
    with pytest.raises(ValueError, match="'num_attention_heads'=4 does not divide over tensor_parallel_size=3"):
        LLM(model="tiny-mla-swa", tensor_parallel_size=3)


def test_cache_allocation_per_layer_and_budget(tiny_model_dir):
    from fastdeploy.config import CacheConfig

    mc = ModelConfig.from_pretrained(tiny_model_dir)
    for quant, full_dtype, full_bytes in (
        ("auto", "float32", 576 * 4),
        ("bf16", "bfloat16", 576 * 2),
        ("fp8", "uint8", 656),
    ):
        fd = FDConfig(mc, CacheConfig(block_size=16, num_gpu_blocks_override=None, kv_cache_dtype=quant))
        specs = layer_kv_specs(mc, fd.cache_config)
        for i, spec in enumerate(specs):
            last = 656 if full_dtype == "uint8" else 576
            want = ("swa", "uint8", 656, 656) if mc.is_swa_layer(i) else ("full", full_dtype, full_bytes, last)
            assert (spec.group, spec.dtype, spec.bytes_per_token, spec.last_dim) == want
        n_swa = len(mc.swa_layer_ids)
        per_block = {"full": 16 * full_bytes * (mc.num_hidden_layers - n_swa), "swa": 16 * 656 * n_swa}
        assert group_bytes_per_block(specs, 16) == per_block
        # the SWA pool holds 64 requests' windows + chunks (ceil((32 - 1 + 2048) / 16) + 1 blocks each) and
        # the full pool the rest, unless that leaves fewer full blocks than SWA ones: then they are equal;
        # one block of each group (the null blocks) comes off the budget first
        budget, swa = 512 * 2**20 - per_block["full"] - per_block["swa"], 64 * (-(-(32 - 1 + 2048) // 16) + 1)
        rest = (budget - swa * per_block["swa"]) // per_block["full"]
        equal = budget // (per_block["full"] + per_block["swa"])
        assert (rest < swa) == (quant == "auto")  # float32 full layers leave too little
        want = {"full": rest, "swa": swa} if rest >= swa else {"full": equal, "swa": equal}
        assert num_blocks_for(fd, specs) == want
        assert sum(want[g] * per_block[g] for g in want) <= budget
        ratio = FDConfig(mc, CacheConfig(block_size=16, kv_cache_dtype=quant, swa_full_tokens_ratio=0.25))
        full = int(budget // (per_block["full"] + 0.25 * per_block["swa"]))
        assert num_blocks_for(ratio, specs) == {"full": full, "swa": -(-full // 4)}
        override = FDConfig(mc, CacheConfig(block_size=16, num_gpu_blocks_override=40, kv_cache_dtype=quant))
        assert num_blocks_for(override, specs) == {"full": 40, "swa": 40}
        assert fd.cache_config.kv_cache_dtype == quant  # choosing SWA's format did not clear it


def test_runner_allocates_the_specs(llm):
    r = llm.engine.runner
    mc = r.fd.model_config
    for i, c in enumerate(r.caches):
        g = "swa" if mc.is_swa_layer(i) else "full"
        assert list(c.shape) == [r.num_blocks[g] + 1, 16, 1, 656 if g == "swa" else 576]  # + the null block
        assert (str(c.dtype).endswith("uint8")) == mc.is_swa_layer(i)


def test_engine_args_defaults():
    a = EngineArgs()
    assert a.model == "tiny-mla-swa" and a.block_size == 64 and a.enable_chunked_prefill
    assert np.isclose(a.gpu_memory_utilization, 0.9)


def test_kernel_choice_made_once_at_start_and_logged(tiny_model_dir, caplog):
    kw = dict(block_size=16, num_gpu_blocks_override=32, max_model_len=256)
    with caplog.at_level("INFO", logger="fastdeploy"):
        llm = LLM(model=tiny_model_dir, kernel_backend="reference", sparse_mla_provider="reference", **kw)
        out = llm.generate(["Hi", "Hello there"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    assert sum("sparse MLA attention provider: reference" in r.getMessage() for r in caplog.records) == 1
    assert llm.engine.config.kernel_config == KernelConfig(triton=False, sparse_mla_provider="reference")
    assert llm.engine.config.model_config.dtype == "float32"  # --dtype auto on CPU, resolved once
    assert {str(p.dtype) for p in llm.engine.runner.model.parameters()} == {"paddle.float32"}
    with pytest.raises(ValueError, match="kernel_backend: unknown backend 'cuda'"):
        LLM(model=tiny_model_dir, kernel_backend="cuda", **kw)


def test_a_request_ends_exactly_at_max_model_len(rng):
    """Prompt + output reach max_model_len (64) exactly: finish_reason "length" with 64 - 60 = 4
    tokens, however large max_tokens is; a prompt of 63 gets exactly one token."""
    small = LLM(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=16, max_model_len=64)
    for n_prompt, want in ((60, 4), (63, 1)):
        ids = [int(x) for x in rng.integers(2, 500, n_prompt)]
        sp = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        c = small.generate([{"prompt_token_ids": ids}], sp)[0].outputs[0]
        assert len(c.token_ids) == want and c.finish_reason == "length", (n_prompt, len(c.token_ids))


def test_min_tokens_holds_stop_strings_back_exactly(llm):
    """A stop string that the greedy output's first token already spells: with min_tokens k the
    output stops at exactly k tokens (the first check allowed), never before and never after."""
    base = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tok = llm.get_tokenizer()
    for prompt in ([5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16], [17, 18, 19]):
        ids = llm.generate([{"prompt_token_ids": prompt}], base)[0].outputs[0].token_ids
        first = tok.decode(ids[:1])
        if first.strip() and "\ufffd" not in first:  # a whole character: it spells at once
            break
    assert first.strip() and "\ufffd" not in first, "some prompt's first greedy token decodes to text"
    for k in (1, 3, 6):
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[first], min_tokens=k)
        c = llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0]
        assert c.finish_reason == "stop" and c.token_ids == ids[:k], (k, c)


def test_n_samples_are_the_seeded_requests_one_by_one(rng):
    """SamplingParams(n=3, seed=s) gives three completions, sample k the same tokens and logprobs
    as a request of its own seeded s + k; with prefix caching the samples share the prompt's
    blocks and every block is free afterwards."""
    eng = LLM(
        model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=60, max_model_len=512, enable_prefix_caching=True
    )
    p = {"prompt_token_ids": [int(x) for x in rng.integers(2, 500, 40)]}
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=2**64 - 2, logprobs=1, ignore_eos=True, n=3)
    (out,) = eng.generate([p], sp)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    alone = [eng.generate([p], SamplingParams(**{**vars(sp), "n": 1, "seed": s}))[0] for s in (2**64 - 2, 2**64 - 1, 0)]
    for c, a in zip(out.outputs, alone, strict=True):
        assert c.token_ids == a.outputs[0].token_ids
        for mine, theirs in zip(c.logprobs, a.outputs[0].logprobs, strict=True):  # batched vs alone: float32 sums
            assert mine.keys() == theirs.keys() and all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)
        assert len(c.token_ids) == 6
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the seeds differ
    assert out.prompt_token_ids == p["prompt_token_ids"]
    pools = eng.engine.block_manager.pools.values()
    assert all(pool.num_free == pool.num_blocks for pool in pools)
    (greedy,) = eng.generate([p], SamplingParams(max_tokens=6, temperature=0.0, n=2))
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    with pytest.raises(ValueError, match="n must be an integer >= 1, got 0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="^n: a request is one sample"):
        eng.engine.add_request([5, 6, 7], SamplingParams(n=2))
