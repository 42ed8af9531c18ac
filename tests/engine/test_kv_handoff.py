"""Prefill on one engine, decode on another, the prompt's KV moved by a real transfer engine over
TCP (docs/design.md §4.20): the decode engine reserves blocks (its prefix hits kept, SWA groups only
the last window's), the prefill engine computes the prompt in chunks and pushes exactly those
blocks, the decode engine commits the first token and decodes on. Two engines in one process, each
with its own transfer endpoint on 127.0.0.1."""

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.config import KVTransferConfig
from fastdeploy.engine.kv_handoff import KVTarget, PrefillResult
from fastdeploy.kv_transfer.transport import TransferError
from fastdeploy.model_executor.layers.sampler import SampleResult

KW = dict(model="tiny-mla-swa", block_size=16, num_gpu_blocks_override=64, max_model_len=256)
W, BS = 32, 16  # the tiny preset's window, the block size here


def engines(connector: str, push: str = "end", **kw):
    cfg = '{"kv_connector": "%s", "kv_role": "%s", "kv_timeout": 5, "kv_push": "%s"}'
    pre = LLM(**{**KW, **kw}, kv_transfer_config=cfg % (connector, "kv_producer", push)).engine
    dec = LLM(**{**KW, **kw}, kv_transfer_config=cfg % (connector, "kv_consumer", push)).engine
    return pre, dec


def generate(engine, ids, sp, rid):
    req = engine.make_request(ids, sp, rid)
    engine.enqueue(req)
    while engine.has_unfinished_requests():
        engine.step()
    return req


def handoff(pre, dec, ids, sp, rid):
    """The three moves: reserve on decode, prefill with the target (max_tokens 1), commit."""
    dreq = dec.make_request(ids, sp, rid)
    target = dec.reserve(dreq)
    before = pre.kv.bytes_sent
    preq = pre.make_request(ids, SamplingParams(max_tokens=1, temperature=0, logprobs=sp.logprobs), "p" + rid)
    preq.kv_target = KVTarget.from_json(target.to_json())  # what travels over HTTP
    last = generate_enqueued(pre, preq)
    assert preq.error is None, preq.error
    tok, top = preq.output_token_ids[0], (preq.output_logprobs or [None])[0]
    drafts = last.draft_token_ids  # the prefill's MTP drafts after its token (none without MTP)
    handed = PrefillResult(SampleResult(tok, top[tok] if top else 0.0, top), preq.num_cached_tokens, drafts)
    dec.commit(rid, PrefillResult.from_json(handed.to_json(), 10**6, len(ids)))  # what travels over HTTP
    while dec.has_unfinished_requests():
        dec.step()
    return dreq, target, pre.kv.bytes_sent - before


def generate_enqueued(engine, req):
    """Run ``req`` to the end; its last output."""
    engine.enqueue(req)
    last = None
    while engine.has_unfinished_requests():
        last = next((o for o in engine.step() if o.request_id == req.request_id), last)
    return last


def used(engine) -> dict:
    return {g: p.num_used for g, p in engine.block_manager.pools.items()}


