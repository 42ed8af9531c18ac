"""LLMEngine: requests in, one scheduler step and one model step at a time, outputs out."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from fastdeploy.cache_manager.block_manager import BlockManager
from fastdeploy.config import FULL_GROUP, SWA_GROUP, FDConfig, swa_blocks_per_request
from fastdeploy.distributed.parallel import Activity, init_parallel
from fastdeploy.distributed.watchdog import RankWatchdog
from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.kv_handoff import KVHandoff, KVTarget, PrefillResult
from fastdeploy.engine.metrics import SpecDecodeStats, engine_stats
from fastdeploy.input.grammar import GrammarEngine
from fastdeploy.input.tokenizer import IncrementalDetokenizer, Tokenizer
from fastdeploy.request import Request, RequestOutput, RequestStatus
from fastdeploy.sampling_params import SamplingParams
from fastdeploy.scheduler.scheduler import Scheduler, SchedulerOutput
from fastdeploy.worker.gpu_model_runner import GPUModelRunner, PreparedStep, RunningStep
from fastdeploy.worker.prompt_logprobs import PromptLogprobs, record_prompt_logprobs
from fastdeploy.worker.speculation import Results
from fastdeploy.worker.tp_worker import encode_config

logger = logging.getLogger("fastdeploy")

EXIT_GRACE_S = 5.0  # after a rank fails: time for the server to answer waiting requests before exiting


def check_kv_capacity(num_blocks: dict[str, int], block_size: int, max_model_len: int, fd: FDConfig) -> None:
    """Every request must fit alone: max_model_len tokens in the full pool, and in the SWA pool
    the most blocks one request holds at once (its window plus a chunk, at most its length;
    overlapped, two chunks: the running step's window stays until that step is taken)."""
    full = num_blocks.get(FULL_GROUP)
    if full is not None and full * block_size < max_model_len:
        raise ValueError(
            f"max_model_len={max_model_len} needs more KV cache than the {full} full-attention blocks "
            f"({full * block_size} tokens) available; lower --max-model-len or raise --num-gpu-blocks-override"
        )
    swa = num_blocks.get(SWA_GROUP)
    if swa is not None:
        chunk = fd.scheduler_config.swa_chunk_tokens
        one = min(
            swa_blocks_per_request(fd.model_config.sliding_window, chunk, block_size), -(-max_model_len // block_size)
        )
        if swa < one:
            raise ValueError(
                f"the SWA block pool has {swa} blocks, but one request can hold {one} at once (window "
                f"{fd.model_config.sliding_window} + chunk {chunk}); raise --swa-full-tokens-ratio or "
                "--num-gpu-blocks-override, or lower --max-num-batched-tokens"
            )


def exit_on_rank_failure(engine, why: str, kill: Callable[[], None]) -> None:
    """A rank died or stopped answering: once per ``engine`` (its ``_failing`` lock and
    ``_failed`` flag), log ``why``, ``kill`` the processes it started, tell its
    ``fatal_listeners`` (the server gets EXIT_GRACE_S to answer waiting clients), then exit 1."""
    with engine._failing:
        if engine._failed:
            return
        engine._failed = True
    logger.error("%s; stopping", why)
    kill()
    for listener in engine.fatal_listeners:
        listener(RuntimeError(why))
    if engine.fatal_listeners:
        time.sleep(EXIT_GRACE_S)
    logging.shutdown()
    os._exit(1)


@dataclass(frozen=True)
class Launched:
    """A step handed to the device: how it was prepared, each request's drafts in it, the indices
    of the requests that sample, and the runner's running step (or the exception launching it
    raised)."""

    prep: PreparedStep
    drafts: list[int]
    samples: set[int]
    running: RunningStep | Exception
    chained: bool = False  # launched behind a speculating step, from its acceptance on the device

    def finish(self, runner: GPUModelRunner) -> tuple[Results, PromptLogprobs | None]:
        """Its results and prompt logprobs (waits for the device); raises what the step raised."""
        if isinstance(self.running, Exception):
            raise self.running
        return runner.finish(self.running)


class RequestMaker:
    """Requests made from prompts, checked against the model: what the engine and the
    data-parallel front (which holds no model) share: the config, the tokenizer, the grammar
    engine and the end-of-sequence ids."""

    def __init__(self, config: FDConfig) -> None:
        mc = config.model_config
        self.config = config
        self.tokenizer = Tokenizer(mc.model_dir)
        self.grammar = GrammarEngine(self.tokenizer, mc.vocab_size)
        self.eos_token_ids = sorted(set(mc.eos_token_ids) | {self.tokenizer.eos_token_id} - {None})

    def make_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, param: str = "prompt"
    ) -> Request:
        """Validate and tokenize; touches no engine state, so any thread may call it. This is the
        one check of a request's values against the model (token ids in the vocabulary, the
        context length); a ValueError's message starts with the field it names (``param`` for
        the prompt)."""
        vocab = self.config.model_config.vocab_size
        if params.n != 1:
            raise ValueError(f"n: a request is one sample (got n={params.n}); queue params.sample(k) for each k")
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = list(prompt), None
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{param}: {bad[0]!r} is not a token id in 0..{vocab - 1}")
        if not ids:
            raise ValueError(f"{param}: must not be empty")
        limit = self.config.scheduler_config.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"{param}: {len(ids)} tokens, but max_model_len is {limit} (prompt plus at least one "
                "generated token must fit)"
            )
        for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name}: {bad[0]} is not a token id in 0..{vocab - 1}")
        req = Request(request_id or uuid.uuid4().hex, ids, params, prompt=text, eos_token_ids=self.eos_token_ids)
        if params.structured is not None:  # compiled here, in the caller's thread (cached by spec)
            so = params.structured
            try:
                req.matcher = self.grammar.matcher(self.grammar.compile(so.kind, so.spec))
            except ValueError as e:
                raise ValueError(f"{so.param}: {e}") from None
            if so.after is not None:
                req.grammar_after = self.tokenizer.single_token(so.after)
                if req.grammar_after is None:
                    raise ValueError(f"{so.param}: {so.after!r} is not one token of this tokenizer")
        return req


