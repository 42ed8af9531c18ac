"""Prompt logprobs (SamplingParams.prompt_logprobs): computed in the prefill steps, chunk by chunk.
Against the float64 reference on a full-attention model, and on the hybrid SWA model unchanged by
chunk sizes below / equal to / above W, by prefix caching (a request that asks reads no cached
block, and still registers its blocks for others), by preemption and by batching."""

import json

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor.models.deepseek_v3_reference import forward, load_np
from fastdeploy.tools.make_tiny_model import make_tiny_model

W = 32  # the hybrid tiny preset's window (layers 0 and 2)
# Earlier chunks' keys come from the FP8 window cache: where float32 accumulation order moves a
# value across an e4m3 rounding boundary, logits move by up to ~1e-3 (tests/models/test_swa.py's
# INVARIANCE_TOL); reading outside the window moves them by > 1e-1.
TOL = 3e-3


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def ids_of(rng, n: int) -> list[int]:
    return [int(x) for x in rng.integers(2, 500, n)]


def check_free(llm: LLM) -> None:
    for pool in llm.engine.block_manager.pools.values():
        assert pool.num_free == pool.num_blocks


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("plp_full")), seed=6, swa_layers=[])


def test_prompt_logprobs_match_float64_reference(full_dir, rng):
    """Each prompt token's logprob, its rank and the top 3 alternatives, from a prefill chunked in
    steps of 16 tokens, equal the reference's log-softmax; the first entry is None."""
    ids = ids_of(rng, 70)
    llm = LLM(full_dir, block_size=16, max_num_batched_tokens=16)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    w, cfg = load_np(full_dir), json.load(open(f"{full_dir}/config.json"))
    logits = forward(w, cfg, ids)
    lsm = log_softmax(logits)
    assert out.prompt_logprobs[0] is None and out.prompt_ranks[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        entry, row = out.prompt_logprobs[p], lsm[p - 1]
        assert entry[ids[p]] == pytest.approx(row[ids[p]], abs=2e-5)
        assert out.prompt_ranks[p] == 1 + int((logits[p - 1] > logits[p - 1, ids[p]]).sum())
        top = np.argsort(-row)[:3]
        assert set(top) <= set(entry) and len(entry) <= 4
        for t in top:
            assert entry[int(t)] == pytest.approx(row[t], abs=2e-5)
    assert out.outputs[0].token_ids[0] == int(np.argmax(logits[-1]))
    check_free(llm)


def run(llm: LLM, prompts: list[list[int]], k: int | None):
    sp = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=k)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp)


@pytest.mark.parametrize("chunk", [W - 1, W, W + 1])
def test_prompt_logprobs_unchanged_by_chunks_cache_and_batching(tiny_model_dir, chunk, rng):
    """The hybrid model (SWA layers, W = 32), prompts >= 2W + a block: one-shot prefill alone is
    the baseline; chunked, batched with other prompts, and after the same prefix was cached, the
    prompt logprobs agree to TOL and the generated tokens are the same."""
    long = ids_of(rng, 2 * W + 16 + 5)
    other = ids_of(rng, W + 3)
    base = run(LLM(tiny_model_dir, block_size=16, max_num_batched_tokens=512), [long], 2)[0]
    llm = LLM(tiny_model_dir, block_size=16, max_num_batched_tokens=chunk, enable_prefix_caching=True)
    warm = run(llm, [long], None)[0]  # caches the prompt's blocks
    assert warm.prompt_logprobs is None and warm.outputs[0].token_ids == base.outputs[0].token_ids
    got = run(llm, [other, long], 2)
    check_free(llm)
    assert got[1].num_cached_tokens == 0  # it read no cached block
    for p in range(1, len(long)):
        a, b = got[1].prompt_logprobs[p], base.prompt_logprobs[p]
        assert a[long[p]] == pytest.approx(b[long[p]], abs=TOL)
        assert max(a.values()) == pytest.approx(max(b.values()), abs=TOL)  # the most likely token's
    assert got[1].outputs[0].token_ids == base.outputs[0].token_ids
    assert len(got[0].prompt_logprobs) == len(other) and all(e is not None for e in got[0].prompt_logprobs[1:])
    again = run(llm, [long], None)[0]  # its blocks were registered: a later request hits them
    assert again.num_cached_tokens >= 2 * W


def test_prompt_logprobs_survive_preemption(tiny_model_dir, rng):
    """A pool too small for every request at once preempts and recomputes: the prompt logprobs
    equal those of a run without preemption."""
    prompts = [ids_of(rng, 40 + 9 * i) for i in range(4)]
    sp = SamplingParams(max_tokens=24, temperature=0, prompt_logprobs=1, ignore_eos=True)
    base = LLM(tiny_model_dir, block_size=16).generate([{"prompt_token_ids": p} for p in prompts], sp)
    small = LLM(tiny_model_dir, block_size=16, num_gpu_blocks_override=12, max_model_len=160, max_num_batched_tokens=64)
    got = small.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert small.engine.num_preemptions > 0
    for g, b in zip(got, base, strict=True):
        assert g.outputs[0].token_ids == b.outputs[0].token_ids
        for t, x, y in zip(g.prompt_token_ids[1:], g.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x[t] == pytest.approx(y[t], abs=TOL)
            assert max(x.values()) == pytest.approx(max(y.values()), abs=TOL)
    check_free(small)


def test_prompt_logprobs_validation():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="^prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
