"""Runs an LLMEngine in its own thread so the HTTP loop never waits on a model step.

HTTP handlers validate and tokenize a request off the event loop (errors surface at once), then
hand it over through a short-lived lock; only the engine thread touches the engine's state. Each
request's outputs arrive on an asyncio queue, fed from the engine thread through the event loop.

Failures: the engine pins a failed step to its requests (their outputs carry ``error``) and keeps
serving. If the engine thread itself dies, every waiting request gets an EngineDeadError at once,
new ones are refused with it, and ``on_fatal`` (the server's exit) is called.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

from fastdeploy.config import ModelConfig
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.kv_handoff import PrefillResult
from fastdeploy.engine.metrics import EngineMetrics
from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.request import Request, RequestOutput
from fastdeploy.sampling_params import SamplingParams

logger = logging.getLogger("fastdeploy")


class EngineDeadError(RuntimeError):
    """The engine thread stopped; nothing more can be served."""


class ServerDrainingError(RuntimeError):
    """The server is shutting down and takes no new requests."""


class AsyncLLMEngine:
    """All that serving sees of the engine: ``make_request`` (any thread), ``add`` / ``stream`` /
    ``abort`` of requests, the tokenizer, the model's config and limits, and the metrics."""

    def __init__(self, engine: LLMEngine, on_fatal: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.on_fatal = on_fatal
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.pending: list[Request] = []  # requests for the engine thread to enqueue
        self.pending_aborts: list[tuple[str, BaseException | None]] = []
        self.pending_calls: list[tuple[Callable, Future]] = []  # run on the engine thread (``call``)
        self.stopped = False
        self.draining = False
        self.error: BaseException | None = None
        engine.fatal_listeners.append(self._fail_all)
        self.metrics = EngineMetrics(engine)
        engine.step_listeners.append(self.metrics.on_token)
        engine.finish_listeners.append(self.metrics.on_finish)
        self.thread = threading.Thread(target=self._loop, name="fastdeploy-engine", daemon=True)
        self.thread.start()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.config.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.config.scheduler_config.max_model_len

    @property
    def enable_prefix_caching(self) -> bool:
        return self.engine.config.cache_config.enable_prefix_caching

    def make_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, param: str = "prompt"
    ) -> Request:
        """A validated, tokenized request (``LLMEngine.make_request``; touches no engine state, so
        any thread may call it); hand it to ``add``."""
        return self.engine.make_request(prompt, params, request_id, param)

    @property
    def healthy(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def add(self, req: Request) -> asyncio.Queue:
        """Queue a request made by ``engine.make_request``; EngineDeadError / ServerDrainingError
        when it cannot be served."""
        q: asyncio.Queue = asyncio.Queue()
        with self.lock:
            if not self.healthy:
                raise EngineDeadError(f"the engine stopped: {self.error!r}")
            if self.draining:
                raise ServerDrainingError("the server is shutting down")
            self.pending.append(req)
            self.streams[req.request_id] = (asyncio.get_running_loop(), q)
            self.wake.notify()
        return q

    async def stream(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Outputs until the request finishes; aborts it if the consumer goes away."""
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Abort a request; with ``error``, its consumer gets that error first."""
        with self.lock:
            if error is not None:
                self._deliver(error, request_id)
            self.streams.pop(request_id, None)
            self.pending_aborts.append((request_id, error))
            self.wake.notify()

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        entry = self.streams.get(request_id)
        if entry is None:
            return
        loop, q = entry
        if isinstance(out, BaseException) or out.finished:
            self.streams.pop(request_id, None)
        try:
            loop.call_soon_threadsafe(q.put_nowait, out)
        except RuntimeError:  # the loop is gone (shutdown)
            pass

    def call(self, fn: Callable):
        """``fn(engine)`` run on the engine thread, between steps; its result, or what it raised
        (any thread but the engine's; EngineDeadError once the engine is gone)."""
        return self._post(fn).result()

    def _post(self, fn: Callable, stream: tuple[str, asyncio.Queue] | None = None) -> Future:
        """Queue ``fn(engine)`` for the engine thread (with ``stream``: that request's outputs
        go to that queue); its future. EngineDeadError once the engine is gone."""
        done: Future = Future()
        with self.lock:
            if not self.healthy:
                raise EngineDeadError(f"the engine stopped: {self.error!r}")
            if stream is not None:
                self.streams[stream[0]] = (asyncio.get_running_loop(), stream[1])
            self.pending_calls.append((fn, done))
            self.wake.notify()
        return done

    def add_committed(self, req: Request, handed: PrefillResult) -> asyncio.Queue:
        """A request ``reserve``d on this (decode) instance whose prompt's KV has arrived with
        what the prefill ``handed`` over (``LLMEngine.commit``): it runs on; its outputs on the
        queue, as ``add``'s."""
        q: asyncio.Queue = asyncio.Queue()

        def commit(engine) -> None:
            try:
                out = engine.commit(req.request_id, handed)
            except KeyError:
                out = ValueError(f"kv_transfer_params: request {req.request_id} is not reserved here (expired?)")
            self._deliver(out, req.request_id)

        self._post(commit, (req.request_id, q))
        return q

    def _take_pending(self) -> tuple[list[Request], list[tuple[str, BaseException | None]], list]:
        with self.lock:
            while not (
                self.stopped
                or self.pending
                or self.pending_aborts
                or self.pending_calls
                or self.engine.has_unfinished_requests()
            ):
                if not self.wake.wait(timeout=0.5) and getattr(self.engine, "parked", None):
                    break  # reserved requests to expire
            taken = self.pending, self.pending_aborts, self.pending_calls
            self.pending, self.pending_aborts, self.pending_calls = [], [], []
            return taken

    def _loop(self) -> None:
        try:
            while not self.stopped:
                reqs, aborts, calls = self._take_pending()
                for fn, done in calls:
                    try:
                        result = fn(self.engine)
                    except Exception as e:  # noqa: BLE001 - the caller's to handle
                        done.set_exception(e)
                    else:
                        done.set_result(result)
                if getattr(self.engine, "parked", None):
                    for rid in self.engine.expire_parked():
                        with self.lock:
                            self._deliver(TimeoutError(f"request {rid}: its prompt's KV did not arrive in time"), rid)
                for req in reqs:
                    try:
                        self.engine.enqueue(req)
                    except ValueError as e:  # e.g. a request id already in use: that request only
                        with self.lock:
                            self._deliver(e, req.request_id)
                for rid, _ in aborts:
                    if self.engine.abort_request(rid):  # asked twice (a client gone, its stream closed): logged once
                        logger.info("aborted request %s", rid)
                if not self.engine.has_unfinished_requests():
                    continue
                outs = self.engine.step()
                with self.lock:
                    for out in outs:
                        self._deliver(out, out.request_id)
        except BaseException as e:  # noqa: BLE001 - the engine is broken: fail everyone, let the server exit
            logger.exception("the engine thread died")
            self._fail_all(e)

    def _fail_all(self, e: BaseException) -> None:
        """The engine cannot go on: every waiting request gets EngineDeadError, then on_fatal."""
        with self.lock:
            self.error = e
            for rid in list(self.streams):
                self._deliver(EngineDeadError(f"the engine stopped: {e!r}"), rid)
        if self.on_fatal is not None:
            self.on_fatal()

    def num_in_flight(self) -> int:
        with self.lock:
            return len(self.streams) + len(self.pending)

    def drain(self, timeout: float) -> int:
        """Refuse new requests, let in-flight ones finish for up to ``timeout`` seconds, then abort
        the rest with ServerDrainingError to each consumer; returns how many were aborted."""
        with self.lock:
            self.draining = True
        deadline = time.monotonic() + timeout
        while self.num_in_flight() and time.monotonic() < deadline and self.healthy:
            time.sleep(0.05)
        with self.lock:
            left = list(self.streams)
        for rid in left:
            self.abort(rid, ServerDrainingError(f"the server shut down before the request finished ({timeout:g} s)"))
        return len(left)

    def shutdown(self) -> None:
        with self.lock:
            self.stopped = True
            self.wake.notify()
        self.thread.join(timeout=5)
