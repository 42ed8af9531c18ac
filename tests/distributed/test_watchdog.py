"""The driver's watchdog alone (no processes): liveness beats keep a worker alive past the
timeout; beats that stop are reported once, naming the rank, within the timeout plus a poll; a
step is hung only while no rank computes (``Activity``, the beats' bytes)."""

import os
import threading
import time

from fastdeploy.distributed.parallel import COMPUTING, WAITING, Activity
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
    """No beats (ranks a launcher started) and a driver that only waits: the step is hung."""
    failures = []
    started = time.monotonic()
    dog = RankWatchdog([], lambda: started, 0.3, failures.append, interval=0.05)
    try:
        time.sleep(0.6)
        assert len(failures) == 1 and "--dist-timeout" in failures[0]
    finally:
        dog.stop()


def test_activity_tells_computing_from_waiting():
    a = Activity()
    assert a.computed()  # outside any collective
    with a.collective():
        assert not a.computed()  # waiting since the last call
    assert a.computed()
    with a.collective():
        a.computed()
    with a.collective():  # left one collective and entered another since the last call
        assert a.computed()
        assert not a.computed()


def test_a_long_step_is_hung_only_once_no_rank_computes():
    """A step three times the timeout: the worker beats COMPUTING while the driver waits, then
    the driver computes while the worker beats WAITING: no failure. Then both only wait: one
    failure, within the timeout plus two polls, naming the wait."""
    rd, wr = os.pipe()
    os.set_blocking(rd, False)
    state = {"worker": COMPUTING, "driver": False}
    stop = threading.Event()

    def beat():
        while not stop.is_set():
            os.write(wr, state["worker"])
            time.sleep(0.05)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    failures = []
    started = time.monotonic()
    dog = RankWatchdog(
        [], lambda: started, 0.5, failures.append, interval=0.05, beats=[rd], driver_computed=lambda: state["driver"]
    )
    try:
        time.sleep(0.8)
        state.update(worker=WAITING, driver=True)
        time.sleep(0.8)
        assert failures == []
        state["driver"] = False
        t0 = time.monotonic()
        while not failures and time.monotonic() - t0 < 3:
            time.sleep(0.02)
        assert 0.4 < time.monotonic() - t0 < 0.5 + 0.3
        (why,) = failures
        assert "every rank" in why and "waited in a collective" in why and "--dist-timeout" in why
    finally:
        dog.stop()
        stop.set()
        thread.join(1)
        os.close(rd)
        os.close(wr)
