"""Small random DeepSeek-V3 MLA_SWA checkpoints (config, safetensors, BPE tokenizer), and the
``tiny-mla-swa`` preset that ``--model`` accepts (``resolve_model`` builds it once into a cache
folder). Same arguments, same bytes. The command line is ``fastdeploy.tools.make_tiny_model``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import numpy as np

from fastdeploy.input.tokenizer import THINK_END, THINK_START, TOOL_TOKENS
from fastdeploy.model_executor.ops.fp8_numerics import quantize_fp8_blocks
from fastdeploy.model_executor.safetensors_io import save_file

TINY_PRESET = "tiny-mla-swa"
# With an MTP layer, the residual branches (o_proj, down_proj) of the layers above the first are
# scaled by this: the random model's greedy path is otherwise chaotic (each of its 4 layers
# changes the arg-max: 4 / 6 / 16 / 36 / 100 % agreement after layers 0..4), and no one-layer
# draft follows it (a least-squares draft reached 5 % held-out acceptance). docs/design.md §4.16.
MTP_UPPER_BRANCH_SCALE = 0.15
PRESET_VERSION = 3

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
# DeepSeek-V3(-0324)'s chat template for messages, assistant tool_calls and tool results; the
# tools themselves go into the system prompt (the official template leaves that to the caller;
# this is the "## Tools" block DeepSeek's later templates write).
CHAT_TEMPLATE = (
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', "
    "is_first_sp=true) %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}"
    "{% else %}{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if tools %}{% set ns.system_prompt = ns.system_prompt + ('\n\n' if ns.system_prompt else '') + "
    "'## Tools\nYou have access to the following tools:\n' %}"
    "{% for tool in tools %}{% set ns.system_prompt = ns.system_prompt + '\n### ' + tool['function']['name'] + "
    "'\nDescription: ' + (tool['function'].get('description') or '') + '\n\nParameters: ' + "
    "(tool['function'].get('parameters', {}) | tojson) + '\n' %}{% endfor %}{% endif %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{% set ns.is_tool = false %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{% if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}"
    "{% set ns.is_first = false %}{% set ns.is_tool = false %}{% set ns.is_output_first = true %}"
    "{% for tool in message.get('tool_calls') %}"
    "{% if not ns.is_first %}{{ '<｜Assistant｜>' + (message['content'] or '') + '<｜tool▁calls▁begin｜>' }}"
    "{% set ns.is_first = true %}{% else %}{{ '\n' }}{% endif %}"
    "{{ '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + "
    "'\n```json\n' + tool['function']['arguments'] + '\n```<｜tool▁call▁end｜>' }}"
    "{% endfor %}{{ '<｜tool▁calls▁end｜>' + eos_token }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' + (message['content'] or '') + eos_token }}"
    "{% set ns.is_tool = false %}"
    "{% else %}{{ '<｜Assistant｜>' + (message['content'] or '') + eos_token }}{% endif %}"
    "{% elif message['role'] == 'tool' %}{% set ns.is_tool = true %}"
    "{% if ns.is_output_first %}{{ '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + "
    "'<｜tool▁output▁end｜>' }}{% set ns.is_output_first = false %}"
    "{% else %}{{ '\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{ '<｜Assistant｜>' }}{% endif %}"
)

_CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Sliding-window attention lets each token see only the most recent tokens of its context.",
    "DeepSeek-V3 compresses keys and values into a 512-wide latent vector with a 64-wide rotary part.",
    "A serving engine batches requests, caches their keys and values in blocks, and streams tokens back.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Once upon a time there was a tiny model that could count: one, two, three, four, five.",
    "The cache stores 656 bytes a token: 512 e4m3 values, 4 float32 scales and 64 bf16 values.",
]


def tiny_config(
    num_layers: int = 4,
    sliding_window: int = 32,
    swa_layers: list[int] | None = None,
    first_k_dense: int = 1,
    mtp: bool = False,
    dsa_layers: list[int] | None = None,
    index_topk: int = 16,
) -> dict:
    """The tiny checkpoint's config.json. Default SWA layers: the even ones (both kinds present),
    the MTP layer (id ``num_layers``, with ``mtp``) included, unless ``dsa_layers`` are given
    (DeepSeek-V3.2's indexed layers: then none by default). Every layer indexed is DeepSeek-V3.2's
    own config (``model_type`` deepseek_v32); a mix is spelled in HF's ``layer_types``."""
    dsa = sorted(dsa_layers or [])
    if swa_layers is None:
        swa_layers = [] if dsa else [i for i in range(num_layers + int(mtp)) if i % 2 == 0]
    if set(dsa) & set(swa_layers) or not all(0 <= i < num_layers for i in dsa):  # decoder layers only
        raise ValueError(f"DSA layers {dsa} must be layer ids in 0..{num_layers - 1} and not SWA layers {swa_layers}")
    cfg = _v3_config(num_layers, sliding_window, swa_layers, first_k_dense, mtp)
    if dsa:
        kinds = {**{i: "sliding_attention" for i in swa_layers}, **{i: "indexed_attention" for i in dsa}}
        cfg["layer_types"] = [kinds.get(i, "full_attention") for i in range(num_layers)]
        # 16 heads: a key scores exactly 0 (a tie) only when all 16 relu terms are 0
        cfg.update(index_topk=index_topk, index_n_heads=16, index_head_dim=128)
        if len(dsa) == num_layers:
            cfg.update(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"])
    return cfg


def _v3_config(num_layers: int, sliding_window: int, swa_layers: list[int], first_k_dense: int, mtp: bool) -> dict:
    n = num_layers + int(mtp)
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": first_k_dense,
        "moe_layer_freq": 1,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "sliding_window": sliding_window,
        "num_nextn_predict_layers": int(mtp),
        "window_attn_skip_freq": [1 if i in swa_layers else 0 for i in range(n)],
    }


def tiny_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights under DeepSeek-V3's tensor names and shapes."""
    rng = np.random.default_rng(seed)
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    out: dict[str, np.ndarray] = {}

    def lin(name: str, rows: int, cols: int) -> None:
        out[name] = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(name: str, n: int) -> None:
        out[name] = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    out["model.embed_tokens.weight"] = rng.standard_normal((cfg["vocab_size"], h)).astype(np.float32)
    n_main = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types") or []
    indexed = {i for i, kind in enumerate(kinds) if kind == "indexed_attention"}
    if cfg.get("model_type") == "deepseek_v32":  # its MTP layer is indexed too, as DeepSeek-V3.2 ships
        indexed |= set(range(len(kinds), n_main + cfg.get("num_nextn_predict_layers", 0)))
    for i in [*range(n_main), "norm", *range(n_main, n_main + cfg.get("num_nextn_predict_layers", 0))]:
        if i == "norm":  # the target's head before the MTP layer: the same target with or without it
            norm("model.norm.weight", h)
            lin("lm_head.weight", cfg["vocab_size"], h)
            continue
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight", h)
        norm(p + "post_attention_layernorm.weight", h)
        a = p + "self_attn."
        if cfg["q_lora_rank"]:
            lin(a + "q_a_proj.weight", cfg["q_lora_rank"], h)
            norm(a + "q_a_layernorm.weight", cfg["q_lora_rank"])
            lin(a + "q_b_proj.weight", nh * qk, cfg["q_lora_rank"])
        else:
            lin(a + "q_proj.weight", nh * qk, h)
        lin(a + "kv_a_proj_with_mqa.weight", cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h)
        norm(a + "kv_a_layernorm.weight", cfg["kv_lora_rank"])
        lin(a + "kv_b_proj.weight", nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"])
        lin(a + "o_proj.weight", h, nh * cfg["v_head_dim"])
        if i in indexed:
            x = a + "indexer."  # DeepSeek-V3.2's lightning indexer
            lin(x + "wq_b.weight", cfg["index_n_heads"] * cfg["index_head_dim"], cfg["q_lora_rank"])
            lin(x + "wk.weight", cfg["index_head_dim"], h)
            norm(x + "k_norm.weight", cfg["index_head_dim"])
            out[x + "k_norm.bias"] = (0.1 * rng.standard_normal(cfg["index_head_dim"])).astype(np.float32)
            lin(x + "weights_proj.weight", cfg["index_n_heads"], h)
        m = p + "mlp."
        if i < cfg["first_k_dense_replace"]:
            _mlp(lin, m, h, cfg["intermediate_size"])
        else:
            lin(m + "gate.weight", cfg["n_routed_experts"], h)
            out[m + "gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(cfg["n_routed_experts"])).astype(
                np.float32
            )
            for e in range(cfg["n_routed_experts"]):
                _mlp(lin, f"{m}experts.{e}.", h, cfg["moe_intermediate_size"])
            _mlp(lin, m + "shared_experts.", h, cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
        if i >= n_main:  # an MTP layer (deepseek_mtp.py)
            norm(p + "enorm.weight", h)
            norm(p + "hnorm.weight", h)
            lin(p + "eh_proj.weight", h, 2 * h)
            norm(p + "shared_head.norm.weight", h)
    if cfg.get("num_nextn_predict_layers"):  # a target a one-layer draft can follow (tools/mtp_fit.py)
        for k in out:
            m = re.match(r"model\.layers\.(\d+)\.", k)
            if m and 0 < int(m.group(1)) < n_main and k.endswith(("o_proj.weight", "down_proj.weight")):
                out[k] *= MTP_UPPER_BRANCH_SCALE
    for i in range(n_main, n_main + cfg.get("num_nextn_predict_layers", 0)):  # DeepSeek-V3 repeats the shared ones
        out[f"model.layers.{i}.embed_tokens.weight"] = out["model.embed_tokens.weight"]
        out[f"model.layers.{i}.shared_head.head.weight"] = out["lm_head.weight"]
    return out


def _mlp(lin, prefix: str, hidden: int, inter: int) -> None:
    lin(prefix + "gate_proj.weight", inter, hidden)
    lin(prefix + "up_proj.weight", inter, hidden)
    lin(prefix + "down_proj.weight", hidden, inter)


FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}


def is_fp8_tensor(name: str) -> bool:
    """The tensors DeepSeek-V3's FP8 checkpoints store as e4m3: the decoder layers' projections
    (attention, dense MLP, experts, shared experts) and the indexer's wq_b and wk; not the router,
    norms, embedding, LM head or the indexer's weights_proj (DeepSeek-V3.2 ships it in bf16)."""
    if ".indexer." in name:
        return name.endswith((".wq_b.weight", ".wk.weight"))
    return name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def write_safetensors(path: str, tensors: dict[str, np.ndarray], bf16: bool = True, fp8: bool = False) -> None:
    """float32 arrays -> a safetensors file; bf16 except ``e_score_correction_bias`` (float32, as
    DeepSeek-V3 ships it); with ``fp8`` the projections as e4m3 codes plus ``_scale_inv``."""
    out = {}
    for k, v in tensors.items():
        if fp8 and is_fp8_tensor(k):
            codes, scale = quantize_fp8_blocks(v)
            out[k], out[k + "_scale_inv"] = ("F8_E4M3", codes), ("F32", scale)
        else:
            out[k] = ("F32" if not bf16 or k.endswith("e_score_correction_bias") else "BF16", v)
    save_file(path, out, metadata={"format": "pt"})


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on a fixed corpus; deterministic."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, USER, ASSISTANT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in [*TOOL_TOKENS, THINK_START, THINK_END]])
    return tok


def make_tiny_model(
    out_dir: str,
    seed: int = 0,
    num_layers: int = 4,
    sliding_window: int = 32,
    swa_layers: list[int] | None = None,
    first_k_dense: int = 1,
    fp8: bool = False,
    mtp: bool = False,
    dsa_layers: list[int] | None = None,
    index_topk: int = 16,
) -> str:
    """Write the checkpoint into ``out_dir`` (created); returns ``out_dir``. ``fp8``: DeepSeek-V3's
    FP8 format (projections as e4m3 codes with 128 x 128 block scales, ``quantization_config``).
    ``mtp``: with one random MTP layer (``tools/mtp_fit.py`` fits it to the model). ``dsa_layers``:
    DeepSeek-V3.2's indexed layers (``tiny_config``), with their indexer weights."""
    cfg = tiny_config(num_layers, sliding_window, swa_layers, first_k_dense, mtp, dsa_layers, index_topk)
    if fp8:
        cfg["quantization_config"] = dict(FP8_CONFIG)
    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer(cfg["vocab_size"])
    # padded past the tokenizer to a multiple of 16, as real checkpoints pad theirs (DeepSeek-V3:
    # 129,280 rows for 128,815 tokens), so the vocabulary splits over up to 16 ranks
    cfg["vocab_size"] = -(-max(cfg["vocab_size"], tok.get_vocab_size()) // 16) * 16
    cfg["bos_token_id"], cfg["eos_token_id"] = tok.token_to_id(BOS), tok.token_to_id(EOS)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tok_cfg = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": cfg["max_position_embeddings"],
        "tokenizer_class": "LlamaTokenizerFast",
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_cfg, f, indent=2, sort_keys=True, ensure_ascii=False)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tiny_weights(cfg, seed), fp8=fp8)
    return out_dir


def cache_root() -> str:
    return os.environ.get("FD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fastdeploy")


def resolve_model(model: str) -> str:
    """A model path as given, or the ``tiny-mla-swa`` preset built once into the cache folder."""
    if model != TINY_PRESET:
        return model
    target = os.path.join(cache_root(), f"{TINY_PRESET}-v{PRESET_VERSION}")
    if not os.path.isfile(os.path.join(target, "model.safetensors")):
        os.makedirs(cache_root(), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=TINY_PRESET + "-", dir=cache_root())
        make_tiny_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process built it first
            shutil.rmtree(tmp, ignore_errors=True)
    return target
