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


def _metric(name: str, doc: str, kind: str, samples: list[tuple[dict[str, str], float]]) -> Metric:
    """One family of (labels, value) samples; a family split by a label has no sum beside its
    parts (PromQL's sum() would count every part twice)."""
    m = Metric(f"fastdeploy:{name}", doc, kind)
    sample = f"fastdeploy:{name}" + ("_total" if kind == "counter" else "")
    for labels, v in samples:
        m.add_sample(sample, labels, v)
    return m


def engine_stats(engine) -> dict:
    """The counts an engine and its block manager keep, read now (plain reads; a step may be
    mid-way): plain numbers, or {label value: number} for ``BY_LABEL``'s keys."""
    bm, spec = engine.block_manager, engine.spec
    return {
        "num_requests_running": len(engine.scheduler.running),
        "num_requests_waiting": len(engine.scheduler.waiting),
        "kv_cache_blocks_used": {g: p.num_used for g, p in bm.pools.items()},
        "kv_cache_blocks_free": {g: p.num_free for g, p in bm.pools.items()},
        "generation_tokens": engine.num_generated_tokens,
        "prefix_cache_queries": bm.prefix_queries,
        "prefix_cache_hits": bm.prefix_hits,
        "prefix_cache_hit_blocks": dict(bm.prefix_hit_blocks),
        "swa_blocks_released": bm.swa_blocks_released,
        "spec_decode_num_drafts": spec.num_drafts,
        "spec_decode_num_draft_tokens": spec.num_draft_tokens,
        "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
        "spec_decode_num_accepted_tokens_per_pos": {str(j): v for j, v in enumerate(spec.accepted_per_pos)},
        "num_preemptions": engine.num_preemptions,
        "engine_errors": engine.num_request_errors,
    }


# name: (kind, help, the label of a {label value: number} stat or None)
ENGINE_FAMILIES = {
    "num_requests_running": ("gauge", "Requests being computed.", None),
    "num_requests_waiting": ("gauge", "Requests waiting to be scheduled.", None),
    "kv_cache_blocks_used": ("gauge", "KV cache blocks in use.", "group"),
    "kv_cache_blocks_free": ("gauge", "KV cache blocks free.", "group"),
    "generation_tokens": ("counter", "Generated tokens.", None),
    "prefix_cache_queries": ("counter", "Prompt tokens looked up in the prefix cache.", None),
    "prefix_cache_hits": ("counter", "Prompt tokens served from the prefix cache.", None),
    "prefix_cache_hit_blocks": ("counter", "KV blocks reused from the prefix cache.", "group"),
    "swa_blocks_released": ("counter", "SWA blocks released out of their window.", None),
    "spec_decode_num_drafts": ("counter", "Speculative verify steps (one per request).", None),
    "spec_decode_num_draft_tokens": ("counter", "Draft tokens proposed.", None),
    "spec_decode_num_accepted_tokens": ("counter", "Draft tokens accepted.", None),
    "spec_decode_num_accepted_tokens_per_pos": (
        "counter",
        "Draft tokens accepted, by position in the draft.",
        "position",
    ),
    "num_preemptions": ("counter", "Requests preempted (recomputed later).", None),
    "engine_errors": ("counter", "Requests the engine failed on.", None),
}


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
        """Counts kept by the engine (each data-parallel core's, labelled ``dp_rank``), read at
        scrape time, then the finished requests and prompt tokens counted here."""
        ranks = self.engine.rank_stats()
        spec = self.engine.config.speculative_config.k
        for name, (kind, doc, label) in ENGINE_FAMILIES.items():
            if name.startswith("spec_decode") and not spec:
                continue
            samples = []
            for labels, stats in ranks:
                v = stats[name]
                parts = v.items() if label else [(None, v)]
                samples += [({**labels, label: k} if label else labels, x) for k, x in parts]
            yield _metric(name, doc, kind, samples)
        with self.lock:
            prompt_tokens, finished = self.prompt_tokens, dict(self.finished)
        yield _metric(
            "prompt_tokens", "Prompt tokens of requests that produced a token.", "counter", [({}, prompt_tokens)]
        )
        yield _metric(
            "request_success",
            "Finished requests by reason.",
            "counter",
            [({"finished_reason": k}, v) for k, v in finished.items()],
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
