"""The MTP module (docs/design.md §4.16) against DeepSeek-V3's MTP formula in float64, as an SWA
layer and as a full layer, over windows crossed and in chunks; and its checkpoint errors."""

import json
import os

import numpy as np
import paddle
import pytest
from model_harness import Harness, assert_close_with_routing_flips

from fastdeploy import LLM
from fastdeploy.model_executor.load_weight_utils import CheckpointError
from fastdeploy.model_executor.models import deepseek_v3_reference as ref
from fastdeploy.model_executor.safetensors_io import SafeTensorsFile, save_file
from fastdeploy.tools.make_tiny_model import make_tiny_model

W, BS = 32, 16


@pytest.fixture(scope="module", params=["swa", "full"])
def mtp_dir(request, tmp_path_factory):
    swa = [0, 2, 4] if request.param == "swa" else [0, 2]  # layer 4 is the MTP layer
    d = make_tiny_model(str(tmp_path_factory.mktemp("mtp")), seed=3, sliding_window=W, swa_layers=swa, mtp=True)
    return d, request.param


def run_mtp(h: Harness, ids: list[int], hidden: np.ndarray, chunk: int, decode_from: int) -> np.ndarray:
    """The MTP layer over positions 0..T-1 (row t reads ids[t + 1] and hidden[t]): prefill chunks
    of ``chunk`` up to ``decode_from``, then one-token decodes; logits float64 [T - 1, vocab]."""
    L, out, t = h.cfg.num_hidden_layers, [], 0
    T = len(ids) - 1
    while t < T:
        n = min(chunk, decode_from - t, T - t) if t < decode_from else 1
        meta = h.build_meta([("a", ids[t : t + n])], decode={"a"} if t >= decode_from else set())
        x = h.mtp(
            paddle.to_tensor(ids[t + 1 : t + n + 1]), paddle.to_tensor(hidden[t : t + n], "float32"), meta, h.caches[L]
        )
        out.append(h.mtp.compute_logits(x, paddle.arange(n)).numpy().astype(np.float64))
        t += n
    return np.concatenate(out)


@pytest.mark.parametrize("chunk, decode_from", [(100, 100), (W - 7, 60), (W, 48), (W + 9, 90)])
def test_mtp_matches_float64_formula(mtp_dir, chunk, decode_from, rng):
    """Sequences of 2W + a block and more; chunks below, equal to and above W; decodes after."""
    d, kind = mtp_dir
    w, cfg = ref.load_np(d), json.load(open(os.path.join(d, "config.json")))
    ids = [int(x) for x in rng.integers(0, 500, 2 * W + BS + 13)]
    L = cfg["num_hidden_layers"]
    windows = [W if f else None for f in cfg["window_attn_skip_freq"]]
    H = ref.forward(w, cfg, ids, windows[:L], kv_formats=["fp8" if x else None for x in windows[:L]], hidden=True)
    want = ref.mtp(w, cfg, ids[1:], H[:-1], windows[L], "fp8" if windows[L] else None)
    h = Harness(d, mtp=True, seed=int(rng.integers(1 << 30)))
    got = run_mtp(h, ids, H.astype(np.float32), chunk, decode_from)
    assert got.shape == want.shape
    assert_close_with_routing_flips(got, want, 1e-3 if kind == "full" else 1e-2, 5e-2)
    # the arg-max (the draft) agrees wherever the reference's top two are not near-tied
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-2 * np.abs(top2).max()
    assert (got.argmax(1) == want.argmax(1))[clear].mean() > 0.97


def test_missing_or_misshapen_mtp_tensors_name_the_tensor(tmp_path):
    d = make_tiny_model(str(tmp_path / "m"), seed=4, mtp=True)
    cfg = json.load(open(os.path.join(d, "config.json")))
    L = cfg["num_hidden_layers"]
    path = os.path.join(d, "model.safetensors")
    f = SafeTensorsFile(path)
    tensors = {k: (f.dtype(k), f.get(k)) for k in f.keys()}

    spec = '{"method": "mtp", "num_speculative_tokens": 1}'
    name = f"model.layers.{L}.eh_proj.weight"
    save_file(path, {**tensors, name: (tensors[name][0], tensors[name][1][:, :-1])})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + ".*shape"):
        LLM(d, speculative_config=spec)
    save_file(path, {k: v for k, v in tensors.items() if not k.startswith(f"model.layers.{L}.")})
    with pytest.raises(CheckpointError, match=rf"model\.layers\.{L}\..*missing|missing.*model\.layers\.{L}\."):
        LLM(d, speculative_config=spec)
    LLM(d)  # the target alone loads without it
    cfg["num_nextn_predict_layers"] = 0
    cfg["window_attn_skip_freq"] = cfg["window_attn_skip_freq"][:L]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        LLM(d, speculative_config=spec)
