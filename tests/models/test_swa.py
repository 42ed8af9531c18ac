"""MLA_SWA: the SWA attention layer against float64 dense attention with a window mask over the
de-quantized cache, and model-level window behaviour (tiny checkpoints, block_size 16)."""

import json

import numpy as np
import paddle
import pytest
from model_harness import Harness, assert_close_with_routing_flips, position_errors, rel
from ref import dequant_records

from fastdeploy.config import KernelConfig
from fastdeploy.model_executor.layers.rotary_embedding import deepseek_softmax_scale
from fastdeploy.model_executor.models.deepseek_v3_reference import forward, load_np, rms, rope_angles, rotate_pairs
from fastdeploy.tools.make_tiny_model import make_tiny_model

BS = 16


def windows_of(d):
    cfg = json.load(open(f"{d}/config.json"))
    return cfg, [cfg["sliding_window"] if f else None for f in cfg["window_attn_skip_freq"]]


@pytest.fixture(scope="module")
def swa_dir(tmp_path_factory):  # layers 0, 2 SWA with W = 32; 1, 3 full; MoE from layer 1
    return make_tiny_model(str(tmp_path_factory.mktemp("swa")), seed=2)


@pytest.fixture(scope="module")
def swa_dense_dir(tmp_path_factory):
    """The same layout with dense MLPs. For step-shape invariance: with MoE, an ulp of batch-shape
    difference that crosses an e4m3 rounding boundary can flip a routing choice downstream, and
    one position's logits then move by ~0.3; that is MoE numerics, not the window."""
    return make_tiny_model(str(tmp_path_factory.mktemp("swa_dense")), seed=2, first_k_dense=4)


# ---------------------------------------------------------------- layer level


