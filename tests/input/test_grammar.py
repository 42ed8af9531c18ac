"""Structured outputs, model-free: llguidance's masks over the tiny checkpoint's tokenizer. Random
walks that draw any allowed token at every step must end in text that the constraint accepts
(jsonschema for JSON Schemas, re.fullmatch for regexes, membership for choices), and the packed
mask must equal llguidance's own byte-per-token mask."""

import json
import re

import jsonschema
import numpy as np
import pytest

from fastdeploy.input.grammar import GrammarEngine, token_bitmask
from fastdeploy.input.tokenizer import THINK_END, TOOL_CALLS_BEGIN, Tokenizer
from fastdeploy.model_executor.ops.triton_ops.token_mask import unpack_bitmask
from fastdeploy.tools.tiny_checkpoint import resolve_model


def allowed_tokens(matchers, vocab_size: int) -> np.ndarray:
    """bool [len(matchers), vocab_size]: the tokens each matcher accepts next."""
    return unpack_bitmask(token_bitmask([(m, []) for m in matchers], vocab_size), vocab_size)


SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": -5, "maximum": 300}}, "required": ["a"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0}},
                "required": ["name"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["user", "ok"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"x": {"type": "string", "maxLength": 3}, "y": {"type": "null"}}},
    {"type": "string", "pattern": "^[a-c]{2,5}$"},
    {"type": "object", "properties": {"v": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 3}}},
    {"anyOf": [{"type": "integer", "minimum": 10, "maximum": 99}, {"type": "boolean"}]},
    {
        "type": "object",
        "properties": {"k": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}},
        "required": ["k"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"t": {"const": "fixed"}, "n": {"type": "integer"}}, "required": ["t"]},
]


@pytest.fixture(scope="module")
def engine():
    d = resolve_model("tiny-mla-swa")
    vocab = json.load(open(f"{d}/config.json"))["vocab_size"]
    return GrammarEngine(Tokenizer(d), vocab), Tokenizer(d)


def walk(eng: GrammarEngine, tok: Tokenizer, kind: str, spec: str, seed: int, limit: int = 400) -> str | None:
    """Draw uniformly among the allowed tokens until the matcher stops; the text, or None when
    the walk did not finish within ``limit`` tokens."""
    rng = np.random.default_rng(seed)
    m = eng.matcher(eng.compile(kind, spec))
    out = []
    for _ in range(limit):
        allowed = np.flatnonzero(allowed_tokens([m], eng.vocab_size)[0])
        assert allowed.size, "a live matcher always allows some token"
        t = int(rng.choice(allowed))
        assert m.consume_token(t), m.get_error()
        out.append(t)
        if m.is_stopped():
            return tok.decode([t for t in out if t != tok.eos_token_id])
    return None


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_walks_validate(engine, i):
    eng, tok = engine
    finished = 0
    for seed in range(20):
        text = walk(eng, tok, "json", json.dumps(SCHEMAS[i]), seed)
        if text is not None:
            jsonschema.validate(json.loads(text), SCHEMAS[i])
            finished += 1
    assert finished >= 10, finished  # most walks end within 400 tokens


def test_regex_choice_and_json_object_walks(engine):
    eng, tok = engine
    for seed in range(10):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", walk(eng, tok, "regex", r"[0-9]{3}-[a-z]{2}", seed))
        assert walk(eng, tok, "choice", json.dumps(["yes", "no", "don't know"]), seed) in ("yes", "no", "don't know")
        text = walk(eng, tok, "json_object", "", seed, limit=2000)
        assert text is None or isinstance(json.loads(text), dict)


def test_packed_mask_equals_llguidance_byte_mask(engine):
    """The packed 32-bit words unpacked; its compute_logit_bias (one byte a token,
    200 allowed) is an independent path to the same set, checked at every step of a walk."""
    eng, _ = engine
    rng = np.random.default_rng(0)
    m = eng.matcher(eng.compile("json", json.dumps(SCHEMAS[3])))
    for _ in range(30):
        mask = allowed_tokens([m], eng.vocab_size)[0]
        ref = np.frombuffer(m.compute_logit_bias(), np.uint8)[: eng.vocab_size] == 200
        np.testing.assert_array_equal(mask, ref)
        m.consume_token(int(rng.choice(np.flatnonzero(mask))))
        if m.is_stopped():
            break


