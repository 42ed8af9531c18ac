"""The driver's watch over the other ranks, reported once through ``on_failure``: a worker process
that exits; a worker whose liveness beats (``parallel.start_beating``) stop for ``dist_timeout``
seconds (stopped, even between steps); or a step in which no rank has computed for
``dist_timeout`` seconds, every one only waiting in a collective (a rank that stopped answering
leaves the others blocked there). A step that is long because a rank computes (a long prefill on
CPU) is not a failure: each beat says whether its rank computed since the last one, and the
driver knows its own state (``driver_computed``)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable

from fastdeploy.distributed.parallel import COMPUTING


class RankWatchdog:
    """``workers`` the spawned ranks 1..N-1; ``beats`` the read ends of their liveness pipes (by
    rank - 1; none for ranks a launcher started); ``step_started`` the monotonic time the running
    step began (None between steps); ``driver_computed`` whether the driver computed since the
    last call (``parallel.Activity.computed``; None: taken as waiting); ``names`` how a failure
    names each worker (default "tensor-parallel rank R")."""

    def __init__(
        self,
        workers: list[subprocess.Popen],
        step_started: Callable[[], float | None],
        timeout: float,
        on_failure: Callable[[str], None],
        interval: float = 0.2,
        beats: list[int] | None = None,
        driver_computed: Callable[[], bool] | None = None,
        names: list[str] | None = None,
    ) -> None:
        self.workers, self.step_started, self.timeout = workers, step_started, timeout
        n = max(len(workers), len(beats or []))
        self.names = names or [f"tensor-parallel rank {r}" for r in range(1, n + 1)]
        self.on_failure, self.interval = on_failure, interval
        self.driver_computed = driver_computed or (lambda: False)
        self.beats = list(beats or [])
        now = time.monotonic()
        self.last_beat = [now] * len(self.beats)
        self.last_computed = [now] * (len(self.beats) + 1)  # the driver's, then each worker's
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fastdeploy-rank-watchdog", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            if (why := self.check(time.monotonic())) is not None:
                return self.on_failure(why)

    def check(self, now: float) -> str | None:
        """One poll: read the beats; the failure to report, if any."""
        for rank, p in enumerate(self.workers, start=1):
            if p.poll() is not None:
                return f"{self.names[rank - 1]} exited with status {p.returncode}"
        if self.driver_computed():
            self.last_computed[0] = now
        for rank, fd in enumerate(self.beats, start=1):
            try:
                got = os.read(fd, 4096)
            except BlockingIOError:
                got = b""
            if got:
                self.last_beat[rank - 1] = now
                if COMPUTING in got:
                    self.last_computed[rank] = now
            if now - self.last_beat[rank - 1] > self.timeout:
                return (
                    f"{self.names[rank - 1]} sent no liveness beat for over {self.timeout:g} s "
                    "(stopped or hung; --dist-timeout)"
                )
        started = self.step_started()
        if started is not None and now - max(started, *self.last_computed) > self.timeout:
            return (
                f"every rank of a step has waited in a collective for over {self.timeout:g} s, none computing "
                "(a rank stopped answering; --dist-timeout)"
            )
        return None

    def stop(self) -> None:
        self.stopped.set()