def window_blocks(n: int) -> int:
    """SWA blocks the first generated position (n) sees: from (n - W + 1) // BS to the prompt's last."""
    return -(-n // BS) - max(0, n - W + 1) // BS


@pytest.mark.parametrize(
    "connector, push",
    [
        ("MooncakeConnector", "end"),
        ("MooncakeConnector", "layer"),
        ("NixlConnector", "end"),
        ("NixlConnector", "layer"),
    ],
)
def test_decode_after_a_remote_prefill_gives_one_engines_tokens(connector, push, rng):
    """Prompts past 3W (and one at a block edge), prefilled in chunks of 40 (above W) on the
    prefill engine, pushed in one batch at the end or layer by layer during the prompt's last
    step: the decode engine's greedy tokens and logprobs equal one engine's, SWA groups receive
    only the window's blocks (bytes counted), and both engines end with every block free
    (prefix-cached blocks aside)."""
    one = LLM(**KW, max_num_batched_tokens=40).engine
    pre, dec = engines(connector, push, max_num_batched_tokens=40)
    layers = one.config.model_config.num_hidden_layers
    sp = SamplingParams(max_tokens=24, temperature=0, logprobs=3, ignore_eos=True)
    for i, n in enumerate((3 * W + 17, 4 * W, 3 * W + 1)):
        ids = [int(x) for x in rng.integers(2, 500, n)]
        want = generate(one, ids, sp, f"o{i}")
        got, target, sent = handoff(pre, dec, ids, sp, f"d{i}")
        assert got.output_token_ids == want.output_token_ids
        for a, b in zip(got.output_logprobs, want.output_logprobs, strict=True):
            assert a.keys() == b.keys()
            np.testing.assert_allclose(list(a.values()), list(b.values()), atol=1e-5)
        blocks = {g: len(p) for g, p in target.fill.items()}
        assert blocks == {"full": -(-n // BS), "swa": window_blocks(n)}
        per_block = {g: sum(b for gg, _, b, _ in pre.kv.regions if gg == g) for g in blocks}
        assert sent == sum(blocks[g] * per_block[g] for g in blocks)
        assert pre.kv.layer_writes == (i + 1) * layers * (push == "layer")  # one a layer, during the forward
        assert used(pre) == {"full": 0, "swa": 0} and used(dec) == {"full": 0, "swa": 0}


def test_prefix_hits_on_the_decode_side_are_not_sent(rng):
    """A chat's second turn (the first turn's prompt and answer, then more): the decode engine
    holds the first turn's blocks, the window before the hit point included, so it keeps them
    and asks only for the rest. A prompt sharing only its start with the first is not a hit on
    the decode side (the window there was never sent): all its blocks are asked for. The tokens
    stay one engine's."""
    one = LLM(**KW, enable_prefix_caching=True).engine
    pre, dec = engines("MooncakeConnector", enable_prefix_caching=True)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    turn1 = [int(x) for x in rng.integers(2, 500, 3 * W + 5)]
    got, target, _ = handoff(pre, dec, turn1, sp, "d0")
    assert got.output_token_ids == generate(one, turn1, sp, "o0").output_token_ids
    held = (len(turn1) + 7) // BS  # full blocks the decode engine computed or received
    turn2 = turn1 + got.output_token_ids + [int(x) for x in rng.integers(2, 500, 30)]
    got, target, _ = handoff(pre, dec, turn2, sp, "d1")
    assert got.output_token_ids == generate(one, turn2, sp, "o1").output_token_ids
    assert min(j for j, _ in target.fill["full"]) == held
    assert got.num_cached_tokens == (len(turn1) // BS) * BS  # usage: what the prefill's own cache held
    other = turn1[: 3 * BS] + [int(x) for x in rng.integers(2, 500, 40)]
    got, target, _ = handoff(pre, dec, other, sp, "d2")
    assert got.output_token_ids == generate(one, other, sp, "o2").output_token_ids
    assert min(j for j, _ in target.fill["full"]) == 0


@pytest.mark.parametrize("push", ["end", "layer"])
def test_a_push_to_a_gone_peer_or_a_bad_target_fails_only_that_request(rng, push):
    """A target whose blocks the prefill request does not hold, one from another model's caches, a
    malformed one, and a decode engine that is gone: each fails its request with an error naming
    the cause, frees its blocks, and the prefill engine serves the next request."""
    pre, dec = engines("MooncakeConnector", push)
    sp1 = SamplingParams(max_tokens=1, temperature=0)
    ids = [int(x) for x in rng.integers(2, 500, 70)]
    target = dec.reserve(dec.make_request(ids, sp1, "d"))
    bad_block = KVTarget(target.request_id, target.session, target.regions, {"full": [(99, 0)]})
    other_model = KVTarget(target.request_id, target.session, target.regions[:-1], target.fill)
    gone = KVTarget(target.request_id, "127.0.0.1:1", target.regions, target.fill)
    for i, (t, why) in enumerate([(bad_block, "not one to send"), (other_model, "caches differ"), (gone, "")]):
        req = pre.make_request(ids, sp1, f"p{i}")
        req.kv_target = t
        generate_enqueued(pre, req)
        assert req.finish_reason == "error" and why in req.error, req.error
        assert used(pre) == {"full": 0, "swa": 0}
    assert "TransferError" in req.error
    with pytest.raises(ValueError, match="not a KV target"):
        KVTarget.from_json({"request_id": "x", "session": "s", "regions": [["full", "a"]], "fill": {}})
    ok = pre.make_request(ids, sp1, "ok")
    ok.kv_target = target
    generate_enqueued(pre, ok)
    assert ok.error is None and ok.finish_reason == "length"
    assert dec.abort_request("d") and used(dec) == {"full": 0, "swa": 0}  # a parked request aborted


def test_reserve_refuses_what_it_cannot_hold():
    """No --kv-transfer-config, an id in use, and a pool too small: each a ValueError naming it,
    with nothing kept."""
    plain = LLM(**KW).engine
    with pytest.raises(ValueError, match="no --kv-transfer-config"):
        plain.reserve(plain.make_request([5] * 20, SamplingParams(), "a"))
    _, dec = engines("MooncakeConnector", num_gpu_blocks_override=8, max_model_len=128)
    dec.reserve(dec.make_request([5] * 20, SamplingParams(), "a"))
    with pytest.raises(ValueError, match="already in use"):
        dec.reserve(dec.make_request([5] * 20, SamplingParams(), "a"))
    held = used(dec)
    with pytest.raises(ValueError, match="no KV blocks free for 120 prompt tokens"):
        dec.reserve(dec.make_request([5] * 120, SamplingParams(), "b"))
    assert used(dec) == held


@pytest.mark.parametrize(
    "text, msg",
    [
        ("{", "not JSON"),
        ('{"kv_role": "kv_producer"}', "'kv_connector' is required"),
        ('{"kv_connector": "Foo"}', "kv_connector 'Foo'"),
        ('{"kv_connector": "MooncakeConnector", "kv_role": "both"}', "kv_role 'both'"),
        ('{"kv_connector": "MooncakeConnector", "kv_timeout": 0}', "kv_timeout"),
        ('{"kv_connector": "MooncakeConnector", "kv_push": "chunk"}', "kv_push 'chunk'"),
        ('{"kv_connector": "MooncakeConnector", "port": 1}', "unknown key 'port'"),
    ],
)
def test_kv_transfer_config_errors_name_the_key(text, msg):
    with pytest.raises(ValueError, match=msg):
        KVTransferConfig.parse(text)


@pytest.mark.parametrize("extra, push", [(0, "end"), (7, "layer")])  # the prompt ends at a block edge, or inside one
def test_mtp_drafts_on_the_decode_instance_read_the_prompt_from_the_prefill(mtp_model_dir, rng, extra, push):
    """With speculation on both instances (k = 2): the prefill instance runs the MTP layer over
    every prompt chunk (its cache is pushed with the rest) and drafts after the first token, and
    those drafts travel with it, so the decode instance's first step verifies them as one
    speculating engine's does: its tokens, drafts proposed and drafts accepted are one engine's.
    Layer by layer, the MTP layer's blocks go at the end (the draft pass writes them last)."""
    kw = dict(model=mtp_model_dir, speculative_config='{"method": "mtp", "num_speculative_tokens": 2}')
    kw["max_num_batched_tokens"] = 64
    one = LLM(**{**KW, **kw}).engine
    pre, dec = engines("MooncakeConnector", push, **kw)
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ids = [int(x) for x in rng.integers(2, 500, 2 * W + 32 + extra)]
    want = generate(one, ids, sp, "o")
    got, target, _ = handoff(pre, dec, ids, sp, "d")
    assert got.output_token_ids == want.output_token_ids
    assert {g for g, _, _, _ in target.regions} >= {"full", "swa"} and len(target.regions) == len(
        one.runner.kv_regions()
    )
    assert dec.spec.num_draft_tokens == one.spec.num_draft_tokens > 0
    assert dec.spec.num_accepted_tokens == one.spec.num_accepted_tokens > 0
    assert dec.spec.num_drafts == one.spec.num_drafts
    assert used(pre) == {g: 0 for g in used(pre)} and used(dec) == {g: 0 for g in used(dec)}


def test_what_the_handoff_does_not_cover_yet_is_refused():
    from fastdeploy.engine.args import EngineArgs

    with pytest.raises(ValueError, match="kv_transfer_config: not with data_parallel_size"):
        EngineArgs(
            **KW, data_parallel_size=2, kv_transfer_config='{"kv_connector": "MooncakeConnector"}'
        ).create_config()


TP_RUN = """
import json, sys
from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor.layers.sampler import SampleResult
from fastdeploy.engine.kv_handoff import PrefillResult
kw, ids, tps = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
cfg = '{"kv_connector": "MooncakeConnector", "kv_role": "%s"}'
pre = LLM(**kw, tensor_parallel_size=tps[0], kv_transfer_config=cfg % "kv_producer").engine
dec = LLM(**kw, tensor_parallel_size=tps[1], kv_transfer_config=cfg % "kv_consumer").engine
sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
d = dec.make_request(ids, sp, "d")
target = dec.reserve(d)
p = pre.make_request(ids, SamplingParams(max_tokens=1, temperature=0), "p")
p.kv_target = target
pre.enqueue(p)
while pre.has_unfinished_requests():
    pre.step()
dec.commit("d", PrefillResult(SampleResult(p.output_token_ids[0], 0.0, None)))
while dec.has_unfinished_requests():
    dec.step()
print("RESULT " + json.dumps([d.output_token_ids, p.kv_target is not None and len(target.more)]))
pre.shutdown()
dec.shutdown()
"""


@pytest.mark.parametrize("tps", [(2, 1), (1, 2)], ids=["prefill-tp2", "decode-tp2"])
def test_instances_of_different_tensor_parallel_sizes_hand_off(tps, rng):
    """MLA's latent cache is whole on every tensor-parallel rank: a TP 2 prefill instance's
    driver alone pushes; a TP 2 decode instance's target names both ranks' caches and each gets
    the blocks. The decode engine's tokens equal one engine's."""
    import json
    import subprocess
    import sys

    ids = [int(x) for x in rng.integers(2, 500, 3 * W + 11)]
    want = generate(LLM(**KW).engine, ids, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), "o")
    p = subprocess.run(
        [sys.executable, "-c", TP_RUN, json.dumps(KW), json.dumps(ids), json.dumps(tps)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stderr[-3000:]
    tokens, more = json.loads(line[0][len("RESULT ") :])
    assert tokens == want.output_token_ids and more == tps[1] - 1


DECODE_THEN_DIE = """
import json, sys, time
from fastdeploy import LLM, SamplingParams
kw, ids = json.loads(sys.argv[1]), json.loads(sys.argv[2])
cfg = '{"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"}'
dec = LLM(**kw, kv_transfer_config=cfg).engine
sp = SamplingParams(max_tokens=4, temperature=0)
targets = [dec.reserve(dec.make_request(ids, sp, f"d{i}")).to_json() for i in range(2)]
print("TARGETS " + json.dumps(targets), flush=True)
time.sleep(600)  # killed by the test
"""


@pytest.mark.parametrize("push", ["end", "layer"])
def test_a_decode_instance_that_dies_after_a_push_fails_the_next_one_in_time(rng, push):
    """A decode engine in a process of its own reserves two requests; the first push lands (the
    connection is made), then the process is killed; the second push fails its request within
    kv_timeout with a TransferError, every block of the prefill engine is free, and it serves
    the next request."""
    import json
    import subprocess
    import sys
    import time

    ids = [int(x) for x in rng.integers(2, 500, 2 * W + BS + 5)]
    child = subprocess.Popen(
        [sys.executable, "-c", DECODE_THEN_DIE, json.dumps(KW), json.dumps(ids)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while not line.startswith("TARGETS ") and time.monotonic() < deadline:
            line = child.stdout.readline()
            assert line or child.poll() is None, "the decode process ended"
        targets = [KVTarget.from_json(t) for t in json.loads(line[len("TARGETS ") :])]
        cfg = '{"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "kv_timeout": 5, "kv_push": "%s"}'
        pre = LLM(**KW, kv_transfer_config=cfg % push).engine
        sp1 = SamplingParams(max_tokens=1, temperature=0)
        for i, t in enumerate(targets):
            if i == 1:
                child.kill()
                child.wait(timeout=30)
            req = pre.make_request(ids, sp1, f"p{i}")
            req.kv_target = t
            t0 = time.monotonic()
            generate_enqueued(pre, req)
            took = time.monotonic() - t0
            assert used(pre) == {"full": 0, "swa": 0}
            assert (req.error is None) if i == 0 else ("TransferError" in req.error), req.error
        assert took < 5 + 3  # kv_timeout, and the prompt's compute
        ok = generate(pre, ids, sp1, "after")
        assert ok.error is None and ok.finish_reason == "length"
    finally:
        child.kill()
        child.wait(timeout=30)


def test_a_transport_reports_a_write_that_outlasts_its_timeout():
    """write_all's timeout: a transport whose write never finishes raises TransferError."""
    from fastdeploy.kv_transfer.transport import Transport

    class Never(Transport):
        session = "x"

        def register(self, addr, nbytes):
            pass

        def write(self, peer, src, dst, lengths):
            return object()

        def poll(self, handle):
            return False

    with pytest.raises(TransferError, match="did not finish in time"):
        Never().write_all("peer", [0], [0], [1], 0.05)
