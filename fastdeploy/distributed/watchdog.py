"""The driver's watch over the other ranks: a worker process that exits, or a step that does not
finish within ``dist_timeout`` seconds (a rank that stopped answering leaves the driver blocked in
a collective), is reported once through ``on_failure``."""

from __future__ import annotations

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
    ) -> None:
        self.workers, self.step_started, self.timeout = workers, step_started, timeout
        self.on_failure, self.interval = on_failure, interval
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fastdeploy-rank-watchdog", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            for rank, p in enumerate(self.workers, start=1):
                if p.poll() is not None:
                    return self.on_failure(f"tensor-parallel rank {rank} exited with status {p.returncode}")
            started = self.step_started()
            if started is not None and time.monotonic() - started > self.timeout:
                return self.on_failure(
                    f"a step has waited on the other ranks for over {self.timeout:g} s (--dist-timeout)"
                )

    def stop(self) -> None:
        self.stopped.set()
