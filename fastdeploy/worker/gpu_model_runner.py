"""Model runner: KV cache allocation, the step's ForwardMeta, the model run, sampling.

On a machine without a GPU it runs on paddle's CPU place; the name stays for parity with
FastDeploy. Caches, one per layer, sized by its KV cache group's pool (docs/design.md §4.2), each
in the layout its attention backend declares (``kv_spec``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import paddle

from fastdeploy.config import FDConfig
from fastdeploy.distributed.parallel import TPGroup
from fastdeploy.input.grammar import token_bitmask
from fastdeploy.kv_transfer.transport import Transport, make_transport
from fastdeploy.model_executor.forward_meta import ForwardMeta, ForwardMetaBuilder
from fastdeploy.model_executor.layers.attention.base_backend import IndexedCache, KVSpec
from fastdeploy.model_executor.layers.device_sampler import DeviceSampler, Drawn, HostCopy
from fastdeploy.model_executor.layers.linear import captured_gemms
from fastdeploy.model_executor.layers.sampler import SampleResult
from fastdeploy.model_executor.load_weight_utils import load_weights, parameter_bytes
from fastdeploy.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM, layer_kv_specs
from fastdeploy.model_executor.ops.triton_ops.token_mask import apply_token_bitmask
from fastdeploy.request import Request
from fastdeploy.worker.decode_graphs import DecodeGraphs
from fastdeploy.worker.draft_graphs import Chain, DraftGraphs
from fastdeploy.worker.kv_sizing import group_bytes_per_block, num_blocks_for, on_gpu
from fastdeploy.worker.prompt_logprobs import PromptLogprobs, compute_prompt_logprobs
from fastdeploy.worker.speculation import MTPProposer, Results, all_rows, rows_batch, verify_drafts
from fastdeploy.worker.step_inputs import (
    PLACEHOLDER,
    DraftStep,
    StepInputs,
    build_step_inputs,
    chained_step_inputs,
)

logger = logging.getLogger("fastdeploy")


@dataclass(frozen=True)
class PreparedStep:
    """A step as the host built it: ``scheduled`` (request, tokens), each request's ``starts``
    (its computed tokens before the step), the step's inputs, and per sampling request
    (``step.samples_at`` order) the output ids its draw counts (a token pending from the step
    before as ``PLACEHOLDER``: draws read only how many there are, and the penalty counts that
    the step before's draw already updated on the device)."""

    scheduled: list[tuple[Request, int]]
    starts: list[int]
    step: StepInputs
    outputs: list[list[int]]


def outputs_as_seen(reqs: list[Request]) -> list[list[int]]:
    """Each request's output ids as a step launched now sees them: a token sampled by a step
    not yet taken as ``PLACEHOLDER`` (``PreparedStep.outputs``)."""
    return [r.output_token_ids + [PLACEHOLDER] * r.pending_tokens for r in reqs]


@dataclass(frozen=True)
class RunningStep:
    """A launched step: its draw, or (rows verifying drafts, drawn at ``finish``) its logits on
    the device (both None: no row samples), its prompt logprobs, per sampling request the drafts
    its rows verify, and (a captured step with speculation) the copy back of its acceptance and
    next drafts, computed on the device behind the draw (``DraftGraphs``)."""

    prep: PreparedStep
    logits: paddle.Tensor | None
    drawn: Drawn | None
    prompt: PromptLogprobs | None
    drafts: list[list[int]]
    proposal: HostCopy | None = None
    proposed: paddle.Tensor | None = None  # the proposal on the device (a chained step reads it)


class GPUModelRunner:
    """One rank's model and KV caches. The driver (rank 0) schedules and samples; under tensor
    parallelism it broadcasts each step's host arrays and every rank runs the same step. ``ep``:
    the expert-parallel group (docs/design.md §4.19; None: experts split over ``tp``)."""

    def __init__(self, fd_config: FDConfig, tp: TPGroup | None = None, ep: TPGroup | None = None) -> None:
        self.fd = fd_config
        self.tp = tp or TPGroup()
        mc = fd_config.model_config
        self.model = DeepseekV3ForCausalLM(fd_config, self.tp, ep)
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
        self.kv_specs = layer_kv_specs(mc, fd_config.cache_config)
        self.num_blocks = self.tp.broadcast_object(num_blocks_for(fd_config, self.kv_specs))  # the same on every rank
        self.caches = self.allocate_caches(self.num_blocks)
        self.kv_transport: Transport | None = None  # prefill / decode disaggregation (docs/design.md §4.20)
        self.kv_peers: list[tuple[str, list]] = []  # every rank's (transport session, cache regions)
        kc = fd_config.kv_transfer_config
        if kc.kv_connector is not None:  # every rank's caches registered: a decode rank receives blocks too
            self.kv_transport = make_transport(kc.kv_connector, kc.kv_ip)
            regions = self.kv_regions()
            for _, addr, per_block, blocks in regions:
                self.kv_transport.register(addr, per_block * blocks)
            self.kv_peers = self.tp.all_gather_object((self.kv_transport.session, regions))
        self.mask_pool = ThreadPoolExecutor(1, thread_name_prefix="fastdeploy-mask")
        self.sampler = DeviceSampler(
            mc.vocab_size, fd_config.scheduler_config.max_num_seqs, fd_config.kernel_config.triton
        )
        self.graphs = self.capture_decode_graphs()
        self.launched_at: deque[float] = deque()  # steps launched, not finished (the watchdog's clock)
        # the latest draw's tokens int64 [rows] on the device, and each request's row: a step
        # launched behind it takes its placeholders' tokens from them
        self.drawn: tuple[paddle.Tensor, dict[str, int]] | None = None

    def capture_decode_graphs(self) -> DecodeGraphs | None:
        """Each decode bucket captured (docs/design.md §4.11), when ``cuda_graph_capture`` asks,
        ``enforce_eager`` does not forbid it and buckets exist; with speculation (k drafts) also
        the verify steps of each bucket's requests, bucket x (k + 1) rows, and the draft passes
        after each bucket (``DraftGraphs``, §4.16)."""
        sc = self.fd.scheduler_config
        if not sc.cuda_graph_capture or sc.enforce_eager or not sc.cuda_graph_batch_sizes:
            return None
        layers = self.caches[: self.fd.model_config.num_hidden_layers]
        buckets = set(sc.cuda_graph_batch_sizes)
        if self.spec is not None:
            buckets |= {b * (self.spec.k + 1) for b in sc.cuda_graph_batch_sizes}

        def step(meta: ForwardMeta) -> tuple[paddle.Tensor, paddle.Tensor]:  # warm-up, capture, CPU re-runs
            with captured_gemms(self.model):
                hidden = self.model(meta, layers)
                return hidden, self.model.compute_logits(hidden)

        graphs = DecodeGraphs(
            step,
            self.meta_builder,
            tuple(sorted(buckets)),
            self.null_block,
            sc.max_model_len,
            on_gpu(),
        )
        graphs.capture()
        if self.spec is not None:  # the draft passes after each captured step, captured too
            cache = self.caches[self.fd.model_config.num_hidden_layers]
            decode = tuple(sc.cuda_graph_batch_sizes)
            self.spec.graphs = DraftGraphs(self.spec.model, cache, self.meta_builder, graphs, decode, self.spec.k)
            self.spec.graphs.capture()
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

    def kv_regions(self) -> list[tuple[str, int, int, int]]:
        """Each cache tensor (a DSA layer's two) as (its KV cache group, address, bytes a block,
        blocks): blocks are the tensors' first axis, so a block of a layer is one contiguous
        range (what a KV transfer moves, docs/design.md §4.20)."""
        out = []
        for _, spec, t in self._kv_tensors():
            per_block = t.element_size() * int(np.prod(t.shape[1:]))
            out.append((spec.group, t.data_ptr(), per_block, int(t.shape[0])))
        return out

    def kv_region_layers(self) -> list[int]:
        """The layer that writes each of ``kv_regions`` (the MTP layer: ``num_hidden_layers``)."""
        return [layer for layer, _, _ in self._kv_tensors()]

    def _kv_tensors(self) -> Iterator[tuple[int, KVSpec, paddle.Tensor]]:
        """(layer, its KV spec, a cache tensor of it) in ``kv_regions``' order."""
        for layer, (spec, cache) in enumerate(zip(self.kv_specs, self.caches, strict=False)):
            for t in cache if isinstance(cache, IndexedCache) else (cache,):
                yield layer, spec, t

    def step_inputs(self, scheduled: list[tuple[Request, int]]) -> StepInputs:
        """The step's host arrays (``build_step_inputs``), decode steps padded to their bucket."""
        return build_step_inputs(scheduled, self.null_block, self.fd.scheduler_config.bucket_for)

    def run_step(
        self,
        step: StepInputs,
        filled: paddle.Tensor | None = None,
        layer_done: Callable[[int], None] | None = None,
    ) -> tuple[paddle.Tensor | None, PromptLogprobs | None]:
        """The model on one step's inputs, the same on every rank: logits [n, vocab] of the tokens
        that sample, on the device (None when none does), and the step's prompt logprobs (None
        when no request asks). ``filled``: int64 [P] on the device, the tokens of the step's
        placeholders (in ``step.placeholders`` order); ``layer_done``: the driver's layer-wise KV
        push (``ForwardMeta.layer_done``; eager steps only: a captured step pushes at the end)."""
        at = paddle.to_tensor([r for r, _ in step.placeholders], dtype="int64") if step.placeholders else None
        if step.chained and not (self.graphs is not None and self.graphs.takes(step)):
            raise RuntimeError("a chained verify step runs only captured (GPUModelRunner.can_chain)")
        if self.graphs is not None and self.graphs.takes(step):  # every token samples, in order
            meta, hidden, logits = self.graphs.run(step, at, filled)
            if self.spec is not None:
                self.spec.remember(step, meta, hidden)
            n = len(step.samples_at) if step.is_decode else len(step.input_ids)  # verify: every token
            return (logits if n == logits.shape[0] else logits[:n]), None
        meta = self.meta_builder.build(step.input_ids, step.seq_lens_encoder, step.seq_lens_decoder, step.block_tables)
        meta.layer_done = layer_done
        if at is not None:
            meta.input_ids = paddle.scatter(meta.input_ids, at, filled)
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

    def prepare(self, scheduled: list[tuple[Request, int]]) -> PreparedStep:
        """The host's part of a step, before the engine counts its tokens: its inputs (with
        placeholders where a token is pending), each request's computed tokens and its outputs."""
        step = self.step_inputs(scheduled)
        outputs = outputs_as_seen([scheduled[i][0] for i in step.samples_at])
        return PreparedStep(scheduled, [r.num_computed_tokens for r, _ in scheduled], step, outputs)

    def can_chain(self, requests: int) -> bool:
        """Whether a verify step of ``requests`` requests, k drafts each, can run chained behind
        the running one (docs/design.md §4.18): it and its draft passes run captured."""
        if self.graphs is None or self.spec is None or self.spec.graphs is None:
            return False
        B = self.graphs.bucket(requests * (self.spec.k + 1))
        return B is not None and self.spec.graphs.takes(B, requests)

    def prepare_chained(self, reqs: list[Request]) -> PreparedStep:
        """A verify step of ``reqs`` to launch behind the running step they are all in
        (``chained_step_inputs``): k + 1 tokens each; its starts are those of no draft accepted
        (the engine sets the real ones once the running step is taken)."""
        step = chained_step_inputs(reqs, self.spec.k)
        scheduled = [(r, self.spec.k + 1) for r in reqs]
        return PreparedStep(scheduled, [r.num_computed_tokens for r in reqs], step, outputs_as_seen(reqs))

    def launch(
        self,
        prep: PreparedStep,
        layer_done: Callable[[int], None] | None = None,
        behind: RunningStep | None = None,
    ) -> RunningStep:
        """Queue a prepared step's device work behind every step launched before it (the driver;
        other ranks get its inputs by broadcast): the forward, the grammar masks and, when no
        row verifies drafts, the draw. A placeholder's token comes from the step before's drawn
        tokens on the device; nothing here waits for the device, except prompt logprobs (copied
        back at once). A failure of the model step itself raises. ``layer_done``: see
        ``run_step``. ``behind``: the running step a chained step (``prepare_chained``) takes
        its tokens, positions and drafts from, on the device."""
        self.launched_at.append(time.monotonic())  # the watchdog times the input broadcast too
        if not prep.scheduled and not self.fd.parallel_config.lockstep:
            return RunningStep(prep, None, None, None, [])
        try:
            step = self.tp.broadcast_object(prep.step if prep.scheduled else self.dummy_step())
            filled = chain = None
            if step.chained:
                first, starts = behind.prep.step.first_logit_rows, behind.prep.starts
                chain = self.spec.graphs.chain(behind.drawn.tokens, behind.proposed, first, starts)
                filled = self.tp.broadcast(chain.ids_pos)
            elif step.placeholders:
                tokens, row_of = self.drawn if self.drawn is not None else (paddle.zeros([0], "int64"), {})
                src = [row_of.get(key, len(row_of)) for _, key in step.placeholders]  # none: the 0 appended
                known = paddle.concat([tokens, paddle.zeros([1], "int64")])
                filled = self.tp.broadcast(paddle.gather(known, paddle.to_tensor(src, dtype="int64")))
            reqs = [prep.scheduled[i][0] for i in step.samples_at]
            if step.chained:  # known on the device only; their count is what the host needs
                drafts = [[0] * self.spec.k for _ in reqs]
            else:
                drafts = [r.draft_token_ids[: len(rows) - 1] for r, rows in zip(reqs, step.sample_rows, strict=True)]
            masked = [i for i, r in enumerate(reqs) if r.constrained]  # a mask a row, after each draft
            masks = None  # computed by llguidance's threads while this thread runs the forward
            if masked:
                vocab = self.fd.model_config.vocab_size
                masks = self.mask_pool.submit(token_bitmask, [(reqs[i].matcher, drafts[i]) for i in masked], vocab)
            try:
                logits, prompt = self.run_step(step, filled, layer_done)
            finally:
                words = masks.result() if masks is not None else None  # never left running
            if logits is not None and words is not None:
                first = step.first_logit_rows
                at = [first[i] + j for i in masked for j in range(len(step.sample_rows[i]))]
                logits = apply_token_bitmask(logits, words, at, self.fd.kernel_config.triton)
            drawn = proposal = proposed = None
            # a captured step whose rows all draw at once: acceptance and drafts follow on the device
            on_device = (
                self.spec is not None
                and len(reqs) == len(prep.scheduled)
                and not any(r.sampling_state.penalized for r in reqs)
                and self.spec.staged(len(reqs))
            )
            if step.chained and not on_device:
                raise RuntimeError("a chained verify step's requests must all draw at once (LLMEngine._may_chain)")
            if logits is not None and (on_device or not any(drafts)):
                batch = rows_batch(reqs, drafts, prep.outputs, all_rows(drafts))
                if chain is None:
                    drawn = self.sampler.draw(logits, batch)
                else:  # each row's seed step: known on the device only
                    drawn = self.sampler.draw(logits, batch, shift=chain.shift, span=self.spec.k + 1)
                if not any(drafts):
                    self.drawn = (drawn.tokens, {r.request_id: b for b, r in enumerate(reqs)})
                if on_device:
                    proposed = self.stage_drafts(prep, drafts, drawn, chain=chain)
                    proposal = HostCopy([proposed])
            return RunningStep(prep, None if drawn is not None else logits, drawn, prompt, drafts, proposal, proposed)
        except BaseException:
            self.launched_at.pop()
            raise

    def finish(self, running: RunningStep) -> tuple[Results, PromptLogprobs | None]:
        """A launched step's results on the host (waits for its device work): for each request
        whose tokens are now all computed, its new tokens: one sample, or with drafts the
        accepted drafts then the target's own token (docs/design.md §4.16); or the exception
        sampling it raised; else None. Also the step's prompt logprobs (None when no request
        asks). With speculation the draft model then runs over the step (every step: its cache
        of the step's rows) and proposes each sampled request's next drafts
        (``Request.draft_token_ids``), unless the launch queued them already (``proposal``)."""
        prep = running.prep
        try:
            results: Results = [None] * len(prep.scheduled)
            if running.logits is None and running.drawn is None:  # no row samples
                if self.spec is not None and prep.scheduled:  # the MTP layer's cache of its rows (§4.16)
                    self.propose_drafts(prep, running.drafts, results)
                return results, running.prompt
            step = prep.step
            reqs = [prep.scheduled[i][0] for i in step.samples_at]
            if running.proposal is not None:  # accepted on the device: each request's first rows
                samples = self.sampler.collect(running.drawn)
                got = running.proposal.wait()[0][: len(reqs)]
                first = step.first_logit_rows
                verified = [samples[f : f + a] if a else samples[f] for f, a in zip(first, got[:, 0], strict=True)]
                self.spec.take(prep.scheduled, reqs, got[:, 1], got[:, 2:])
            elif running.drawn is not None:
                verified = [[r] if isinstance(r, SampleResult) else r for r in self.sampler.collect(running.drawn)]
            else:  # rows verifying drafts: whether a row is used depends on the acceptance before it
                verified = verify_drafts(self.sampler, running.logits, reqs, step.first_logit_rows, running.drafts)
            for i, r in zip(step.samples_at, verified, strict=True):
                results[i] = r
            if self.spec is not None and running.proposal is None:
                self.propose_drafts(prep, running.drafts, results)
            return results, running.prompt
        finally:
            if self.launched_at:
                self.launched_at.popleft()

    def dummy_step(self) -> StepInputs:
        """A step of one padding row (a decode at position 0 over the null blocks; it samples
        nothing): what a data-parallel core with nothing scheduled runs so that every core's MoE
        layers gather together (docs/design.md §4.19)."""
        return build_step_inputs([], self.null_block, lambda n: 1)

    @property
    def step_started(self) -> float | None:
        """When the oldest step not yet finished was launched (None: none is running)."""
        return self.launched_at[0] if self.launched_at else None

    def propose_drafts(self, prep: PreparedStep, drafts: list[list[int]], results: Results) -> None:
        """The driver, after a step's results are on the host: every rank runs the draft passes
        over it; each sampled request gets its next ``draft_token_ids`` (``MTPProposer``). After
        a captured step whose requests all sampled they run as its draft graph (``stage_drafts``,
        the host's results as its drawn tokens), else eagerly as ``MTPProposer.plan`` says."""
        if len(prep.step.samples_at) == len(prep.scheduled) and self.spec.staged(len(prep.scheduled)):
            got = self.stage_drafts(prep, drafts, verified=results).numpy()[: len(prep.scheduled)]
            self.spec.take(prep.scheduled, [r for r, _ in prep.scheduled], got[:, 1], got[:, 2:])
            return
        msg, drafting = self.spec.plan(prep.scheduled, prep.starts, results, self._covered)
        proposed = self.draft(self.tp.broadcast_object(msg))
        self.spec.take(prep.scheduled, drafting, msg.depth, proposed)

    def _covered(self, req: Request) -> int:
        """The tokens ``req``'s block table holds (its first KV cache group's)."""
        return len(req.block_tables[next(iter(self.num_blocks))]) * self.block_size

    def stage_drafts(
        self,
        prep: PreparedStep,
        drafts: list[list[int]],
        drawn: Drawn | None = None,
        verified: Results | None = None,
        chain: Chain | None = None,
    ) -> paddle.Tensor:
        """The driver, after a captured step ``MTPProposer.staged`` accepts: its draft graph's
        inputs into the staging buffer (one copy, then the step's ``drawn`` tokens on the device,
        or the host's ``verified`` results in the copy; a chained step's drafts, starts and rooms
        from its ``chain``), sent to every rank, and the graph run: int64 [R, k + 2] on the device
        (accepted tokens, depth, drafts a request)."""
        B, buf = self.spec.stage(prep.scheduled, prep.starts, drafts, self._covered, verified)
        self.spec.graphs.load(B, buf, *((drawn.tokens, drawn.ok) if drawn is not None else ()))
        if chain is not None:
            self.spec.graphs.load_chained(B, chain)
        return self.draft(self.tp.broadcast_object(DraftStep([], [], [], [], [], staged=buf.shape[0])))

    def draft(self, msg: DraftStep) -> np.ndarray | paddle.Tensor:
        """Every rank: the draft passes over the latest step, on the MTP layer's cache: after a
        captured step (``msg.staged``) the draft graph over the driver's staging buffer (device
        int64 [R, k + 2]), else ``MTPProposer.draft`` (host int64 [D, k])."""
        if msg.staged:
            if self.tp.world_size > 1:
                staging = self.spec.graphs.staging
                buf = staging[: msg.staged] if self.tp.is_driver else paddle.zeros([msg.staged], "int32")
                self.tp.broadcast(buf)
                if not self.tp.is_driver:
                    staging[: msg.staged] = buf
            return self.spec.run_staged()
        return self.spec.draft(msg, self.caches[self.fd.model_config.num_hidden_layers], self.meta_builder)

    def serve_steps(self) -> None:
        """A worker rank: run the driver's steps (and draft passes) until it broadcasts None."""
        while (step := self.tp.broadcast_object()) is not None:
            if isinstance(step, DraftStep):
                self.draft(step)
            else:
                filled = None
                if step.chained:  # its tokens and positions, from the driver's acceptance
                    filled = self.tp.broadcast(paddle.zeros([2 * len(step.input_ids)], "int64"))
                elif step.placeholders:  # their tokens, from the driver's draw
                    filled = self.tp.broadcast(paddle.zeros([len(step.placeholders)], "int64"))
                self.run_step(step, filled)  # rank 0 keeps the results

    def stop_workers(self) -> None:
        """The driver: tell the other ranks to return from ``serve_steps``."""
        if self.tp.world_size > 1 and self.tp.is_driver:
            self.tp.broadcast_object(None)
