"""Prometheus metrics of the engine, through prometheus_client (as vLLM does).

Latency histograms are fed by the engine thread (``on_token``, ``on_finish``); counts the engine
and its block manager already keep (tokens, blocks, prefix hits, preemptions) are read at scrape
time by a collector. Each server has its own registry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import Metric

from fastdeploy.request import Request

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
LOG_INTERVAL_S = 10.0  # the speculative decoding log line's interval

logger = logging.getLogger("fastdeploy")


class SpecDecodeStats:
    """Speculative decoding's counts (docs/design.md §4.16), vLLM's: verify steps (``drafts``),
    draft tokens, accepted drafts, accepted drafts by position; a log line each LOG_INTERVAL_S
    with the mean accepted length (tokens a verify step adds: 1 + accepted drafts) since the last."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k
        self._logged = (time.monotonic(), 0, 0, 0)  # when, drafts, draft tokens, accepted then

    def record(self, drafts: int, accepted: int) -> None:
        """One request's verify step: ``drafts`` proposed, the first ``accepted`` of them kept."""
        self.num_drafts += 1
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def maybe_log(self, now: float) -> None:
        t, d, dt, a = self._logged
        if not self.k or now - t < LOG_INTERVAL_S or self.num_drafts == d:
            return
        nd, na = self.num_drafts - d, self.num_accepted_tokens - a
        logger.info(
            "speculative decoding: mean accepted length %.2f, %d verify steps, draft acceptance %.1f%%",
            1 + na / nd,
            nd,
            100 * na / max(1, self.num_draft_tokens - dt),
        )
        self._logged = (now, self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)


def _metric(name: str, doc: str, kind: str, value: float | dict[str, float], label: str = ""):
    """One family: the value, or (a dict) a sample per ``label`` value and no sum beside them
    (PromQL's sum() would count every part twice)."""
    m = Metric(f"fastdeploy:{name}", doc, kind)
    sample = f"fastdeploy:{name}" + ("_total" if kind == "counter" else "")
    for k, v in value.items() if isinstance(value, dict) else [(None, value)]:
        m.add_sample(sample, {} if k is None else {label: k}, v)
    return m


class EngineMetrics:
    """Fed by the engine after each produced token and each finished request; ``render`` gives
    the Prometheus text of /metrics."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.registry = CollectorRegistry()
        h = lambda name, doc, buckets: Histogram(  # noqa: E731
            f"fastdeploy:{name}", doc, buckets=buckets, registry=self.registry
        )
        self.ttft = h("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Arrival to last token of finished requests.", REQUEST_BUCKETS)
        self.queue = h("request_queue_time_seconds", "Arrival to first scheduled step.", REQUEST_BUCKETS)
        self.last_token_time: dict[str, float] = {}
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens = 0
        self.registry.register(self)

    def on_token(self, req: Request, now: float) -> None:
        with self.lock:
            prev = self.last_token_time.get(req.request_id)
            if prev is None:
                self.ttft.observe(now - req.arrival_time)
                if req.first_scheduled_time is not None:
                    self.queue.observe(req.first_scheduled_time - req.arrival_time)
                self.prompt_tokens += len(req.prompt_token_ids)
            else:
                self.itl.observe(now - prev)
            self.last_token_time[req.request_id] = now
        if req.is_finished:
            self.on_finish(req.request_id, req.finish_reason or "stop", now - req.arrival_time)

    def on_finish(self, request_id: str, reason: str, latency: float | None = None) -> None:
        """A request ended: stop / length after its last token, abort or error at any time."""
        with self.lock:
            self.last_token_time.pop(request_id, None)
            self.finished[reason] = self.finished.get(reason, 0) + 1
        if latency is not None:
            self.e2e.observe(latency)

    def collect(self) -> Iterator[Metric]:
        """Counts kept by the engine, read at scrape time (plain reads; a step may be mid-way)."""
        eng, bm = self.engine, self.engine.block_manager
        used = {g: p.num_used for g, p in bm.pools.items()}
        free = {g: p.num_free for g, p in bm.pools.items()}
        yield _metric("num_requests_running", "Requests being computed.", "gauge", len(eng.scheduler.running))
        yield _metric("num_requests_waiting", "Requests waiting to be scheduled.", "gauge", len(eng.scheduler.waiting))
        yield _metric("kv_cache_blocks_used", "KV cache blocks in use.", "gauge", used, "group")
        yield _metric("kv_cache_blocks_free", "KV cache blocks free.", "gauge", free, "group")
        yield _metric("generation_tokens", "Generated tokens.", "counter", eng.num_generated_tokens)
        with self.lock:
            prompt_tokens, finished = self.prompt_tokens, dict(self.finished)
        yield _metric("prompt_tokens", "Prompt tokens of requests that produced a token.", "counter", prompt_tokens)
        yield _metric(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "counter", bm.prefix_queries
        )
        yield _metric("prefix_cache_hits", "Prompt tokens served from the prefix cache.", "counter", bm.prefix_hits)
        hit_blocks = bm.prefix_hit_blocks
        yield _metric(
            "prefix_cache_hit_blocks",
            "KV blocks reused from the prefix cache.",
            "counter",
            hit_blocks,
            "group",
        )
        yield _metric(
            "swa_blocks_released", "SWA blocks released out of their window.", "counter", bm.swa_blocks_released
        )
        spec = eng.spec
        if spec.k:
            yield _metric(
                "spec_decode_num_drafts", "Speculative verify steps (one per request).", "counter", spec.num_drafts
            )
            yield _metric("spec_decode_num_draft_tokens", "Draft tokens proposed.", "counter", spec.num_draft_tokens)
            yield _metric(
                "spec_decode_num_accepted_tokens", "Draft tokens accepted.", "counter", spec.num_accepted_tokens
            )
            yield _metric(
                "spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in the draft.",
                "counter",
                {str(j): v for j, v in enumerate(spec.accepted_per_pos)},
                "position",
            )
        yield _metric("num_preemptions", "Requests preempted (recomputed later).", "counter", eng.num_preemptions)
        yield _metric("engine_errors", "Requests the engine failed on.", "counter", eng.num_request_errors)
        yield _metric(
            "request_success",
            "Finished requests by reason.",
            "counter",
            finished,
            "finished_reason",
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
