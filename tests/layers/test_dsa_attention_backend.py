"""The seed PR's entry points, called as its fleet fallback calls them: ``get_swa_indexer_top_k``
(imported from models/deepseek_v3.py) fills [T, 1, W] window slots, then
``DSAAttentionBackend.forward_static`` writes the step's FP8 records and attends over them. The
four cases the PR's CI asked for: prefill-only, decode-only and mixed batches, and FlashMLA's head
padding; each against float64 attention over the window, with the latent as the 656-byte record
keeps it (numpy). Every cache byte not written is 0xFF (NaN)."""

import sys

import numpy as np
import paddle
import pytest
from fake_flash_mla import fake_flash_mla

from fastdeploy.config import KernelConfig
from fastdeploy.model_executor.forward_meta import ForwardMetaBuilder
from fastdeploy.model_executor.layers.attention import DSAAttentionBackend
from fastdeploy.model_executor.models.deepseek_v3 import get_swa_indexer_top_k
from fastdeploy.model_executor.models.deepseek_v3_reference import fp8_record_roundtrip

BS, W, SCALE, NUM_BLOCKS = 16, 24, 0.1352, 48


class Case:
    """Requests with random block tables over one NaN-poisoned FP8 cache, and what each request
    has written so far (float64 as the record keeps it), for the reference."""

    def __init__(self, rng, kernels: KernelConfig, heads: int = 4):
        self.rng, self.kernels, self.H = rng, kernels, heads
        self.cache = paddle.full([NUM_BLOCKS, BS, 1, 656], 0xFF, dtype="uint8")
        self.free = list(rng.permutation(NUM_BLOCKS))
        self.tables: dict[str, list[int]] = {}
        self.kv: dict[str, np.ndarray] = {}  # [L, 576] float64, as the records keep them
        backend = DSAAttentionBackend(SCALE, W, kernels, heads, "float32")
        self.builder = ForwardMetaBuilder(BS, [backend], kernels)

    def step(self, batch: list[tuple[str, int]], decode: frozenset = frozenset()):
        """One step through the PR's calls: (request, new tokens) -> (out [T, H, 512], want)."""
        enc, dec, rows = [], [], []
        for rid, n in batch:
            start = len(self.kv.get(rid, ()))
            table = self.tables.setdefault(rid, [])
            while len(table) * BS < start + n:
                table.append(int(self.free.pop()))
            enc.append(0 if rid in decode else n)
            dec.append(start)
            rows.append(table)
        T = sum(n for _, n in batch)
        meta = self.builder.build([0] * T, enc, dec, {"swa": rows})
        kv_c, k_pe = self.rng.standard_normal((T, 512)) * 2, self.rng.standard_normal((T, 64))
        q = self.rng.standard_normal((T, self.H, 576))
        indexer_top_k = paddle.full([T, 1, W], -7, dtype="int32")  # every entry must be written
        get_swa_indexer_top_k(
            indexer_top_k,
            meta.block_tables,
            paddle.to_tensor(meta.cu_seqlens_q),
            paddle.to_tensor(meta.seq_lens_encoder),
            paddle.to_tensor(meta.seq_lens_decoder),
            meta.batch_id_per_token,
            block_size=BS,
            sliding_window=W,
        )
        out = DSAAttentionBackend.forward_static(
            q=paddle.to_tensor(q, "float32"),
            indexer_topk=indexer_top_k,
            compressed_kv=paddle.to_tensor(kv_c, "float32"),
            k_pe=paddle.to_tensor(k_pe, "float32"),
            latent_cache=self.cache,
            forward_meta=meta,
            attn_softmax_scale=SCALE,
        )
        assert list(out.shape) == [T, self.H * 512]
        # the plan's window indices come from the same indexer, padded with -1 to the provider's multiple
        planned = meta.attn[f"swa:{W}"].indices.numpy()
        np.testing.assert_array_equal(planned[:, :W], indexer_top_k.numpy()[:, 0])
        assert (planned[:, W:] == -1).all()

        want, t = [], 0
        for rid, n in batch:
            c, pe = fp8_record_roundtrip(kv_c[t : t + n], k_pe[t : t + n])
            self.kv[rid] = np.concatenate([self.kv.get(rid, np.zeros((0, 576))), np.concatenate([c, pe], 1)])
            L = len(self.kv[rid])
            for p in range(L - n, L):
                keys = self.kv[rid][max(0, p - W + 1) : p + 1]  # the window: W keys ending at p
                s = q[t + p - (L - n)] @ keys.T * SCALE  # [H, keys]
                pr = np.exp(s - s.max(-1, keepdims=True))
                want.append((pr / pr.sum(-1, keepdims=True)) @ keys[:, :512])
            t += n
        return out.numpy().reshape(T, self.H, 512), np.stack(want)


