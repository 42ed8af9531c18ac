"""A stand-in for the ``flash_mla`` package with FlashMLA's contracts (docs/design.md §4.5, §4.7),
computed in float64 numpy, that checks the arguments each kernel gets and records each call:
``calls`` gets ("decode" | "prefill" | "dense", arguments worth checking)."""

import types

import numpy as np
import torch
from ref import dequant_records, sparse_mla_np


def _attend(q, kv, idx, scale):  # q [s, h, 576], kv [S, 576] float64, idx [s, topk]
    out, lse = sparse_mla_np(q.double().numpy(), kv, idx.numpy(), scale)
    return torch.from_numpy(out).to(torch.bfloat16), torch.from_numpy(lse).float()


def fake_flash_mla(calls: list) -> types.SimpleNamespace:
    def get_mla_metadata():
        return ("sched", None)

    def flash_mla_with_kvcache(
        q,
        k_cache,
        block_table,
        cache_seqlens,
        head_dim_v,
        tile_scheduler_metadata,
        softmax_scale,
        causal,
        is_fp8_kvcache=False,
        indices=None,
        num_splits=None,
    ):
        assert q.dim() == 4 and q.shape[2] in (64, 128) and q.dtype == torch.bfloat16 and head_dim_v == 512
        assert tile_scheduler_metadata == "sched" and num_splits is None
        if indices is None:  # dense decode over a paged bf16 cache, one query a request
            assert causal and not is_fp8_kvcache and k_cache.dtype == torch.bfloat16 and q.shape[1] == 1
            calls.append(("dense", {"block_table": block_table.clone(), "cache_seqlens": cache_seqlens.clone()}))
            b, h, bs = q.shape[0], q.shape[2], k_cache.shape[1]
            out, lse = torch.zeros(b, 1, h, head_dim_v), torch.zeros(b, h, 1)
            for i in range(b):
                pos = np.arange(int(cache_seqlens[i]))
                rows = k_cache.reshape(-1, 576)[block_table[i].long()[pos // bs] * bs + pos % bs].double().numpy()
                o, s = _attend(q[i], rows, torch.arange(len(pos))[None].int(), softmax_scale)
                out[i], lse[i] = o, s.T
            return out.to(torch.bfloat16), lse
        assert q.shape[0] == 1 and k_cache.dtype == torch.uint8 and k_cache.shape[-1] == 656
        assert is_fp8_kvcache and not causal and block_table is None and cache_seqlens is None
        assert indices.shape[-1] % 64 == 0 and bool(((indices >= 0) | (indices == -1)).all())
        calls.append(("decode", {"heads": q.shape[2]}))
        kv = dequant_records(k_cache.reshape(-1, 656).numpy())
        out, lse = _attend(q[0], kv, indices[0], softmax_scale)
        return out[None], lse.T[None].contiguous()  # lse [b, h, s_q]

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v):
        assert q.dim() == 3 and q.shape[1] in (64, 128) and kv.dtype == torch.bfloat16 and kv.shape[1:] == (1, 576)
        assert indices.shape[1] == 1 and indices.shape[2] % 128 == 0 and d_v == 512
        assert bool((indices < kv.shape[0]).all())
        calls.append(("prefill", {"heads": q.shape[1]}))
        out, lse = _attend(q, kv[:, 0].double().numpy(), indices[:, 0], sm_scale)
        return out, None, lse

    return types.SimpleNamespace(
        get_mla_metadata=get_mla_metadata,
        flash_mla_with_kvcache=flash_mla_with_kvcache,
        flash_mla_sparse_fwd=flash_mla_sparse_fwd,
    )