@pytest.mark.parametrize(
    "kind, spec, msg",
    [
        ("json", '{"type": "nope"}', "nope"),
        ("json", "{not json", "not JSON"),
        ("json", "[1]", r"^a JSON Schema is an object \(or true / false\)$"),
        ("json", "3", r"^a JSON Schema is an object \(or true / false\)$"),
        ("json", "false", "^the JSON Schema false accepts no value$"),
        ("regex", "(", "not a regular expression"),
        ("choice", "[]", "^choices must be a non-empty list of strings$"),
        ("choice", "[1]", "^choices must be a non-empty list of strings$"),
        ("lark", "start: <[999999]>", "Token range end too large"),  # checked against the tokenizer
        ("lark", "start: undefined_rule", "undefined_rule"),
        ("xml", "x", "unknown constraint kind"),
    ],
)
def test_bad_constraints_say_why(engine, kind, spec, msg):
    eng, _ = engine
    with pytest.raises(ValueError, match=msg):
        eng.compile(kind, spec)
    assert eng.compile("lark", "start: <[5]>")  # a token id inside the vocabulary is fine


def test_the_schema_true_accepts_any_json_value(engine):
    eng, tok = engine
    texts = [walk(eng, tok, "json", "true", seed, limit=400) for seed in range(8)]
    done = [t for t in texts if t is not None]
    assert len(done) >= 4
    for t in done:
        json.loads(t)  # each finished walk is one JSON value


def test_compiled_grammars_are_cached(engine, monkeypatch):
    """A spec compiles once; past CACHE_SIZE the least recently used is compiled again."""
    from fastdeploy.input import grammar

    eng, _ = engine
    calls = []
    real = grammar._grammar
    monkeypatch.setattr(grammar, "_grammar", lambda *a: calls.append(a) or real(*a))
    a, b = ("json", json.dumps({"type": "integer", "minimum": 3})), ("regex", "b+")
    first = eng.compile(*a)
    assert eng.compile(*a) is first and calls == [a]
    monkeypatch.setattr(grammar, "CACHE_SIZE", 1)
    eng.compile(*b)  # evicts a
    eng.compile(*b)
    eng.compile(*a)
    assert calls == [a, b, a]


def test_added_tokens_match_as_their_text_and_special_ones_never(engine):
    """The tiny tokenizer is a byte-level BPE whose tool-call tags and </think> are added tokens
    that are not special: a constraint that spells one lets the model write it as its single
    token. The special tokens (EOS) are never text: a regex cannot ask for them."""
    eng, tok = engine
    for text in (THINK_END, TOOL_CALLS_BEGIN):
        tid = tok.single_token(text)
        assert tid is not None
        m = eng.matcher(eng.compile("regex", re.escape(text) + "x"))
        assert allowed_tokens([m], eng.vocab_size)[0][tid], text
        assert m.consume_token(tid) and not m.is_stopped()
    eos = tok.eos_token_id
    m = eng.matcher(eng.compile("regex", "a"))
    assert not allowed_tokens([m], eng.vocab_size)[0][eos]  # before the text is done
    plain = tok.encode(" ab", add_special_tokens=False)  # a byte-level token with a leading space
    m = eng.matcher(eng.compile("regex", " ab"))
    assert allowed_tokens([m], eng.vocab_size)[0][plain[0]]


