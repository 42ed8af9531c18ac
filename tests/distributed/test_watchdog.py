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


class Proc:
    """A worker process as the watchdog sees it: ``poll`` gives its exit status, None while it runs."""

    def __init__(self, status=None):
        self.returncode = status

    def poll(self):
        return self.returncode


def test_an_exited_rank_is_named_and_a_running_one_is_not():
    failures = []
    dog = RankWatchdog([Proc(), Proc()], lambda: None, 5.0, failures.append)  # the default poll interval
    try:
        time.sleep(0.5)
        assert failures == []  # both run
        dog.workers[1].returncode = -9
        t0 = time.monotonic()
        while not failures and time.monotonic() - t0 < 3:
            time.sleep(0.02)
        assert time.monotonic() - t0 < 0.45  # found within one default poll (0.2 s) and some slack
        assert failures == ["tensor-parallel rank 2 exited with status -9"]
    finally:
        dog.stop()


def test_the_timeouts_start_after_exactly_dist_timeout():
    """``check`` at given times (the watchdog's own thread polls once an hour here): silent for
    exactly the timeout is not yet a failure, a moment more is; the messages in full."""
    rd, wr = os.pipe()
    os.set_blocking(rd, False)
    try:
        dog = RankWatchdog([], lambda: None, 2.0, lambda why: None, interval=3600, beats=[rd])
        t0 = dog.last_beat[0]
        assert dog.check(t0 + 2.0) is None
        assert dog.check(t0 + 2.001) == (
            "tensor-parallel rank 1 sent no liveness beat for over 2 s (stopped or hung; --dist-timeout)"
        )
        dog.stop()
        started = float(int(time.monotonic()) + 5)  # a step that starts after the watchdog; + 2.0 is exact
        dog = RankWatchdog([], lambda: started, 2.0, lambda why: None, interval=3600)
        assert dog.check(started + 2.0) is None
        assert dog.check(started + 2.001) == (
            "every rank of a step has waited in a collective for over 2 s, none computing "
            "(a rank stopped answering; --dist-timeout)"
        )
        dog.stop()
    finally:
        os.close(rd)
        os.close(wr)


def test_a_computing_driver_without_beats_keeps_a_long_step_alive():
    """Ranks a launcher started send no beats: the driver's own state is the only one."""
    state = {"computing": True}
    failures = []
    started = time.monotonic()
    dog = RankWatchdog(
        [], lambda: started, 0.3, failures.append, interval=0.05, driver_computed=lambda: state["computing"]
    )
    try:
        time.sleep(0.8)
        assert failures == []
        state["computing"] = False
        time.sleep(0.6)
        assert len(failures) == 1 and "every rank" in failures[0]
    finally:
        dog.stop()


def test_a_watchdog_never_keeps_the_process_alive():
    """A watchdog here stops when asked; a process that exits without stopping its watchdog
    exits at once (the thread is a daemon)."""
    import subprocess
    import sys

    here = RankWatchdog([], lambda: None, 60.0, print, interval=0.05)
    here.stop()
    here.thread.join(timeout=5)
    assert not here.thread.is_alive()

    code = (
        "from fastdeploy.distributed.watchdog import RankWatchdog\n"
        "RankWatchdog([], lambda: None, 60.0, print, interval=0.05)\n"
    )
    import fastdeploy

    root = os.path.dirname(os.path.dirname(os.path.abspath(fastdeploy.__file__)))  # the code under test
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-c", code], timeout=20, capture_output=True, env={**os.environ, "PYTHONPATH": root}
    )
    assert p.returncode == 0 and time.monotonic() - t0 < 15
