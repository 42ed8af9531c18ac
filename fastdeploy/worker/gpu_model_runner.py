"""Model runner: KV cache allocation, the step's ForwardMeta, the model run, sampling.

On a machine without a GPU it runs on paddle's CPU place; the name stays for parity with
FastDeploy. Caches, one per layer, sized by its KV cache group's pool (docs/design.md §4.2), each
in the layout its attention backend declares (``kv_spec``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import paddle

from fastdeploy.config import FDConfig
from fastdeploy.distributed.parallel import TPGroup
from fastdeploy.input.grammar import token_bitmask
from fastdeploy.model_executor.forward_meta import ForwardMeta, ForwardMetaBuilder
from fastdeploy.model_executor.layers.attention.base_backend import IndexedCache
from fastdeploy.model_executor.layers.device_sampler import DeviceSampler
from fastdeploy.model_executor.layers.linear import captured_gemms
from fastdeploy.model_executor.layers.sampler import SampleResult
from fastdeploy.model_executor.load_weight_utils import load_weights, parameter_bytes
from fastdeploy.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM, layer_kv_specs
from fastdeploy.model_executor.ops.triton_ops.token_mask import apply_token_bitmask
from fastdeploy.request import Request
from fastdeploy.worker.decode_graphs import DecodeGraphs
from fastdeploy.worker.kv_sizing import group_bytes_per_block, num_blocks_for, on_gpu
from fastdeploy.worker.prompt_logprobs import PromptLogprobs, compute_prompt_logprobs, record_prompt_logprobs
from fastdeploy.worker.speculation import MTPProposer, verify_drafts
from fastdeploy.worker.step_inputs import DraftStep, StepInputs, build_step_inputs

logger = logging.getLogger("fastdeploy")


class GPUModelRunner:
    """One rank's model and KV caches. The driver (rank 0) schedules and samples; under tensor
    parallelism it broadcasts each step's host arrays and every rank runs the same step."""

    def __init__(self, fd_config: FDConfig, tp: TPGroup | None = None) -> None:
        self.fd = fd_config
        self.tp = tp or TPGroup()
        mc = fd_config.model_config
        self.model = DeepseekV3ForCausalLM(fd_config, self.tp)
        self.model.eval()
        self.bytes_loaded = load_weights(self.model, mc.model_dir, mc.num_hidden_layers, self.tp.is_driver)
        self.spec: MTPProposer | None = None  # the draft model (docs/design.md §4.16)
        if fd_config.speculative_config.k:
            self.spec = MTPProposer(fd_config, self.model, self.tp)
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
        self.kv_specs = layer_kv_specs(mc, fd_config.cache_config)
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

    def allocate_caches(self, num_blocks: dict[str, int]) -> list[paddle.Tensor | IndexedCache]:
        """One cache a layer (a DSA layer's: its latent and its indexer keys), of its group's pool
        size plus the null block (the last, id ``num_blocks[g]``: padding rows of a bucketed decode
        step write and read only it; no pool ever hands it out), in its backend's layout."""
        bs = self.block_size
        self.null_block = dict(num_blocks)
        caches = [s.allocate(num_blocks[s.group] + 1, bs) for s in self.kv_specs]
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

    def step_inputs(self, scheduled: list[tuple[Request, int]]) -> StepInputs:
        """The step's host arrays (``build_step_inputs``), decode steps padded to their bucket."""
        return build_step_inputs(scheduled, self.null_block, self.fd.scheduler_config.bucket_for)

    def run_step(self, step: StepInputs) -> tuple[paddle.Tensor | None, PromptLogprobs | None]:
        """The model on one step's inputs, the same on every rank: logits [n, vocab] of the tokens
        that sample, on the device (None when none does), and the step's prompt logprobs (None
        when no request asks)."""
        if self.graphs is not None and self.graphs.takes(step):  # every row samples, in order
            logits = self.graphs.run(step)
            n = len(step.samples_at)
            return (logits if n == logits.shape[0] else logits[:n]), None
        meta = self.meta_builder.build(step.input_ids, step.seq_lens_encoder, step.seq_lens_decoder, step.block_tables)
        hidden = self.model(meta, self.caches[: self.fd.model_config.num_hidden_layers])
        if self.spec is not None:
            self.spec.remember(step, meta, hidden)
        prompt = None
        if step.prompt_logprobs.rows:
            prompt = compute_prompt_logprobs(self.model.compute_logits, hidden, step.prompt_logprobs, self.tp.is_driver)
        if not step.samples_at:
            return None, prompt
        rows = [r for rs in step.sample_rows for r in rs]
        return self.model.compute_logits(hidden, paddle.to_tensor(rows, dtype="int64")), prompt

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
            reqs = [scheduled[i][0] for i in step.samples_at]
            rows = [len(r) for r in step.sample_rows]
            first = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64) if rows else []
            drafts = [r.draft_token_ids[: n - 1] for r, n in zip(reqs, rows, strict=True)]
            masked = [i for i, r in enumerate(reqs) if r.constrained]  # a mask a row, after each draft
            masks = None  # computed by llguidance's threads while this thread runs the forward
            if masked:
                vocab = self.fd.model_config.vocab_size
                masks = self.mask_pool.submit(token_bitmask, [(reqs[i].matcher, drafts[i]) for i in masked], vocab)
            try:
                logits, prompt = self.run_step(step)
            finally:
                words = masks.result() if masks is not None else None  # never left running
            if prompt is not None:
                record_prompt_logprobs(scheduled, prompt)
            results: list[list[SampleResult] | Exception | None] = [None] * len(scheduled)
            if logits is None:
                return results
            if words is not None:
                at = [int(first[i]) + j for i in masked for j in range(rows[i])]
                logits = apply_token_bitmask(logits, words, at, self.fd.kernel_config.triton)
            for i, r in zip(step.samples_at, verify_drafts(self.sampler, logits, reqs, first, drafts), strict=True):
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
        proposed = self.draft(self.tp.broadcast_object(msg))
        self.spec.take(scheduled, drafting, msg.depth, proposed)

    def draft(self, msg: DraftStep) -> np.ndarray:
        """Every rank: ``MTPProposer.draft`` over the latest step, on the MTP layer's cache."""
        return self.spec.draft(msg, self.caches[self.fd.model_config.num_hidden_layers], self.meta_builder)

    def serve_steps(self) -> None:
        """A worker rank: run the driver's steps (and draft passes) until it broadcasts None."""
        while (step := self.tp.broadcast_object()) is not None:
            if isinstance(step, DraftStep):
                self.draft(step)
            else:
                self.run_step(step)  # rank 0 keeps the results

    def stop_workers(self) -> None:
        """The driver: tell the other ranks to return from ``serve_steps``."""
        if self.tp.world_size > 1 and self.tp.is_driver:
            self.tp.broadcast_object(None)
