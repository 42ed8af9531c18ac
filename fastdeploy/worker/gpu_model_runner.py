"""Model runner: KV cache allocation, the step's ForwardMeta, the model run, sampling.

On a machine without a GPU it runs on paddle's CPU place; the name stays for parity with
FastDeploy. Caches, one per layer, sized by its KV cache group's pool (docs/design.md §4.2), each
in the layout its attention backend declares (``kv_spec``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import paddle

from fastdeploy.config import FULL_GROUP, SWA_GROUP, FDConfig, swa_blocks_per_request
from fastdeploy.distributed.parallel import TPGroup
from fastdeploy.input.grammar import token_bitmask
from fastdeploy.model_executor.forward_meta import ForwardMeta, ForwardMetaBuilder
from fastdeploy.model_executor.layers.attention.base_backend import KVSpec
from fastdeploy.model_executor.layers.device_sampler import DeviceSampler
from fastdeploy.model_executor.layers.linear import captured_gemms
from fastdeploy.model_executor.layers.sampler import SampleResult
from fastdeploy.model_executor.load_weight_utils import load_weights, parameter_bytes
from fastdeploy.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM, layer_kv_specs
from fastdeploy.model_executor.ops.triton_ops.token_mask import apply_token_bitmask
from fastdeploy.request import Request
from fastdeploy.worker.decode_graphs import DecodeGraphs
from fastdeploy.worker.speculation import MTPProposer, verify_drafts

logger = logging.getLogger("fastdeploy")

CPU_KV_CACHE_BYTES = 512 * 2**20  # default KV pool on CPU (override: FD_CPU_KV_CACHE_BYTES)
PROMPT_LOGPROB_ROWS = 256  # prompt-logprob rows whose float32 [rows, vocab] logits exist at once


def prompt_logprob_span(req: Request, n: int) -> range:
    """The positions p of the request's next n tokens whose logits give a prompt token's logprob
    (that of token p + 1): every position of the chunk before the prompt's last."""
    start = req.num_computed_tokens
    return range(start, min(start + n, req.num_prompt_tokens - 1))


def on_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def resolve_dtype(dtype: str) -> str:
    if dtype == "auto":
        return "bfloat16" if on_gpu() else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return dtype


def group_bytes_per_block(specs: Sequence[KVSpec], block_size: int) -> dict[str, int]:
    """Bytes of one block over all layers of each KV cache group, from the layers' KV specs."""
    out: dict[str, int] = {}
    for spec in specs:
        out[spec.group] = out.get(spec.group, 0) + spec.bytes_per_token * block_size
    return out


def kv_budget_bytes(fd: FDConfig) -> float:
    """Memory the KV cache may take: the GPU's share left after the weights, or on CPU
    FD_CPU_KV_CACHE_BYTES."""
    if on_gpu():
        total = paddle.device.cuda.get_device_properties().total_memory
        return total * fd.cache_config.gpu_memory_utilization - paddle.device.cuda.memory_allocated()
    return float(os.environ.get("FD_CPU_KV_CACHE_BYTES", CPU_KV_CACHE_BYTES))