def check(got, want, tol):
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert err.max() < tol, err.max()


PROVIDERS = [
    # absorbed: forward_static's sparse-MLA entry, which auto leaves on CPU; reference: float32 q
    # and softmax, measured 1e-5
    pytest.param(KernelConfig(mla_prefill_form="absorbed"), 1e-4, id="reference"),
    pytest.param(
        KernelConfig(triton=True, sparse_mla_provider="triton", mla_prefill_form="absorbed"), 2e-2, id="triton"
    ),
]


@pytest.mark.parametrize("kernels, tol", PROVIDERS)
def test_prefill_only(kernels, tol, rng):
    c = Case(rng, kernels)
    # fresh prefills of 2W + a block + 3, W + 1 and W - 1 tokens (positions W-1, W, W+1, block edges)
    check(*c.step([("a", 2 * W + BS + 3), ("b", W + 1), ("c", W - 1)]), tol)
    # chunked: a second chunk below, equal to and above W, whose windows reach into the first
    check(*c.step([("b", W - 5), ("c", W), ("a", W + 3)]), tol)


@pytest.mark.parametrize("kernels, tol", PROVIDERS)
def test_decode_only(kernels, tol, rng):
    c = Case(rng, kernels)
    c.step([("a", 2 * W + BS + 3), ("b", W - 1), ("c", BS - 1), ("d", W)])
    for _ in range(3):  # b at W-1, W, W+1; c across a block edge; d past W
        check(*c.step([("a", 1), ("b", 1), ("c", 1), ("d", 1)], decode=frozenset("abcd")), tol)


@pytest.mark.parametrize("kernels, tol", PROVIDERS)
def test_mixed(kernels, tol, rng):
    c = Case(rng, kernels)
    c.step([("a", 2 * W + BS + 3), ("b", W)])
    # a and b decode while c prefills fresh and a second chunk of d comes after its first
    check(*c.step([("a", 1), ("c", W + 2), ("b", 1), ("d", BS + 1)], decode=frozenset("ab")), tol)
    check(*c.step([("d", W + 1), ("a", 1), ("c", 1)], decode=frozenset("ac")), tol)


@pytest.mark.parametrize("heads", [16, 128])
def test_flashmla_head_padding(heads, rng, monkeypatch):
    """FlashMLA (faked: its contract in float64, checking its arguments) takes 64 or 128 heads:
    16 are padded to 64 and sliced back; decode rows go to its decode kernel, prefill rows to its
    prefill kernel, in one mixed step."""
    calls = []
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla(calls))
    c = Case(rng, KernelConfig(sparse_mla_provider="flashmla", mla_prefill_form="absorbed"), heads=heads)
    check(*c.step([("a", 2 * W + 3), ("b", W)]), 3e-2)  # bf16 q, keys and output
    check(*c.step([("a", 1), ("c", W + 2), ("b", 1)], decode=frozenset("ab")), 3e-2)
    padded = 64 if heads <= 64 else 128
    assert calls == [("prefill", {"heads": padded}), ("decode", {"heads": padded}), ("prefill", {"heads": padded})]