class LLMEngine(RequestMaker):
    def __init__(self, args: EngineArgs | FDConfig, activity: Activity | None = None) -> None:
        """``args``: the settings, or (a data-parallel engine core) the front's resolved config;
        ``activity``: the one this process's liveness beats already report (a core's)."""
        super().__init__(args if isinstance(args, FDConfig) else args.create_config())
        mc, pc = self.config.model_config, self.config.parallel_config
        worker_argv = ["--config", encode_config(self.config), "--driver-pid", str(os.getpid())]
        self.parallel = init_parallel(pc, worker_argv, activity)
        self.tp = self.parallel.tp
        if not self.tp.is_driver:
            raise ValueError("LLMEngine runs on rank 0 only; other ranks run fastdeploy.worker.tp_worker")
        self.fatal_listeners: list = []  # callables(exception) when a rank fails
        self._failing, self._failed = threading.Lock(), False
        self.watchdog = None
        try:
            self.runner = GPUModelRunner(self.config, self.tp, self.parallel.ep)
        except BaseException:
            self.shutdown()
            raise
        if pc.tensor_parallel_size > 1:
            self.watchdog = RankWatchdog(
                self.tp.workers,
                lambda: self.runner.step_started,
                pc.dist_timeout,
                self._rank_failed,
                beats=self.tp.beats,
                driver_computed=self.tp.activity.computed,
            )
            atexit.register(self.shutdown)  # the workers end with this process
        sc = self.config.scheduler_config
        check_kv_capacity(self.runner.num_blocks, self.runner.block_size, sc.max_model_len, self.config)
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            self.runner.block_size,
            self.config.cache_config.enable_prefix_caching,
            mc.sliding_window,
        )
        k = self.config.speculative_config.k
        self.scheduler = Scheduler(sc, self.block_manager, lookahead=max(0, k - 1))
        self.spec = SpecDecodeStats(k)
        self.requests: dict[str, Request] = {}
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self.num_generated_tokens = 0
        self.step_listeners: list = []  # callables(request, now) for metrics
        self.preempted_log: deque[Request] = deque(maxlen=256)  # the latest, for inspection
        self.num_preemptions = 0
        self.num_request_errors = 0
        self.finish_listeners: list = []  # callables(request_id, reason) for aborted or failed requests
        self.in_flight: Launched | None = None  # the step launched last, not yet taken (overlapped loop)
        self.num_chained_steps = 0  # verify steps launched behind a speculating step (§4.18)
        self.kv: KVHandoff | None = None  # prefill / decode disaggregation (docs/design.md §4.20)
        if self.config.kv_transfer_config.kv_connector is not None:
            layers = self.runner.kv_region_layers()
            self.kv = KVHandoff(self.config, self.runner.kv_transport, self.runner.kv_peers, layers)
        self.parked: dict[str, Request] = {}  # reserved for a prefill instance's KV, not yet committed

    def _rank_failed(self, why: str) -> None:
        """Another rank died or stopped answering: report it, then exit (this rank may be blocked
        in a collective for good)."""
        exit_on_rank_failure(self, why, self.tp.kill_workers)

    def shutdown(self) -> None:
        """Stop the other ranks (they return from their step loop) and reap their processes."""
        if self.watchdog is not None:
            self.watchdog.stop()
        runner = getattr(self, "runner", None)
        self.tp.reap_workers(runner.stop_workers if runner is not None else lambda: None)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, param: str = "prompt"
    ) -> Request:
        """Queue a prompt (text, or token ids). Raises ValueError naming what is wrong."""
        req = self.make_request(prompt, params, request_id, param)
        self.enqueue(req)
        return req

    def enqueue(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.detok[req.request_id] = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> bool:
        """Abort a live request, freeing its blocks; whether there was one to abort."""
        req = self.requests.pop(request_id, None)
        self.parked.pop(request_id, None)
        if self.kv is not None:
            self.kv.forget(request_id)
        live = req is not None and not req.is_finished
        if live:
            req.finish_reason = "abort"
            self.scheduler.abort(req)
            req.status = req.status.FINISHED
            for listener in self.finish_listeners:
                listener(request_id, "abort")
        self.detok.pop(request_id, None)
        return live

    def reserve(self, req: Request) -> KVTarget:
        """A decode instance: take blocks for a request whose prompt a prefill instance computes
        (its cached prefix kept; SWA groups only the last window) and park it until ``commit``;
        the target names the blocks to fill. ValueError when no transfer is configured, the id is
        in use, or the pools are short."""
        if self.kv is None:
            raise ValueError("kv_transfer_params: this instance has no --kv-transfer-config")
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        fill = self.block_manager.allocate_remote(req)
        if fill is None:
            raise ValueError(f"kv_transfer_params: no KV blocks free for {len(req.prompt_token_ids)} prompt tokens")
        self.requests[req.request_id] = self.parked[req.request_id] = req
        self.detok[req.request_id] = IncrementalDetokenizer(self.tokenizer)
        req.first_scheduled_time = time.monotonic()  # the reservation's start (expire_parked)
        return self.kv.target(req.request_id, fill)

    def expire_parked(self) -> list[str]:
        """Abort the reserved requests whose KV has not been committed within kv_timeout (their
        blocks freed); their ids."""
        limit = time.monotonic() - self.config.kv_transfer_config.kv_timeout
        gone = [rid for rid, r in self.parked.items() if r.first_scheduled_time < limit]
        for rid in gone:
            logger.warning("request %s: its prompt's KV did not arrive in time; freed", rid)
            self.abort_request(rid)
        return gone

    def commit(self, request_id: str, handed: PrefillResult) -> RequestOutput:
        """A parked request's prompt KV has arrived with what the prefill instance ``handed``
        over: it runs on from there (its first output, which may already finish it). Usage reports
        the prompt tokens the prefill's prefix cache held; the prefill's MTP drafts after the
        first token are verified by this instance's first step (at most its own k; none without
        speculation); the prompt's logprobs, when asked, are the prefill's. KeyError for an
        unknown id."""
        req = self.parked.pop(request_id)
        req.num_computed_tokens, req.num_cached_tokens = len(req.prompt_token_ids), handed.cached_tokens
        if req.sampling_params.prompt_logprobs is not None:
            req.prompt_logprobs, req.prompt_ranks = handed.prompt_logprobs, handed.prompt_ranks
        self.block_manager.cache_full_blocks(req)
        req.status = RequestStatus.RUNNING
        self.scheduler.running.append(req)
        if self._append(req, handed.first, time.monotonic()):
            req.draft_token_ids = handed.drafts[: self.spec.k]
        out = req.to_output()
        if req.is_finished:
            self.requests.pop(request_id, None)
            self.detok.pop(request_id, None)
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def rank_stats(self) -> list[tuple[dict[str, str], dict]]:
        """The counts /metrics shows (``metrics.engine_stats``), with no label: one engine."""
        return [({}, engine_stats(self))]

    def step(self) -> list[RequestOutput]:
        """One step's outputs: those of the requests that produced a token. In order (sync), a
        step is scheduled, run and its outputs taken. Overlapped (docs/design.md §4.18), the
        step launched last call is still running: the next one is scheduled and launched behind
        it (its pending tokens as placeholders), then the running one's outputs are taken while
        the next computes; a step that needs the host to know every token first (speculation,
        structured outputs) is launched only after the outputs before it are taken."""
        if self.in_flight is None:
            self.in_flight = self._launch(self._schedule())
        running, self.in_flight = self.in_flight, None
        if self.config.scheduler_config.async_scheduling:
            if self._may_overlap(running):
                sched = self._schedule()
                if sched.scheduled:
                    self.in_flight = self._launch(sched)
            elif self._may_chain(running):
                self.in_flight = self._launch_chained(running)
        outputs = self._take(running)
        if self.in_flight is not None and self.in_flight.chained:
            self.in_flight = self._resolve(self.in_flight)
        return outputs

    def _may_overlap(self, running: Launched) -> bool:
        """Whether the next step may be launched before the running one's tokens are on the host:
        not behind a step that failed to launch, not with speculation (its drafts and lengths
        come from those tokens), nor while a request has a structured-output matcher (its next
        mask does)."""
        return (
            not isinstance(running.running, Exception)
            and not self.spec.k
            and all(r.matcher is None for r in self.requests.values())
        )

    def _may_chain(self, running: Launched) -> bool:
        """Whether the next verify step may be launched behind a running speculating step, its
        tokens, positions and drafts taken from that step's acceptance on the device
        (docs/design.md §4.18): the running step accepted on the device (captured), it holds
        every running request and none waits, their k + 1 rows each fit the token budget, none
        has penalties, a grammar, a KV target or min_tokens left, and each one's blocks cover the
        longest acceptance of both steps and the drafts after them (taken here; False when a
        pool is short)."""
        r = running.running
        if not isinstance(r, RunningStep) or r.proposal is None or self.scheduler.waiting:
            return False
        reqs = [req for req, _ in running.prep.scheduled]
        k, sc = self.spec.k, self.config.scheduler_config
        if len(reqs) != len(self.scheduler.running) or len(reqs) * (k + 1) > sc.max_num_batched_tokens:
            return False
        if not self.runner.can_chain(len(reqs)):
            return False
        limit = sc.max_model_len
        need = [start + 3 * k + 1 for start in running.prep.starts]  # positions up to start + 2k + 1, then k - 1 drafts
        for req, n in zip(reqs, need, strict=True):
            st = req.sampling_state
            if (
                req.is_finished
                or req.status != RequestStatus.RUNNING
                or st.penalized
                or req.matcher is not None
                or req.kv_target is not None
                or len(req.output_token_ids) < st.min_tokens
                or n > limit
            ):
                return False
        each = zip(reqs, need, strict=True)
        return all(self.block_manager.allocate(req, n - req.num_computed_tokens) for req, n in each)

    def _launch_chained(self, running: Launched) -> Launched:
        """Launch the verify step of ``running``'s requests behind it (``GPUModelRunner.prepare_chained``):
        each request's token in flight and its sample pending are counted now, its computed
        tokens, starts and drafts once ``running`` is taken (``_resolve``)."""
        reqs = [req for req, _ in running.prep.scheduled]
        prep = self.runner.prepare_chained(reqs)
        for req in reqs:
            req.inflight_tokens += 1
            req.pending_tokens += 1
        self.num_chained_steps += 1
        try:
            step: RunningStep | Exception = self.runner.launch(prep, None, running.running)
        except Exception as e:  # noqa: BLE001 - pinned to its requests in _take
            step = e
        return Launched(prep, [self.spec.k] * len(reqs), set(range(len(reqs))), step, chained=True)

    def _resolve(self, chained: Launched) -> Launched:
        """A chained step once the step before is taken: each request verifies the drafts it
        now holds (those the step before proposed) from its computed tokens, and counts its
        last token as computed (as ``_launch`` does at launch)."""
        reqs = [req for req, _ in chained.prep.scheduled]
        drafts = [0 if req.is_finished else len(req.draft_token_ids) for req in reqs]
        scheduled = [(req, m + 1) for req, m in zip(reqs, drafts, strict=True)]
        prep = replace(chained.prep, scheduled=scheduled, starts=[req.num_computed_tokens for req in reqs])
        for req in reqs:
            if not req.is_finished and req.status == RequestStatus.RUNNING:
                req.num_computed_tokens += 1
        step = replace(chained.running, prep=prep) if isinstance(chained.running, RunningStep) else chained.running
        return replace(chained, prep=prep, drafts=drafts, running=step)

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        self.num_preemptions += len(sched.preempted)
        self.preempted_log.extend(sched.preempted)
        for req in sched.preempted if self.kv is not None else ():  # its blocks are gone: no layer write stands
            self.kv.forget(req.request_id)
        return sched

    def _launch(self, sched: SchedulerOutput) -> Launched:
        """Hand a scheduled step to the device: its inputs are built now, each request counts the
        step's tokens as computed and its sample as pending, then the runner queues its device
        work (a failure to launch is kept, to be taken as the step's failure)."""
        prep = self.runner.prepare(sched.scheduled)
        drafts = [req.num_drafts(n) for req, n in sched.scheduled]  # before the runner proposes new ones
        samples = set(prep.step.samples_at)
        for i, ((req, n), m) in enumerate(zip(sched.scheduled, drafts, strict=True)):
            req.num_computed_tokens += n - m
            req.inflight_tokens += n - m
            req.pending_tokens += i in samples
        hook = None
        if self.kv is not None:  # a prefill instance: prompts this step completes may push layer by layer
            each = zip(sched.scheduled, prep.starts, strict=True)
            last = [req for (req, n), start in each if start < req.num_prompt_tokens <= start + n]
            hook = self.kv.layer_hook([(r.block_tables, r.kv_target) for r in last if r.kv_target is not None])
        try:
            running: RunningStep | Exception = self.runner.launch(prep, hook)
        except Exception as e:  # noqa: BLE001 - pinned to its requests in _take
            running = e
        return Launched(prep, drafts, samples, running)

    def _roll_back(self, launched: Launched) -> None:
        """Undo a launch's counting (its step failed or was thrown away)."""
        each = zip(launched.prep.scheduled, launched.prep.starts, launched.drafts, strict=True)
        for i, ((req, n), start, m) in enumerate(each):
            if not req.is_finished and req.status == RequestStatus.RUNNING:
                req.num_computed_tokens = start
            req.inflight_tokens -= n - m
            req.pending_tokens -= i in launched.samples

    def _take(self, launched: Launched) -> list[RequestOutput]:
        """The outputs of a launched step, once it has run: tokens appended, stops checked, blocks
        registered for prefix reuse. A step that failed as a whole is retried request by request
        (a step launched behind it is thrown away first, its work undone)."""
        scheduled, prep = launched.prep.scheduled, launched.prep
        try:
            results, prompt = launched.finish(self.runner)
        except Exception as e:  # noqa: BLE001 - pinned to requests below; the engine keeps serving
            dead = [r for r, p in enumerate(self.tp.workers, start=1) if p.poll() is not None]
            if dead:  # not the requests' fault: a rank is gone
                self._rank_failed(f"tensor-parallel rank {dead[0]} exited during a step")
            if self.config.parallel_config.lockstep:  # a retry is a forward the other cores would not run
                logger.exception("engine step of %d requests failed; failing them", len(scheduled))
                self._roll_back(launched)
                return [self._fail(req, e) for req, _ in scheduled if not req.is_finished]
            logger.exception("engine step of %d requests failed; retrying them one by one", len(scheduled))
            if self.in_flight is not None:  # built on this step's tokens
                behind, self.in_flight = self.in_flight, None
                try:  # its outputs are not used; its device work must be done before a retry
                    behind.finish(self.runner)
                except Exception:  # noqa: BLE001 - as expected: built on a failed step
                    pass
                self._roll_back(behind)
            self._roll_back(launched)
            results, prompt = [self._execute_alone(req, n) for req, n in scheduled], None
        if prompt is not None:
            record_prompt_logprobs(scheduled, prep.starts, prompt)
        now = time.monotonic()
        outputs = []
        each = zip(scheduled, prep.starts, results, launched.drafts, strict=True)
        for i, ((req, n), start, res, m) in enumerate(each):
            if req.is_finished:  # finished or aborted while this step ran: its row was computed for nothing
                continue
            if isinstance(res, Exception):
                outputs.append(self._fail(req, res))
                continue
            req.inflight_tokens -= n - m
            req.pending_tokens -= i in launched.samples
            running = req.status == RequestStatus.RUNNING  # else preempted since (its blocks are gone)
            if res is None:
                if running:
                    self.block_manager.cache_full_blocks(req, start + n)
                continue
            if m:
                self.spec.record(m, len(res) - 1)
            base = start + n - m
            for j, sample in enumerate(res):  # accepted drafts, then the target's own token
                if m:  # tokens computed: the step's own, and the drafts accepted before this one (§4.16)
                    req.num_computed_tokens = base + j
                if running:
                    self.block_manager.cache_full_blocks(req, base + j)
                if not self._append(req, sample, now):
                    break
            if req.finish_reason != "error":
                for listener in self.step_listeners:  # once a step, however many tokens it added
                    listener(req, now)
            outputs.append(req.to_output())
            if req.is_finished:
                req.draft_token_ids = []
                self.requests.pop(req.request_id, None)
                self.detok.pop(req.request_id, None)
        self.spec.maybe_log(now)
        return outputs

    def _append(self, req: Request, res, now: float) -> bool:
        """Append one sampled token and check the stops; whether the request goes on (False:
        finished, or failed by its grammar)."""
        req.output_token_ids.append(res.token_id)
        if req.grammar_after is not None and res.token_id == req.grammar_after:
            req.grammar_after = None  # the constraint starts with the next token
        elif req.constrained and not req.matcher.consume_token(res.token_id):
            self._fail(req, RuntimeError(f"structured output: {req.matcher.get_error()}"))
            return False
        if res.top_logprobs is not None:
            req.output_logprobs.append(res.top_logprobs)
        if req.first_token_time is None:
            req.first_token_time = now
        self.num_generated_tokens += 1
        self._check_stop(req)
        return not req.is_finished

    def _execute_alone(self, req: Request, n: int):
        """One request's part of a failed step, run alone: its result (launched as ``_take``
        expects: the tokens counted, the sample pending), or the exception it raises (undone).
        Re-running writes the same KV values to the same slots, so the retry is safe."""
        launched = self._launch(SchedulerOutput([(req, n)]))
        try:
            results, prompt = launched.finish(self.runner)
        except Exception as e:  # noqa: BLE001
            self._roll_back(launched)
            return e
        if prompt is not None:
            record_prompt_logprobs([(req, n)], launched.prep.starts, prompt)
        return results[0]

    def _fail(self, req: Request, e: Exception) -> RequestOutput:
        """Finish a request the engine failed on, freeing its blocks; its output carries the error."""
        logger.error("request %s failed: %s: %s", req.request_id, type(e).__name__, e)
        req.error = f"{type(e).__name__}: {e}"
        req.finish_reason = "error"
        if self.kv is not None:
            self.kv.forget(req.request_id)
        self.scheduler.finish(req)
        self.num_request_errors += 1
        self.requests.pop(req.request_id, None)
        self.detok.pop(req.request_id, None)
        for listener in self.finish_listeners:
            listener(req.request_id, "error")
        return req.to_output()

    def _check_stop(self, req: Request) -> None:
        sp = req.sampling_params
        tok = req.output_token_ids[-1]
        detok = self.detok[req.request_id]
        detok.update(req.output_token_ids)
        req.output_text = detok.text
        reason, cut = None, False
        if len(req.output_token_ids) < sp.min_tokens:
            pass  # no stop condition counts before min_tokens
        elif not sp.ignore_eos and tok in req.eos_token_ids:
            reason = "stop"
        elif tok in sp.stop_token_ids:
            reason = "stop"
        elif req.constrained and req.matcher.is_stopped():  # the constraint is complete
            reason = "stop"
        else:
            for s in sp.stop:
                at = req.output_text.find(s)
                if at >= 0:
                    req.output_text = req.output_text[:at]
                    reason, cut = "stop", True
                    break
        if reason is None and (
            len(req.output_token_ids) >= sp.max_tokens or req.num_tokens >= self.config.scheduler_config.max_model_len
        ):
            reason = "length"
        if reason:
            if not cut:  # the whole text, a trailing partial character included (as "\ufffd")
                req.output_text = detok.whole
            req.finish_reason = reason
            if req.kv_target is not None:  # a prefill instance: the prompt's KV to its decode instance first
                try:
                    self.kv.push(req.block_tables, req.kv_target)
                except Exception as e:  # noqa: BLE001 - the request fails, the engine serves on
                    req.error, req.finish_reason = f"{type(e).__name__}: {e}", "error"
                    self.num_request_errors += 1
            self.scheduler.finish(req)
