"""The driver's watchdog alone (no processes): liveness beats keep a worker alive past the
timeout; beats that stop are reported once, naming the rank, within the timeout plus a poll."""

import os
import threading
import time

from fastdeploy.distributed.watchdog import RankWatchdog


def test_beats_keep_a_rank_alive_and_their_absence_is_reported():
    pipes = [os.pipe() for _ in range(2)]
    for rd, _ in pipes:
        os.set_blocking(rd, False)
    stop = {1: threading.Event(), 2: threading.Event()}

    def beat(rank, wr):
        while not stop[rank].is_set():
            os.write(wr, b".")
            time.sleep(0.05)

    threads = [threading.Thread(target=beat, args=(r, wr), daemon=True) for r, (_, wr) in enumerate(pipes, 1)]
    for t in threads:
        t.start()
    failures = []
    dog = RankWatchdog([], lambda: None, 0.5, failures.append, interval=0.05, beats=[rd for rd, _ in pipes])
    try:
        time.sleep(1.2)  # over twice the timeout: both beat
        assert failures == []
        stop[2].set()
        t0 = time.monotonic()
        while not failures and time.monotonic() - t0 < 3:
            time.sleep(0.02)
        assert time.monotonic() - t0 < 0.5 + 0.3
        (why,) = failures
        assert "rank 2" in why and "liveness beat" in why and "--dist-timeout" in why
        time.sleep(0.3)
        assert len(failures) == 1  # reported once
    finally:
        dog.stop()
        stop[1].set()
        stop[2].set()
        for t in threads:
            t.join(1)
        for rd, wr in pipes:
            os.close(rd)
            os.close(wr)


def test_a_step_that_outlasts_the_timeout_is_reported():
    failures = []
    started = time.monotonic()
    dog = RankWatchdog([], lambda: started, 0.3, failures.append, interval=0.05)
    try:
        time.sleep(0.6)
        assert len(failures) == 1 and "--dist-timeout" in failures[0]
    finally:
        dog.stop()
