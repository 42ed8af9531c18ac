"""The driver's watch over the other ranks: a worker process that exits, a worker whose liveness
beats (``parallel.start_beating``) stop for ``dist_timeout`` seconds (stopped, even between
steps), or a step that does not finish within ``dist_timeout`` seconds (a rank that stopped
answering leaves the driver blocked in a collective) is reported once through ``on_failure``."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable


class RankWatchdog:
    def __init__(
        self,
        workers: list[subprocess.Popen],
        step_started: Callable[[], float | None],
        timeout: float,
        on_failure: Callable[[str], None],
        interval: float = 0.2,
        beats: list[int] | None = None,
    ) -> None:
        self.workers, self.step_started, self.timeout = workers, step_started, timeout
        self.on_failure, self.interval = on_failure, interval
        self.beats = list(beats or [])  # read ends of the workers' liveness pipes, by rank - 1
        self.last_beat = [time.monotonic()] * len(self.beats)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fastdeploy-rank-watchdog", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            for rank, p in enumerate(self.workers, start=1):
                if p.poll() is not None:
                    return self.on_failure(f"tensor-parallel rank {rank} exited with status {p.returncode}")
            now = time.monotonic()
            for i, fd in enumerate(self.beats):
                try:
                    if os.read(fd, 4096):
                        self.last_beat[i] = now
                except BlockingIOError:
                    pass
                if now - self.last_beat[i] > self.timeout:
                    return self.on_failure(
                        f"tensor-parallel rank {i + 1} sent no liveness beat for over {self.timeout:g} s "
                        "(stopped or hung; --dist-timeout)"
                    )
            started = self.step_started()
            if started is not None and time.monotonic() - started > self.timeout:
                return self.on_failure(
                    f"a step has waited on the other ranks for over {self.timeout:g} s (--dist-timeout)"
                )

    def stop(self) -> None:
        self.stopped.set()
