"""lm-evaluation-harness against the live server (its ``local-completions`` model with the
server's own tokenizer through /tokenize): a multiple-choice task (echo, logprobs, prompt logprobs
of token prompts) and a generation task, both kept as local files. Its log-likelihoods are checked
against the float64 reference model."""

import json
import os

import numpy as np
import pytest
from live_server import LiveServer

from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.model_executor.models.deepseek_v3_reference import forward, load_np
from fastdeploy.tools.make_tiny_model import make_tiny_model

QUESTIONS = [
    ("The sky is", ["blue", "green", "made of cheese and a very long answer"], 0),
    ("One plus one is", ["two", "three"], 1),
    ("DeepSeek reads", ["tokens", "sliding windows of text", "nothing"], 2),
    ("Q: capital of France? A:", ["Paris", "Rome", "Berlin", "Madrid"], 0),
]
GEN = [("Count: 1 2 3", " 4"), ("Say hi:", " hi"), ("a b c", " d")]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = make_tiny_model(str(tmp_path_factory.mktemp("lm_eval_model")), seed=4, swa_layers=[])
    # small chunks and blocks, prefix caching on: continuations of one context share its blocks
    args = EngineArgs(model=d, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=True)
    srv = LiveServer(AsyncLLMEngine(LLMEngine(args)))
    yield srv, d
    srv.close()


def write_tasks(root) -> str:
    data = root / "data"
    data.mkdir()
    with open(data / "mc.jsonl", "w") as f:
        for q, choices, label in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "label": label}) + "\n")
    with open(data / "gen.jsonl", "w") as f:
        for q, a in GEN:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: '{{question}}'\nnum_fewshot: 0\n"
    (root / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {data / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    (root / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {data / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return str(root)


def test_lm_eval_harness_against_the_server(served, tmp_path, monkeypatch):
    srv, model_dir = served
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "HF_EVALUATE_OFFLINE"):
        monkeypatch.setenv(k, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=write_tasks(tmp_path), include_defaults=False)
    res = simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{srv.base}/v1/completions",
            "model": "tiny-mla-swa",
            "tokenizer_backend": "remote",
            "num_concurrent": 1,
            "max_retries": 1,
            "timeout": 120,
        },
        tasks=["tiny_mc", "tiny_gen"],
        task_manager=tm,
        log_samples=True,
        bootstrap_iters=0,
    )
    w, cfg = load_np(model_dir), json.load(open(os.path.join(model_dir, "config.json")))
    tok = srv.engine.engine.tokenizer
    samples = res["samples"]["tiny_mc"]
    assert len(samples) == len(QUESTIONS)
    correct = 0
    for s in samples:
        got = [r[0] for r in s["resps"]]  # (log-likelihood, is_greedy) per choice
        want = []
        for context, continuation in s["arguments"]:  # the harness's split of the pair
            n = len(context) - len(context.rstrip())
            context, continuation = context[: len(context) - n], context[len(context) - n :] + continuation
            ctx = tok.encode(context, add_special_tokens=False)
            ids = tok.encode(context + continuation, add_special_tokens=False)
            lsm = log_softmax(forward(w, cfg, ids))
            span = range(len(ctx), len(ids))
            lls = [lsm[p - 1, ids[p]] for p in span]
            want.append((float(np.sum(lls)), all(np.argmax(lsm[p - 1]) == ids[p] for p in span)))
        for (g_ll, g_greedy), (w_ll, w_greedy) in zip(got, want, strict=True):
            assert abs(g_ll - w_ll) < 1e-4 * max(1.0, abs(w_ll))
            assert g_greedy == w_greedy
        correct += int(np.argmax([x[0] for x in want]) == s["doc"]["label"])
    assert res["results"]["tiny_mc"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))
    gen = res["samples"]["tiny_gen"]
    assert len(gen) == len(GEN)
    for s in gen:  # greedy, at most 6 tokens, cut at the first newline or EOS
        ids = tok.encode(s["arguments"][0][0], add_special_tokens=False)
        out = []
        while len(out) < 6 and (not out or out[-1] != tok.eos_token_id):
            out.append(int(np.argmax(forward(w, cfg, ids + out)[-1])))
        assert s["resps"][0][0] == tok.decode(out).split("\n")[0]
    idle = srv.engine.engine.block_manager
    for pool in idle.pools.values():
        assert pool.num_free == pool.num_blocks
