"""Fit a tiny checkpoint's MTP layer to the tiny model's own greedy continuations, so that draft
acceptance means something on a random model (``make_tiny_model --mtp`` runs it).

A short, seeded, deterministic CPU fit (docs/design.md §4.16):
1. the engine (speculation off) continues seeded random prompts greedily;
2. the MTP layer starts as a copy of the target's layer 0 (same window, same MoE) reading only
   the next token's embedding (eh_proj = [I 0], enorm = hnorm = 1), with the target's final norm
   as shared_head.norm: over tokens 1..t+1 at positions 0..t it computes what the target's layer 0
   computes at t + 1 (rotary and windows see only relative positions), and the target's upper
   layers are damped (``tiny_checkpoint.MTP_UPPER_BRANCH_SCALE``);
3. eh_proj is then re-solved by ridge least squares from [enorm(embed(t + 1)), hnorm(H_t)] (H the
   target's final-normed hidden states, from the float64 reference) to the target's final
   residual at t + 1 minus what the layer adds, ``REFITS`` times; kept only if it raises the
   acceptance on the fit sequences;
4. the first draft's acceptance (its arg-max equals the target's next greedy token) on held-out
   continuations, with the weights as stored, goes to ``mtp_fit.json`` beside the checkpoint.
"""

from __future__ import annotations

import json
import os

import numpy as np

from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.model_executor.models import deepseek_v3_reference as ref
from fastdeploy.sampling_params import SamplingParams
from fastdeploy.tools.tiny_checkpoint import tiny_weights, write_safetensors

REFITS = 2
RIDGE = 1e-2
FIT_FILE = "mtp_fit.json"
PROMPT_TOKENS = (4, 256)  # prompt token ids are drawn from this range (the tokenizer's byte-level part)


def greedy_sequences(model_dir: str, seed: int, n: int, prompt_len: int, gen_len: int) -> list[list[int]]:
    """n seeded random prompts of ``prompt_len`` tokens, each with ``gen_len`` greedy tokens after it."""
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(*PROMPT_TOKENS, prompt_len)]} for _ in range(n)]
    eng = LLMEngine(EngineArgs(model=model_dir, max_num_seqs=n, block_size=16))
    sp = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    try:
        reqs = [eng.add_request(p["prompt_token_ids"], sp, f"fit{i}") for i, p in enumerate(prompts)]
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        eng.shutdown()
    return [r.prompt_token_ids + r.output_token_ids for r in reqs]


class _Data:
    """One sequence's fit inputs: features Z [T-1, 2h] at positions 0..T-2, the target's final
    residual Y [T-1, h] at positions 1..T-1, the next tokens and the hidden states H [T-1, h]."""

    def __init__(self, w: dict, cfg: dict, seq: list[int], windows: list, mtp_prefix: str) -> None:
        L, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
        x = w["model.embed_tokens.weight"][seq]
        for layer in range(L):
            x = ref.decoder_layer(x, w, cfg, layer, windows[layer], "fp8" if windows[layer] else None)
        H = ref.rms(x, w["model.norm.weight"], eps)
        self.next_ids, self.hidden, self.Y = seq[1:], H[:-1], x[1:]
        self.e = w["model.embed_tokens.weight"][seq[1:]]

    def features(self, w: dict, p: str, eps: float) -> np.ndarray:
        return np.concatenate(
            [ref.rms(self.e, w[p + "enorm.weight"], eps), ref.rms(self.hidden, w[p + "hnorm.weight"], eps)], -1
        )


def fit_mtp(
    model_dir: str, seed: int = 0, n_fit: int = 24, n_test: int = 8, prompt_len: int = 16, gen_len: int = 80
) -> dict:
    """Fit the MTP layer of the tiny checkpoint in ``model_dir`` (written by ``make_tiny_model``
    with ``seed``) in place; returns what it writes to ``mtp_fit.json``."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    L, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    if not cfg.get("num_nextn_predict_layers"):
        raise ValueError(f"{model_dir}: the checkpoint has no MTP layer (num_nextn_predict_layers is 0)")
    flags = cfg["window_attn_skip_freq"]
    windows = [cfg["sliding_window"] if f else None for f in flags]
    moe = [cfg["n_routed_experts"] and i >= cfg["first_k_dense_replace"] for i in range(L + 1)]
    if windows[0] != windows[L] or moe[0] != moe[L]:
        raise ValueError(
            "the MTP fit copies layer 0 into the MTP layer: both must be SWA or full, and both MoE (first_k_dense 0) "
            "or both dense"
        )
    seqs = greedy_sequences(model_dir, seed, n_fit + n_test, prompt_len, gen_len)
    w = ref.load_np(model_dir)
    p = f"model.layers.{L}."
    for k in [k for k in w if k.startswith("model.layers.0.")]:
        w[p + k[len("model.layers.0.") :]] = w[k].copy()
    h = cfg["hidden_size"]
    w[p + "enorm.weight"], w[p + "hnorm.weight"] = np.ones(h), np.ones(h)
    w[p + "eh_proj.weight"] = np.concatenate([np.eye(h), np.zeros((h, h))], 1)
    w[p + "shared_head.norm.weight"] = w["model.norm.weight"].copy()
    data = [_Data(w, cfg, s, windows, p) for s in seqs]
    fit, test = data[:n_fit], data[n_fit:]

    def acceptance(part: list[_Data]) -> float:
        hit = total = 0
        for d in part:
            logits = ref.mtp(w, cfg, d.next_ids, d.hidden, windows[L], "fp8" if windows[L] else None)
            draft = logits.argmax(-1)[prompt_len - 1 : -1]  # the drafts of generated tokens
            hit += int((draft == np.asarray(d.next_ids[prompt_len:])).sum())
            total += len(draft)
        return hit / total

    copied = acceptance(fit)
    Z = np.concatenate([d.features(w, p, eps) for d in fit])
    Y = np.concatenate([d.Y for d in fit])
    eh = w[p + "eh_proj.weight"]
    for _ in range(REFITS):  # what the layer adds at the current eh_proj, then eh_proj against the rest
        X = Z @ w[p + "eh_proj.weight"].T
        added, at = [], 0
        for d in fit:
            n = len(d.next_ids)
            added.append(ref.decoder_layer(X[at : at + n], w, cfg, L, windows[L], "fp8" if windows[L] else None))
            at += n
        delta = np.concatenate(added) - X
        A = Z.T @ Z + RIDGE * len(Z) * np.eye(Z.shape[1])
        w[p + "eh_proj.weight"] = np.linalg.solve(A, Z.T @ (Y - delta)).T
    refit = acceptance(fit)
    if refit <= copied:
        w[p + "eh_proj.weight"] = eh
    weights = tiny_weights(cfg, seed)  # the checkpoint's float32 tensors, regenerated from its seed
    for k in [k for k in w if k.startswith(p)]:
        weights[k] = w[k].astype(np.float32)
    write_safetensors(
        os.path.join(model_dir, "model.safetensors"), weights, fp8=cfg.get("quantization_config") is not None
    )
    w.update(ref.load_np(model_dir))  # as stored (bf16 or FP8)
    result = {
        "seed": seed,
        "sequences": {"fit": n_fit, "held_out": n_test, "prompt_len": prompt_len, "gen_len": gen_len},
        "acceptance_fit_copied_layer": copied,
        "acceptance_fit_least_squares": refit,
        "least_squares_kept": refit > copied,
        "acceptance_held_out": acceptance(test),
    }
    with open(os.path.join(model_dir, FIT_FILE), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, sort_keys=True)
    return result
