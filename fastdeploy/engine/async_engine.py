"""Runs an LLMEngine in its own thread so the HTTP loop never waits on a model step.

HTTP handlers add requests under a lock (validation errors surface at once) and read outputs
from a per-request asyncio queue, fed from the engine thread through the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.request import RequestOutput
from fastdeploy.engine.sampling_params import SamplingParams

logger = logging.getLogger("fastdeploy")


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
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
        with self.lock:
            self.engine.add_request(prompt, params, request_id)
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
            self.engine.abort_request(request_id)
            logger.info("aborted request %s", request_id)

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

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.stopped and not self.engine.has_unfinished_requests():
                    self.wake.wait(timeout=0.5)
                if self.stopped:
                    return
                try:
                    outs = self.engine.step()
                except BaseException as e:  # a broken step fails its requests, not the server
                    logger.exception("engine step failed")
                    self.error = e
                    for rid in list(self.streams):
                        self._deliver(RuntimeError(f"engine step failed: {e}"), rid)
                        self.engine.abort_request(rid)
                    return
                for out in outs:
                    self._deliver(out, out.request_id)

    def shutdown(self) -> None:
        with self.lock:
            self.stopped = True
            self.wake.notify()
        self.thread.join(timeout=5)