def plan_kv_blocks(fd: FDConfig, per_block: dict[str, int], budget: float) -> dict[str, int]:
    """Blocks of each group's pool (docs/design.md §4.2). One group takes the budget (or the
    override). With both, the SWA pool holds what max_num_seqs requests can need at once
    (``swa_blocks_per_request`` each), never more than the full pool (a request's SWA blocks are
    a subset of its logical blocks), and the full pool takes the rest; ``swa_full_tokens_ratio``
    fixes SWA blocks per full block instead; ``num_gpu_blocks_override`` sets the full pool."""
    cc, sc, mc = fd.cache_config, fd.scheduler_config, fd.model_config
    override, ratio = cc.num_gpu_blocks_override, cc.swa_full_tokens_ratio
    if len(per_block) == 1:
        ((g, nbytes),) = per_block.items()
        return {g: override or max(1, int(budget // nbytes))}
    full_b, swa_b = per_block[FULL_GROUP], per_block[SWA_GROUP]
    need = sc.max_num_seqs * swa_blocks_per_request(mc.sliding_window, sc.max_num_batched_tokens, cc.block_size)
    if override:
        full = override
    elif ratio:
        full = int(budget // (full_b + ratio * swa_b))
    else:
        full = int((budget - need * swa_b) // full_b)
        if full < need:  # tight memory: as many SWA blocks as full ones
            full = int(budget // (full_b + swa_b))
    swa = math.ceil(ratio * full) if ratio else min(need, full)
    return {FULL_GROUP: max(1, full), SWA_GROUP: max(1, swa)}


def pool_budget(budget: float, per_block: dict[str, int]) -> float:
    """The KV budget left for the pools: each group's null block comes off it (§4.11)."""
    return budget - sum(per_block.values())


def num_blocks_for(fd: FDConfig, specs: Sequence[KVSpec]) -> dict[str, int]:
    """Each group's pool size from the memory budget and each group's real bytes per block."""
    per_block = group_bytes_per_block(specs, fd.cache_config.block_size)
    return plan_kv_blocks(fd, per_block, pool_budget(kv_budget_bytes(fd), per_block))


class GPUModelRunner:
    """One rank's model and KV caches. The driver (rank 0) schedules and samples; under tensor
    parallelism it broadcasts each step's host arrays and every rank runs the same step."""

    def __init__(self, fd_config: FDConfig, dtype: str = "auto", tp: TPGroup | None = None) -> None:
        self.fd = fd_config
        self.tp = tp or TPGroup()
        self.dtype = resolve_dtype(dtype)
        mc = fd_config.model_config
        self.model = DeepseekV3ForCausalLM(mc, self.dtype, fd_config.kernel_config, self.tp, fd_config.cache_config)
        self.model.eval()
        self.bytes_loaded = load_weights(self.model, mc.model_dir, mc.num_hidden_layers, self.tp.is_driver)
        self.spec: MTPProposer | None = None  # the draft model (docs/design.md §4.16)
        if fd_config.speculative_config.k:
            self.spec = MTPProposer(fd_config, self.dtype, self.model, self.tp)
            self.bytes_loaded += self.spec.bytes_loaded
        self.weight_bytes = parameter_bytes(self.model)
        if self.spec is not None:
            for k, v in parameter_bytes(self.spec.model).items():
                self.weight_bytes[k] = self.weight_bytes.get(k, 0) + v
        logger.info(
            "weights on rank %d: %.1f MiB (%s; quantization %s)",
            self.tp.rank,
            sum(self.weight_bytes.values()) / 2**20,
            ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(self.weight_bytes.items())),
            mc.quantization,
        )
        self.block_size = fd_config.cache_config.block_size
        backends = self.model.attention_backends()
        kinds = {b.kind for b in backends}
        backends += [b for b in (self.spec.model.attention_backends() if self.spec else []) if b.kind not in kinds]
        self.meta_builder = ForwardMetaBuilder(self.block_size, backends, fd_config.kernel_config)
        self.step_started: float | None = None
        self.kv_specs = layer_kv_specs(mc, fd_config.cache_config, self.dtype)
        self.num_blocks = self.tp.broadcast_object(num_blocks_for(fd_config, self.kv_specs))  # the same on every rank
        self.caches = self.allocate_caches(self.num_blocks)
        self.mask_pool = ThreadPoolExecutor(1, thread_name_prefix="fastdeploy-mask")
        self.sampler = DeviceSampler(
            mc.vocab_size, fd_config.scheduler_config.max_num_seqs, fd_config.kernel_config.triton
        )
        self.graphs = self.capture_decode_graphs()

    def capture_decode_graphs(self) -> DecodeGraphs | None:
        """Each decode bucket captured (docs/design.md §4.11), when ``cuda_graph_capture`` asks,
        ``enforce_eager`` does not forbid it and buckets exist; not with speculation (its verify
        steps are not pure decodes, and its draft pass reads the step's host arrays)."""
        sc = self.fd.scheduler_config
        if not sc.cuda_graph_capture or sc.enforce_eager or not sc.cuda_graph_batch_sizes:
            return None
        if self.spec is not None:
            logger.warning("cuda_graph_capture is off under speculative decoding: decode steps run eagerly")
            return None
        layers = self.caches[: self.fd.model_config.num_hidden_layers]

        def step(meta: ForwardMeta) -> paddle.Tensor:  # warm-up, capture and CPU re-runs alike
            with captured_gemms(self.model):
                return self.model.compute_logits(self.model(meta, layers))

        graphs = DecodeGraphs(
            step,
            self.meta_builder,
            sc.cuda_graph_batch_sizes,
            self.null_block,
            sc.max_model_len,
            on_gpu(),
        )
        graphs.capture()
        return graphs

    def allocate_caches(self, num_blocks: dict[str, int]) -> list[paddle.Tensor]:
        """One cache a layer, of its group's pool size plus the null block (the last, id
        ``num_blocks[g]``: padding rows of a bucketed decode step write and read only it; no pool
        ever hands it out), in its backend's layout."""
        bs = self.block_size
        self.null_block = dict(num_blocks)
        caches = [paddle.zeros(s.shape(num_blocks[s.group] + 1, bs), dtype=s.dtype) for s in self.kv_specs]
        per_block = group_bytes_per_block(self.kv_specs, bs)
        for g, layers in self.fd.model_config.kv_cache_groups.items():
            logger.info(
                "KV cache group %s: %d layers, %s, %d blocks of %d tokens, %d bytes a block over its layers (%.1f MiB)",
                g,
                len(layers),
                self.kv_specs[layers[0]].dtype,
                num_blocks[g],
                bs,
                per_block[g],
                num_blocks[g] * per_block[g] / 2**20,
            )
        return caches

    def step_inputs(self, scheduled: list[tuple[Request, int]]) -> dict:
        """The step's host arrays: what the driver broadcasts and every rank builds ForwardMeta from.
        A request verifying m drafts (docs/design.md §4.16) computes its last token and the drafts
        as a chunk of m + 1 tokens, and samples at each of them (``sample_rows``)."""
        ids, enc, dec, sample_rows, row = [], [], [], [], 0
        tables: dict[str, list[list[int]]] = {g: [] for g in self.num_blocks}
        for req, n in scheduled:
            start, m = req.num_computed_tokens, req.num_drafts(n)
            ids.extend(req.all_token_ids[start : start + n - m] + req.draft_token_ids[:m])
            is_decode = n == 1 and req.output_token_ids and start == req.num_tokens - 1
            enc.append(0 if is_decode else n)
            dec.append(start)
            for g, rows in tables.items():
                rows.append(req.block_tables[g])
            if start + n - m == req.num_tokens:
                sample_rows.append(list(range(row + n - m - 1, row + n)))
            row += n
        samples_at = [
            i
            for i, (req, n) in enumerate(scheduled)
            if req.num_computed_tokens + n - req.num_drafts(n) == req.num_tokens
        ]
        lp_rows, lp_targets, lp_k, row = [], [], 0, 0
        for req, n in scheduled:
            if req.prompt_logprobs is not None:
                span = prompt_logprob_span(req, n)
                lp_rows += [row + p - req.num_computed_tokens for p in span]
                lp_targets += [req.prompt_token_ids[p + 1] for p in span]
                lp_k = max(lp_k, req.sampling_params.prompt_logprobs)
            row += n
        if not any(enc):  # a pure-decode step runs as its bucket: padding rows of one token at
            # position 0 whose every table is the null block; they never sample
            pad = self.fd.scheduler_config.bucket_for(len(scheduled)) - len(scheduled)
            ids += [0] * pad
            enc += [0] * pad
            dec += [0] * pad
            for g, rows in tables.items():
                rows += [[self.null_block[g]]] * pad
        return {
            "input_ids": ids,
            "seq_lens_encoder": enc,
            "seq_lens_decoder": dec,
            "block_tables": tables,
            "samples_at": samples_at,
            "sample_rows": sample_rows,
            "prompt_logprobs": {"rows": lp_rows, "targets": lp_targets, "k": lp_k},
        }

    def run_step(self, step: dict) -> tuple[paddle.Tensor | None, tuple[np.ndarray, ...] | None]:
        """The model on one step's inputs, the same on every rank: logits [n, vocab] of the tokens
        that sample, on the device (None when none does), and the step's prompt logprobs
        (``prompt_logprobs``; None when no request asks)."""
        if self.graphs is not None and self.graphs.takes(step):  # every row samples, in order
            logits = self.graphs.run(step)
            n = len(step["samples_at"])
            return (logits if n == logits.shape[0] else logits[:n]), None
        meta = self.meta_builder.build(
            step["input_ids"], step["seq_lens_encoder"], step["seq_lens_decoder"], step["block_tables"]
        )
        hidden = self.model(meta, self.caches[: self.fd.model_config.num_hidden_layers])
        if self.spec is not None:
            self.spec.remember(step, meta, hidden)
        lp = step.get("prompt_logprobs")
        prompt = self.prompt_logprobs(hidden, **lp) if lp and lp["rows"] else None
        if not step["samples_at"]:
            return None, prompt
        rows = [r for rs in step["sample_rows"] for r in rs]
        return self.model.compute_logits(hidden, paddle.to_tensor(rows, dtype="int64")), prompt

    def prompt_logprobs(
        self, hidden: paddle.Tensor, rows: list[int], targets: list[int], k: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """Raw (unprocessed) log-softmax of the logits at hidden[rows], read at ``targets``: the
        targets' logprobs float32 [R], their ranks int64 [R] (1 + tokens with a larger logit), and
        the k most likely tokens' ids int64 [R, k] and logprobs float32 [R, k]. Logits of
        PROMPT_LOGPROB_ROWS rows at a time (a whole prompt's would be [P, vocab]). Other ranks run
        only the LM head, whose vocabulary gather needs them, and return None."""
        parts = []
        for s in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            logits = self.model.compute_logits(hidden, paddle.to_tensor(rows[s : s + PROMPT_LOGPROB_ROWS]))
            if not self.tp.is_driver:
                continue
            lse = paddle.logsumexp(logits, axis=1, keepdim=True)
            tgt = paddle.to_tensor(targets[s : s + PROMPT_LOGPROB_ROWS], dtype="int64").unsqueeze(1)
            at = paddle.take_along_axis(logits, tgt, axis=1)
            rank = (logits > at).astype("int64").sum(1) + 1
            if k:
                top, ids = paddle.topk(logits, k, axis=1)
                top, ids = (top - lse).numpy(), ids.numpy()
            else:
                top, ids = np.zeros((len(at), 0), np.float32), np.zeros((len(at), 0), np.int64)
            parts.append(((at - lse).squeeze(1).numpy(), rank.numpy(), ids, top))
        return tuple(np.concatenate(x) for x in zip(*parts, strict=True)) if parts else None

    def execute(self, scheduled: list[tuple[Request, int]]) -> list[list[SampleResult] | Exception | None]:
        """Run one step (the driver; other ranks get its inputs by broadcast). For each request
        whose tokens are now all computed, its new tokens: one sample, or with drafts the accepted
        drafts then the target's own token (docs/design.md §4.16); or the exception sampling it
        raised; else None. With speculation, the draft model then proposes each sampled request's
        next drafts (``Request.draft_token_ids``). A failure of the model step itself raises."""
        if not scheduled:
            return []
        self.step_started = time.monotonic()  # the watchdog times the input broadcast too
        try:
            step = self.tp.broadcast_object(self.step_inputs(scheduled))
            reqs = [scheduled[i][0] for i in step["samples_at"]]
            rows = [len(r) for r in step["sample_rows"]]
            first = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64) if rows else []
            masked = [i for i, r in enumerate(reqs) if r.constrained]  # never drafts: one row each
            masks = None  # computed by llguidance's threads while this thread runs the forward
            if masked:
                vocab = self.fd.model_config.vocab_size
                masks = self.mask_pool.submit(token_bitmask, [reqs[i].matcher for i in masked], vocab)
            try:
                logits, prompt = self.run_step(step)
            finally:
                words = masks.result() if masks is not None else None  # never left running
            if prompt is not None:
                self.record_prompt_logprobs(scheduled, prompt)
            results: list[list[SampleResult] | Exception | None] = [None] * len(scheduled)
            if logits is None:
                return results
            if words is not None:
                logits = apply_token_bitmask(
                    logits, words, [int(first[i]) for i in masked], self.fd.kernel_config.triton
                )
            drafts = [r.draft_token_ids[: n - 1] for r, n in zip(reqs, rows, strict=True)]
            for i, r in zip(step["samples_at"], verify_drafts(self.sampler, logits, reqs, first, drafts), strict=True):
                results[i] = r
            if self.spec is not None:
                self.propose_drafts(scheduled, results)
            return results
        finally:
            self.step_started = None

    def propose_drafts(
        self, scheduled: list[tuple[Request, int]], results: list[list[SampleResult] | Exception | None]
    ) -> None:
        """The driver: every rank runs the draft pass over this step; each sampled request gets
        its next ``draft_token_ids`` (``MTPProposer``)."""
        group = next(iter(self.num_blocks))
        msg, drafting = self.spec.plan(scheduled, results, lambda r: len(r.block_tables[group]) * self.block_size)
        proposed = self.draft(self.tp.broadcast_object({"draft": msg})["draft"])
        self.spec.take(scheduled, drafting, msg["depth"], proposed)

    def draft(self, msg: dict) -> np.ndarray:
        """Every rank: ``MTPProposer.draft`` over the latest step, on the MTP layer's cache."""
        return self.spec.draft(msg, self.caches[self.fd.model_config.num_hidden_layers], self.meta_builder)

    @staticmethod
    def record_prompt_logprobs(scheduled: list[tuple[Request, int]], prompt: tuple[np.ndarray, ...]) -> None:
        """Write the step's prompt logprobs into their requests by position, in the order
        ``step_inputs`` listed them; by position, so a step retried or recomputed after
        preemption writes the same entries again."""
        lp, rank, ids, top = prompt
        r = 0
        for req, n in scheduled:
            if req.prompt_logprobs is None:
                continue
            k = req.sampling_params.prompt_logprobs
            for p in prompt_logprob_span(req, n):  # the entry of prompt token p + 1
                entry = {int(t): float(v) for t, v in zip(ids[r, :k], top[r, :k], strict=True)}
                entry[req.prompt_token_ids[p + 1]] = float(lp[r])
                req.prompt_logprobs[p + 1], req.prompt_ranks[p + 1] = entry, int(rank[r])
                r += 1

    def serve_steps(self) -> None:
        """A worker rank: run the driver's steps (and draft passes) until it broadcasts None."""
        while (step := self.tp.broadcast_object()) is not None:
            if "draft" in step:
                self.draft(step["draft"])
            else:
                self.run_step(step)  # rank 0 keeps the results

    def stop_workers(self) -> None:
        """The driver: tell the other ranks to return from ``serve_steps``."""
        if self.tp.world_size > 1 and self.tp.is_driver:
            self.tp.broadcast_object(None)
