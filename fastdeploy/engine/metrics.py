"""Prometheus text metrics of the engine (no client library needed)."""

from __future__ import annotations

import threading

from fastdeploy.request import Request

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * len(buckets)
        self.total, self.n = 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.total += v
        self.n += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        out += [f'{self.name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)]
        out += [
            f'{self.name}_bucket{{le="+Inf"}} {self.n}',
            f"{self.name}_sum {self.total}",
            f"{self.name}_count {self.n}",
        ]
        return out


class EngineMetrics:
    """Fed by the engine after each produced token (``on_token``); rendered for /metrics."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft = Histogram("fastdeploy:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = Histogram("fastdeploy:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.last_token_time: dict[str, float] = {}
        self.finished = {"stop": 0, "length": 0, "abort": 0}
        self.prompt_tokens = 0

    def on_token(self, req: Request, now: float) -> None:
        with self.lock:
            prev = self.last_token_time.get(req.request_id)
            if prev is None:
                self.ttft.observe(now - req.arrival_time)
                self.prompt_tokens += len(req.prompt_token_ids)
            else:
                self.itl.observe(now - prev)
            self.last_token_time[req.request_id] = now
            if req.is_finished:
                self.last_token_time.pop(req.request_id, None)
                self.finished[req.finish_reason or "stop"] = self.finished.get(req.finish_reason or "stop", 0) + 1

    def on_abort(self, request_id: str) -> None:
        with self.lock:
            self.last_token_time.pop(request_id, None)
            self.finished["abort"] += 1

    def render(self, engine) -> str:
        bm = engine.block_manager
        gauges = [
            ("num_requests_running", "Requests being computed.", len(engine.scheduler.running)),
            ("num_requests_waiting", "Requests waiting to be scheduled.", len(engine.scheduler.waiting)),
            ("kv_cache_blocks_used", "KV cache blocks in use.", bm.num_used_blocks),
            ("kv_cache_blocks_free", "KV cache blocks free.", bm.num_free_blocks),
        ]
        counters = [
            ("generation_tokens_total", "Generated tokens.", engine.num_generated_tokens),
            ("prompt_tokens_total", "Prompt tokens of requests that produced a token.", self.prompt_tokens),
            ("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", bm.prefix_queries),
            ("prefix_cache_hits_total", "Prompt tokens served from the prefix cache.", bm.prefix_hits),
        ]
        counters.append(
            ("swa_blocks_released_total", "SWA blocks released out of their window.", bm.swa_blocks_released)
        )
        per_group = {  # the unlabeled series above is the sum over groups
            ("kv_cache_blocks_used", "gauge"): {g: p.num_used for g, p in bm.pools.items()},
            ("kv_cache_blocks_free", "gauge"): {g: p.num_free for g, p in bm.pools.items()},
        }
        lines = []
        for kind, rows in (("gauge", gauges), ("counter", counters)):
            for name, doc, v in rows:
                lines += [
                    f"# HELP fastdeploy:{name} {doc}",
                    f"# TYPE fastdeploy:{name} {kind}",
                    f"fastdeploy:{name} {v}",
                ]
                lines += [f'fastdeploy:{name}{{group="{g}"}} {n}' for g, n in per_group.get((name, kind), {}).items()]
        lines += [
            "# HELP fastdeploy:prefix_cache_hit_blocks_total KV blocks reused from the prefix cache, per group.",
            "# TYPE fastdeploy:prefix_cache_hit_blocks_total counter",
        ]
        lines += [
            f'fastdeploy:prefix_cache_hit_blocks_total{{group="{g}"}} {n}' for g, n in bm.prefix_hit_blocks.items()
        ]
        lines += [
            "# HELP fastdeploy:request_success_total Finished requests by reason.",
            "# TYPE fastdeploy:request_success_total counter",
        ]
        with self.lock:
            lines += [
                f'fastdeploy:request_success_total{{finished_reason="{k}"}} {v}' for k, v in self.finished.items()
            ]
            lines += self.ttft.render() + self.itl.render()
        return "\n".join(lines) + "\n"