class LayerCase:
    """One attention layer of the tiny model (0: SWA, 1: full), fed random hidden states step by
    step, with ``kernels`` choosing the implementations and the prefill form."""

    def __init__(self, d, rng, layer=0, kernels=None):
        self.h = Harness(d, block_size=BS, num_blocks=64, kernels=kernels)
        self.layer = layer
        self.attn = self.h.model.model.layers[layer].self_attn
        self.cfg, windows = windows_of(d)
        self.W = windows[layer] or 10**9  # a full layer: no window
        self.group = "full" if windows[layer] is None else "swa"
        assert self.attn.is_swa == (windows[layer] is not None)
        prefix = f"model.layers.{layer}.self_attn."
        self.w = {k: v.astype(np.float64) for k, v in load_np(d).items() if k.startswith(prefix)}
        self.rng = rng
        self.hidden: dict[str, list[np.ndarray]] = {}

    def step(self, batch, decode=frozenset()):
        xs = [self.rng.standard_normal((n, self.cfg["hidden_size"])) for _, n in batch]
        for (rid, _), x in zip(batch, xs, strict=True):
            self.hidden.setdefault(rid, []).extend(list(x))
        meta = self.h.build_meta([(rid, [0] * n) for rid, n in batch], decode)
        x = np.concatenate(xs)
        with paddle.no_grad():
            out = self.attn(paddle.to_tensor(x, "float32"), self.h.caches[self.layer], meta).numpy()
        want = np.concatenate([self.reference(rid, n) for rid, n in batch])
        return out, want

    def reference(self, rid, n):
        """The last n tokens of rid: dense attention over the window, keys and values from the
        de-quantized cache records (or a full layer's float32 cache rows) at the request's slots
        (read with numpy)."""
        w, c = self.w, self.cfg
        a = f"model.layers.{self.layer}.self_attn."
        H, nope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"]
        L = self.h.lens[rid]
        x = np.array(self.hidden[rid][L - n :])
        q = rms(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], c["rms_norm_eps"])
        q = (q @ w[a + "q_b_proj.weight"].T).reshape(n, H, nope + 64)
        pos = np.arange(L - n, L)
        ang, mult = rope_angles(pos, 64, c["rope_theta"], c["rope_scaling"], c["max_position_embeddings"])
        q_pe = rotate_pairs(q[:, :, nope:], ang, mult)
        table = np.array(self.h.tables[self.group][rid])
        allpos = np.arange(L)
        slots = table[allpos // BS] * BS + allpos % BS
        cache = self.h.caches[self.layer].numpy()
        rows = cache.reshape(-1, cache.shape[-1])[slots]
        rec = dequant_records(rows) if cache.dtype == np.uint8 else rows.astype(np.float64)  # [L, 576]
        # the cache holds k_pe in the de-interleaved rotary layout; undo it to pair with q_pe
        k_pe = np.empty((L, 64))
        k_pe[:, 0::2], k_pe[:, 1::2] = rec[:, 512:544], rec[:, 544:]
        kvb = (rec[:, :512] @ w[a + "kv_b_proj.weight"].T).reshape(L, H, nope + v)
        scores = np.einsum("thd,shd->hts", q[:, :, :nope], kvb[:, :, :nope])
        scores += np.einsum("thd,sd->hts", q_pe, k_pe)
        scores *= deepseek_softmax_scale(nope + 64, c["rope_scaling"])
        visible = (allpos[None] <= pos[:, None]) & (allpos[None] > pos[:, None] - self.W)
        scores = np.where(visible[None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hts,shv->thv", p, kvb[:, :, nope:]).reshape(n, H * v)
        return o @ w[a + "o_proj.weight"].T


def check(out, want, tol=1e-4):
    assert np.isfinite(out).all()
    err = position_errors(out, want)
    assert err.max() < tol, err  # float32 model on the reference provider: measured ~1e-6


def test_layer_prefill_decode_mixed(swa_dir, rng):
    run_layer_steps(LayerCase(swa_dir, rng), check)


REFERENCE_MHA = KernelConfig(mla_prefill_form="mha")
KERNELS_MHA = KernelConfig(triton=True, sparse_mla_provider="triton", mla_prefill_form="mha")
KERNELS_ABSORBED = KernelConfig(triton=True, sparse_mla_provider="triton", mla_prefill_form="absorbed")


@pytest.mark.parametrize(
    "layer, kernels, tol",
    [
        (0, REFERENCE_MHA, 1e-4),  # SWA layer, every prefill in MHA form, float32 references
        (1, REFERENCE_MHA, 1e-4),  # full layer
        (1, KernelConfig(mla_prefill_form="absorbed"), 1e-4),
        (0, KERNELS_MHA, 3e-2),  # the GPU path through the interpreter: bf16 q, k, v
        (1, KERNELS_MHA, 3e-2),
        (1, KERNELS_ABSORBED, 3e-2),  # full layer, absorbed: the sparse kernel over the float32 cache
    ],
)
def test_layer_forms_match_float64(swa_dir, rng, layer, kernels, tol):
    """Both forms, both layer kinds, reference and kernel paths, against float64 attention over
    the same cache values: the same step gives the same output whichever form computed it."""
    run_layer_steps(LayerCase(swa_dir, rng, layer, kernels), lambda out, want: check(out, want, tol))


def run_layer_steps(lc, check):
    W = lc.cfg["sliding_window"]  # the SWA window; a full layer runs the same steps
    # prefill only: 2W + a block + 3 tokens (every position W-1, W, W+1 and block edges inside), and W + 1
    check(*lc.step([("a", 2 * W + BS + 3), ("b", W + 1), ("c", W - 2), ("d", BS - 1)]))
    # decode only: b at W+1, c at W-2 then W-1, d at BS-1 (a block edge), a deep past the window
    check(*lc.step([("a", 1), ("b", 1), ("c", 1), ("d", 1)], decode={"a", "b", "c", "d"}))
    check(*lc.step([("c", 1), ("d", 1)], decode={"c", "d"}))  # c at W, d at BS + 1
    # mixed: a new prefill, a chunked continuation of e (chunks below, equal to, above W), decodes
    check(*lc.step([("e", W - 5)]))
    check(*lc.step([("a", 1), ("e", W), ("f", 3 * W), ("c", 1)], decode={"a", "c"}))
    check(*lc.step([("e", W + 7), ("b", 1)], decode={"b"}))


# ---------------------------------------------------------------- model level


def tokens(rng, n):
    return [int(x) for x in rng.integers(0, 500, n)]


def test_model_matches_windowed_reference(swa_dir, rng):
    cfg, windows = windows_of(swa_dir)
    ids = tokens(rng, 3 * cfg["sliding_window"] + 5)
    got = Harness(swa_dir).prefill("a", ids)
    w = load_np(swa_dir)
    e = assert_close_with_routing_flips(got, forward(w, cfg, ids, windows, fp8_kv=True), 1e-2, 5e-2)
    exact = position_errors(got, forward(w, cfg, ids, windows))  # quantization included
    unwindowed = position_errors(got, forward(w, cfg, ids))  # what ignoring the window would give
    assert np.median(unwindowed[-cfg["sliding_window"] :]) > 10 * np.median(e[-cfg["sliding_window"] :])
    assert np.median(exact) < 0.2  # the FP8 cache's own error on this untrained model: a few %


@pytest.fixture(scope="module")
def all_swa_dir(tmp_path_factory):
    # dense MLPs only: MoE batches couple tokens numerically (which tokens share an expert matmul)
    d = str(tmp_path_factory.mktemp("allswa"))
    return make_tiny_model(d, seed=3, sliding_window=8, swa_layers=list(range(4)), first_k_dense=4)


def test_receptive_field_is_layers_times_window(all_swa_dir, rng):
    """Every layer SWA, W = 8, 4 layers: the last token sees back exactly 4 * (W - 1) positions.
    Dense MLPs, so a token outside the reach reaches no value the last token's computation reads."""
    reach = 4 * (8 - 1)
    ids = tokens(rng, reach + 12)
    last = len(ids) - 1
    base = Harness(all_swa_dir).prefill("a", ids)[-1]

    def moved(dist):
        m = list(ids)
        m[last - dist] = (ids[last - dist] + 1) % 500
        return rel(Harness(all_swa_dir).prefill("a", m)[-1], base)

    assert max(moved(reach + k) for k in (1, 2, 3)) < 1e-6
    assert moved(reach) > 1e-4
    assert moved(reach - 4) > 1e-4


# Batch shape changes float32 accumulation order by an ulp; where that moves a latent value across
# an e4m3 rounding boundary, one cached element moves by up to 1/16 of its scale, which reaches the
# logits at ~1e-3. A window error moves them by > 1e-1.
INVARIANCE_TOL = 3e-3


FORMS = {"absorbed": KernelConfig(mla_prefill_form="absorbed"), "mha": KernelConfig(mla_prefill_form="mha")}


@pytest.mark.parametrize("form", FORMS)
def test_prefill_then_decode_past_2w_equals_one_shot(swa_dense_dir, form, rng):
    """Prefill in ``form``, then absorbed decodes, against a one-shot prefill in ``form``."""
    W = windows_of(swa_dense_dir)[0]["sliding_window"]
    ids = tokens(rng, 2 * W + BS + 5)
    one = Harness(swa_dense_dir, seed=1, kernels=FORMS[form]).prefill("a", ids)
    h = Harness(swa_dense_dir, seed=2, kernels=FORMS[form])
    h.prefill("a", ids[: W - 3])
    got = [h.step([("a", [t])], decode={"a"})["a"][0] for t in ids[W - 3 :]]
    assert (
        position_errors(np.array(got), one[W - 3 :]).max() < INVARIANCE_TOL
    )  # bf16 q / output rounding; a window error is > 1e-1


@pytest.mark.parametrize("chunk", [7, 32, 45])  # below, equal to and above W = 32
def test_chunked_prefill_equals_one_shot(swa_dense_dir, chunk, rng):
    """Chunked in MHA form against one shot in absorbed form, and the other way round."""
    ids = tokens(rng, 100)
    for one_form, chunk_form in (("absorbed", "mha"), ("mha", "absorbed")):
        one = Harness(swa_dense_dir, seed=3, kernels=FORMS[one_form]).prefill("a", ids)
        got = Harness(swa_dense_dir, seed=4, kernels=FORMS[chunk_form]).prefill("a", ids, chunk=chunk)
        assert position_errors(got, one).max() < INVARIANCE_TOL


@pytest.mark.parametrize("prefix", [16, 32, 48])  # shorter than, equal to and longer than W = 32
def test_prefix_hit_equals_alone(swa_dense_dir, prefix, rng):
    """b reuses a's first `prefix` cached tokens (whole blocks) and computes only its own suffix
    (in MHA form over the reused keys in view)."""
    shared = tokens(rng, prefix)
    a = shared + tokens(rng, 20)
    b = shared + tokens(rng, 40)
    alone = Harness(swa_dense_dir, seed=5).prefill("b", b)
    h = Harness(swa_dense_dir, seed=6, kernels=FORMS["mha"])
    h.prefill("a", a)
    h.share_prefix("a", "b", prefix)
    got = h.step([("b", b[prefix:])])["b"]
    assert position_errors(got, alone[prefix:]).max() < INVARIANCE_TOL


@pytest.mark.parametrize("form", ["absorbed", "mha"])
def test_gpu_kernel_path_matches_reference_path(swa_dense_dir, form, rng):
    """The path a CUDA paddle takes (Triton FP8 writer, Triton indexer, Triton sparse attention
    with bf16 q, full layers on the sparse kernel over their whole context, prefill in ``form``
    through the MHA kernel), run through the interpreter, against the CPU reference path."""
    ids = tokens(rng, 2 * 32 + 16 + 3)
    want = Harness(swa_dense_dir, seed=7).prefill("a", ids, chunk=40)
    gpu_path = KernelConfig(triton=True, sparse_mla_provider="triton", mla_prefill_form=form)
    got = Harness(swa_dense_dir, seed=8, kernels=gpu_path).prefill("a", ids, chunk=40)
    err = position_errors(got, want)
    assert np.isfinite(got).all() and err.max() < 3e-2  # bf16 q and output here (~1e-2); a window error > 1e-1
