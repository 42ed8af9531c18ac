"""Expert parallelism's dispatch and combine (``layers/moe_dispatch.py``) over gloo: three ranks,
each with its own tokens (one with none, as an idle data-parallel rank's dummy step) and a third
of the routed experts, against the float64 MoE over all experts for each rank's tokens. Every
process is bounded in time and none is left behind."""

import json
import os
import subprocess
import sys

import numpy as np
from ref import moe_route_ref

from fastdeploy.distributed.parallel import free_port, rank_env

RANK = """
import json, sys
import numpy as np, paddle
import paddle.distributed as dist
from fastdeploy.config import ModelConfig
from fastdeploy.distributed.parallel import TPGroup
from fastdeploy.model_executor.layers.moe import DeepseekV3MoE
from fastdeploy.model_executor.layers.moe_dispatch import AllGatherDispatch

a = json.loads(sys.argv[1])
dist.init_parallel_env()
ep = TPGroup(dist.get_rank(), dist.get_world_size())
moe = DeepseekV3MoE(ModelConfig.from_dict(a["cfg"]), TPGroup(), "float32", dispatch=AllGatherDispatch(ep))
w = np.load(a["weights"])
lo, hi = moe.expert_range
for name, p in moe.named_parameters():
    p.set_value(paddle.to_tensor(w[name][lo:hi] if name in ("w1", "w2", "w3") else w[name]))
outs = [moe(paddle.to_tensor(x)).numpy() for x in np.load(a["x"])[f"r{ep.rank}"]]  # two calls: in step
np.save(a["out"] + f"{ep.rank}.npy", np.stack(outs))
"""

CFG = {
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "n_routed_experts": 6,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_hidden_layers": 1,
}


def silu(v):
    return v / (1 + np.exp(-v))


def moe_f64(x, w):
    """The whole MoE block in float64: sigmoid routing over all experts, then the shared expert."""
    ids, wts = moe_route_ref(x @ w["gate.weight"].T, w["gate.e_score_correction_bias"], 2, 1, 2, True, 2.5)
    y = np.zeros_like(x)
    for t in range(len(x)):
        for e, g in zip(ids[t], wts[t], strict=True):
            y[t] += g * ((silu(x[t] @ w["w1"][e].T) * (x[t] @ w["w3"][e].T)) @ w["w2"][e].T)
    s = "shared_experts."
    shared = silu(x @ w[s + "gate_proj.weight"].T) * (x @ w[s + "up_proj.weight"].T)
    return y + shared @ w[s + "down_proj.weight"].T


def test_three_ranks_of_experts_give_each_rank_its_tokens_moe(tmp_path, rng):
    H, inter, E = 64, 32, 6
    w = {
        "gate.weight": rng.standard_normal((E, H)) * 0.3,
        "gate.e_score_correction_bias": rng.standard_normal(E) * 0.1,
        "w1": rng.standard_normal((E, inter, H)) / 8,
        "w3": rng.standard_normal((E, inter, H)) / 8,
        "w2": rng.standard_normal((E, H, inter)) / 6,
        "shared_experts.gate_proj.weight": rng.standard_normal((inter, H)) / 8,
        "shared_experts.up_proj.weight": rng.standard_normal((inter, H)) / 8,
        "shared_experts.down_proj.weight": rng.standard_normal((H, inter)) / 6,
    }
    w = {k: v.astype(np.float32) for k, v in w.items()}
    counts = [4, 0, 7]  # rank 1 idle: it still joins every collective
    xs = {f"r{r}": rng.standard_normal((2, n, H)).astype(np.float32) for r, n in enumerate(counts)}
    np.savez(tmp_path / "w.npz", **w)
    np.savez(tmp_path / "x.npz", **xs)
    arg = json.dumps(
        {"cfg": CFG, "weights": str(tmp_path / "w.npz"), "x": str(tmp_path / "x.npz"), "out": str(tmp_path / "out")}
    )
    endpoints = [f"127.0.0.1:{free_port()}" for _ in counts]
    master = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, arg],
            env={**os.environ, **rank_env(r, len(counts), endpoints, master)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(len(counts))
    ]
    try:
        logs = [p.communicate(timeout=120)[0].decode()[-2000:] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), logs
    w64 = {k: v.astype(np.float64) for k, v in w.items()}
    for r, n in enumerate(counts):
        got = np.load(tmp_path / f"out{r}.npy")
        assert got.shape == (2, n, H)
        for call in range(2):
            want = moe_f64(xs[f"r{r}"][call].astype(np.float64), w64)
            np.testing.assert_allclose(got[call], want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want).max(initial=0)))


def test_one_rank_dispatch_is_the_plain_moe(rng):
    """In one process (an EP group of one rank): the MoE through prepare / finalize equals the MoE
    without them on the same weights, and a rank with no tokens gets a [0, hidden] result."""
    import paddle

    from fastdeploy.config import ModelConfig
    from fastdeploy.distributed.parallel import TPGroup
    from fastdeploy.model_executor.layers.moe import DeepseekV3MoE
    from fastdeploy.model_executor.layers.moe_dispatch import AllGatherDispatch

    cfg = ModelConfig.from_dict(CFG)
    plain = DeepseekV3MoE(cfg, TPGroup(), "float32")
    ep = DeepseekV3MoE(cfg, TPGroup(), "float32", dispatch=AllGatherDispatch(TPGroup()))
    for (_, p), (_, q) in zip(plain.named_parameters(), ep.named_parameters(), strict=True):
        p.set_value(paddle.to_tensor(rng.standard_normal(p.shape).astype(np.float32) * 0.2))
        q.set_value(p)
    x = paddle.to_tensor(rng.standard_normal((5, CFG["hidden_size"])).astype(np.float32))
    np.testing.assert_allclose(ep(x).numpy(), plain(x).numpy(), rtol=1e-6, atol=1e-6)
    assert ep(x[:0]).shape == [0, CFG["hidden_size"]]
