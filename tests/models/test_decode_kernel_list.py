"""benchmarks/bench_decode_step.py times a decoder layer's decode step as the kernel lists of
``model_executor/decode_kernels.py``; this records the kernels the tiny FP8 model really launches
in a decode step (through the interpreter) and checks them against those lists, so the benchmark
cannot drift from the model."""

import sys

from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor import decode_kernels as bench
from fastdeploy.model_executor.ops.triton_ops import launcher
from fastdeploy.tools.make_tiny_model import make_tiny_model


def test_the_benchmark_launches_what_the_model_launches(tmp_path, monkeypatch):
    model_dir = make_tiny_model(str(tmp_path / "fp8"), fp8=True)
    llm = LLM(model_dir, kernel_backend="triton", cuda_graph_batch_sizes="")
    eng = llm.engine
    launched = []
    inner = launcher.launch

    def record(kernel, grid, *args, **meta):
        launched.append(kernel.fn.__name__)
        return inner(kernel, grid, *args, **meta)

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("fastdeploy.") and getattr(mod, "launch", None) is inner:
            monkeypatch.setattr(mod, "launch", record)
    eng.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    eng.step()  # the prefill
    launched.clear()
    eng.step()  # a decode step
    cfg = eng.config.model_config
    want = list(bench.STEP_START)
    for i, swa in enumerate(cfg.window_attn_skip_freq[: cfg.num_hidden_layers]):
        want += bench.attn_kernels(1, bool(swa)) + bench.mlp_kernels(1, i >= cfg.first_k_dense_replace)
    want += bench.STEP_END
    assert [k for k in launched if k != "_combine_kernel"] == want
    assert sum(cfg.window_attn_skip_freq) and cfg.first_k_dense_replace < cfg.num_hidden_layers