def test_a_tokenizer_with_a_null_decoder_is_a_clear_error(tmp_path):
    """A word-level tokenizer whose ``decoder`` is null is not byte-level, so llguidance reads its
    JSON itself, and says it cannot (a ValueError naming the decoder; an AttributeError before)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    words = ["<eos>", "yes", "no"]
    hf = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    assert json.loads((tmp_path / "tokenizer.json").read_text()).get("decoder") is None  # saved as null
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    eng = GrammarEngine(Tokenizer(str(tmp_path)), len(words))
    with pytest.raises(ValueError, match="decoder"):
        eng.compile("regex", "(yes|no)")


def test_token_bytes_holes_and_a_smaller_model_vocabulary(engine):
    """llguidance's view of the tokenizer: bytes that llguidance tokenizes as the tokenizer does,
    invalid UTF-8 included; the model's ids past the tokenizer's (528 against 514) are never
    allowed; an engine over fewer ids than the tokenizer has sees each of them as the full one."""
    eng, tok = engine
    for text in ("hello world", " ab", "tabs\tand\nlines"):
        assert eng.lltok.tokenize_bytes(text.encode()) == tok.encode(text, add_special_tokens=False)
    ids = eng.lltok.tokenize_bytes(b"ab\xffcd")  # not UTF-8: the byte is replaced, not an error
    assert tok.decode(ids) == "ab\ufffdcd"
    holes = list(range(tok.vocab_size, eng.vocab_size))
    assert holes
    m = eng.matcher(eng.compile("regex", "[A-Z]+"))
    assert not allowed_tokens([m], eng.vocab_size)[0][holes].any()
    small = GrammarEngine(tok, 400)
    assert [small.lltok.decode_bytes([i]) for i in range(400)] == [eng.lltok.decode_bytes([i]) for i in range(400)]


def test_a_tokenizer_that_adds_bos_still_tokenizes_bare_bytes_for_llguidance(tmp_path):
    """A tokenizer.json whose post-processor adds BOS (as real checkpoints' may): llguidance's
    tokenization of bytes must not carry it."""
    import shutil

    src = resolve_model("tiny-mla-swa")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{name}", tmp_path / name)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    bos = json.loads((tmp_path / "tokenizer_config.json").read_text())["bos_token"]
    bos_id = spec["added_tokens"][[t["content"] for t in spec["added_tokens"]].index(bos)]["id"]
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer(str(tmp_path))
    assert tok.tok.encode("hello", add_special_tokens=True).ids[0] == bos_id  # the post-processor is live
    eng = GrammarEngine(tok, json.loads(open(f"{src}/config.json").read())["vocab_size"])
    assert eng.lltok.tokenize_bytes(b"hello world") == tok.encode("hello world", add_special_tokens=False)


def test_the_packed_mask_has_one_word_per_32_tokens(engine):
    """ceil(V / 32) words a row, also where V is a multiple of 32 (DeepSeek-V3's 129,280 is)."""
    eng, tok = engine
    for vocab in (512, 528):
        small = GrammarEngine(tok, vocab)
        m = small.matcher(small.compile("regex", "[a-z]+"))
        bits = token_bitmask([(m, [])], vocab)
        assert bits.shape == (1, -(-vocab // 32))
        assert unpack_bitmask(bits, vocab)[0].any()


def test_masks_after_each_draft(engine, rng):
    """token_bitmask with drafts (speculative decoding's verify step): row j of a matcher is the
    mask after its first j drafts, the same as consuming them one by one on a fresh matcher; a
    row after a draft the grammar refuses is empty; the matcher ends where it began."""
    eng, _ = engine
    vocab = eng.vocab_size
    grammar = eng.compile("json", json.dumps(SCHEMAS[0]))
    walk, drafts = eng.matcher(grammar), []
    for _ in range(5):  # a valid path of 5 tokens, each drawn from the tokens allowed there
        ok = np.flatnonzero(allowed_tokens([walk], vocab)[0])
        drafts.append(int(rng.choice(ok)))
        assert walk.consume_token(drafts[-1])
    m, other = eng.matcher(grammar), eng.matcher(grammar)
    before = allowed_tokens([m], vocab)
    bad = int(np.flatnonzero(~allowed_tokens([eng.matcher(grammar)], vocab)[0])[0])  # refused at the start
    got = unpack_bitmask(token_bitmask([(m, drafts), (other, [bad, drafts[0]])], vocab), vocab)
    assert got.shape == (6 + 3, vocab)
    ref = eng.matcher(grammar)
    for j in range(6):
        np.testing.assert_array_equal(got[j], allowed_tokens([ref], vocab)[0])
        if j < 5:
            assert ref.consume_token(drafts[j])
    np.testing.assert_array_equal(got[6], before[0])
    assert not got[7].any() and not got[8].any()
    np.testing.assert_array_equal(allowed_tokens([m], vocab), before)  # rolled back
