"""Runs an LLMEngine in its own thread so the HTTP loop never waits on a model step.

HTTP handlers validate and tokenize a request in their own thread (errors surface at once), then
hand it over through a short-lived lock; only the engine thread touches the engine's state. Each
request's outputs arrive on an asyncio queue, fed from the engine thread through the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from fastdeploy.engine.engine import LLMEngine
from fastdeploy.request import RequestOutput
from fastdeploy.sampling_params import SamplingParams

logger = logging.getLogger("fastdeploy")


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.pending: list = []  # requests for the engine thread to enqueue
        self.pending_aborts: list[str] = []
        self.stopped = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="fastdeploy-engine", daemon=True)
        self.thread.start()

    @property
    def healthy(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def add(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> asyncio.Queue:
        """Queue a request; ValueError (naming the problem) if the engine refuses it."""
        q: asyncio.Queue = asyncio.Queue()
        req = self.engine.make_request(prompt, params, request_id)
        with self.lock:
            self.pending.append(req)
            self.streams[request_id] = (asyncio.get_running_loop(), q)
            self.wake.notify()
        return q

    async def stream(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Outputs until the request finishes; aborts it if the consumer goes away."""
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.streams.pop(request_id, None)
            self.pending_aborts.append(request_id)
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

    def _take_pending(self) -> tuple[list, list[str]]:
        with self.lock:
            while not (self.stopped or self.pending or self.pending_aborts or self.engine.has_unfinished_requests()):
                self.wake.wait(timeout=0.5)
            reqs, aborts = self.pending, self.pending_aborts
            self.pending, self.pending_aborts = [], []
            return reqs, aborts

    def _loop(self) -> None:
        while not self.stopped:
            reqs, aborts = self._take_pending()
            for req in reqs:
                self.engine.enqueue(req)
            for rid in aborts:
                self.engine.abort_request(rid)
                logger.info("aborted request %s", rid)
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outs = self.engine.step()
            except BaseException as e:  # a broken step fails its requests, not the server
                logger.exception("engine step failed")
                self.error = e
                with self.lock:
                    for rid in list(self.streams):
                        self._deliver(RuntimeError(f"engine step failed: {e}"), rid)
                return
            with self.lock:
                for out in outs:
                    self._deliver(out, out.request_id)

    def shutdown(self) -> None:
        with self.lock:
            self.stopped = True
            self.wake.notify()
        self.thread.join(timeout=5)
