"""Tensor-parallel ranks over paddle.distributed (docs/design.md §4.9).

``TPGroup`` is what layers and the runner hold: this rank, the world size, and the collectives the
model uses (all_reduce, all_gather; NCCL on GPU, gloo on CPU), plus ``broadcast_object`` over a
CPU (gloo) group for the step's host arrays from the driver (rank 0). One rank is a TPGroup of
size 1 whose collectives are no-ops, so the single-device path is the same code.

Ranks come either from ``paddle.distributed.launch`` (its PADDLE_* environment; several nodes
possible) or from ``spawn_workers``, which starts ranks 1..N-1 of one node as child processes of
the driver with the same environment the launcher would give them, each beating into a pipe
the driver's watchdog reads (``start_beating``). The driver's TPGroup also ends them: it kills
them when a rank fails (``kill_workers``) and stops and reaps them at shutdown (``reap_workers``).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paddle

logger = logging.getLogger("fastdeploy")

LAUNCH_ENV = "PADDLE_TRAINERS_NUM"
BEAT_ENV = "FD_BEAT_FD"  # a spawned worker's liveness pipe (its write end's descriptor)
BEAT_S = 0.5  # seconds between a worker's beats (at most; a quarter of --dist-timeout if shorter)
COMPUTING, WAITING = b"c", b"w"  # a beat: the rank computed since its last beat, or only waited


class Activity:
    """Whether this rank is computing or waiting in a collective, as its beats tell the driver's
    watchdog: a step whose every rank only waits is hung, one where a rank computes is long."""

    def __init__(self) -> None:
        self.waiting = False  # inside a TPGroup collective now
        self.done = 0  # collectives finished
        self.seen = 0  # ``done`` at the last ``computed`` call

    @contextmanager
    def collective(self) -> Iterator[None]:
        self.waiting = True
        try:
            yield
        finally:
            self.waiting = False
            self.done += 1

    def computed(self) -> bool:
        """Whether this rank computed since the last call: it is outside a collective now, or
        it left one since."""
        left = self.done != self.seen
        self.seen = self.done
        return left or not self.waiting


@dataclass
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # tensor collectives: the default group
    cpu_group: Any = None  # host arrays: a gloo group
    workers: list = field(default_factory=list)  # child processes this driver started
    beats: list = field(default_factory=list)  # per worker, the read end of its liveness pipe
    activity: Activity = field(default_factory=Activity)  # this rank's, told by its beats
    src: int = 0  # the global rank of this group's driver (its rank 0), the source of broadcasts

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """[start, end) of this rank's part of n items; ValueError naming ``what`` if n does not divide."""
        if n % self.world_size:
            raise ValueError(f"{what}={n} does not divide over tensor_parallel_size={self.world_size}")
        k = n // self.world_size
        return self.rank * k, (self.rank + 1) * k

    def kill_workers(self) -> None:
        """Kill the worker processes this driver started that are still running."""
        for p in self.workers:
            if p.poll() is None:
                p.kill()

    def reap_workers(self, ask_to_stop: Callable[[], None], timeout: float = 10.0) -> None:
        """Stop the workers this driver started and reap them: ``ask_to_stop`` (the driver's
        message that ends their step loop) when any is running, then each gets ``timeout`` s to
        exit before it is killed."""
        running = [p for p in self.workers if p.poll() is None]
        if running:
            try:
                ask_to_stop()
            except Exception:  # noqa: BLE001 - a rank already gone; it is killed below
                logger.warning("could not reach the other ranks to stop them")
        for p in running:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.workers.clear()

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """Sum over ranks (in place on x; returns x). float32 on the wire for bf16 partial sums."""
        if self.world_size == 1:
            return x
        import paddle.distributed as dist

        with self.activity.collective():
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: paddle.Tensor, axis: int) -> paddle.Tensor:
        """Concatenate every rank's x (the same shape on each) along ``axis``, in rank order."""
        if self.world_size == 1:
            return x
        import paddle.distributed as dist

        parts: list[paddle.Tensor] = []
        with self.activity.collective():
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return paddle.concat(parts, axis=axis)

    def all_reduce_host(self, values: list[int]) -> list[int]:
        """Element-wise sum over ranks of a few host ints (over the CPU group)."""
        if self.world_size == 1:
            return list(values)
        import paddle.distributed as dist

        x = paddle.to_tensor(values, dtype="int64")
        with self.activity.collective():
            dist.all_reduce(x, group=self.cpu_group)
        return [int(v) for v in x.numpy()]

    def all_gather_last(self, x: paddle.Tensor) -> paddle.Tensor:
        """Concatenate every rank's x along the last axis, in rank order."""
        return self.all_gather(x, -1)

    def all_gather_rows(self, x: paddle.Tensor) -> paddle.Tensor:
        """Concatenate every rank's x along the first axis, in rank order."""
        return self.all_gather(x, 0)

    def reduce_scatter_rows(self, x: paddle.Tensor) -> paddle.Tensor:
        """This rank's 1 / world_size of the rows of the sum over ranks of x [world_size * n, ...]:
        NCCL's reduce-scatter; gloo has none, so there an all-reduce and this rank's slice (the
        same result, world_size times the bytes)."""
        if self.world_size == 1:
            return x
        import paddle.distributed as dist

        n = x.shape[0] // self.world_size
        if paddle.is_compiled_with_cuda():
            out = paddle.empty([n, *x.shape[1:]], x.dtype)
            with self.activity.collective():
                dist.reduce_scatter(out, list(x.split(self.world_size)), group=self.group)
            return out
        with self.activity.collective():
            dist.all_reduce(x, group=self.group)
        return x[self.rank * n : (self.rank + 1) * n]

    def broadcast(self, x: paddle.Tensor) -> paddle.Tensor:
        """The driver's x on every rank (in place on x, of the same shape everywhere; returns x):
        a device collective, queued behind the work before it like any kernel."""
        if self.world_size == 1:
            return x
        import paddle.distributed as dist

        with self.activity.collective():
            dist.broadcast(x, src=self.src, group=self.group)
        return x

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's obj (picklable), in rank order, on every rank (over the CPU group)."""
        if self.world_size == 1:
            return [obj]
        import paddle.distributed as dist

        out: list = []
        with self.activity.collective():
            dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def broadcast_object(self, obj: Any = None) -> Any:
        """The driver's obj on every rank (pickled through two broadcasts: length, then bytes)."""
        if self.world_size == 1:
            return obj
        import paddle.distributed as dist

        data = pickle.dumps(obj) if self.is_driver else b""
        n = paddle.to_tensor([len(data)], dtype="int64")
        with self.activity.collective():
            dist.broadcast(n, src=self.src, group=self.cpu_group)
            size = int(n.numpy()[0])
        buf = paddle.to_tensor(np.frombuffer(data, np.uint8)) if self.is_driver else paddle.zeros([size], "uint8")
        with self.activity.collective():
            dist.broadcast(buf, src=self.src, group=self.cpu_group)
        return obj if self.is_driver else pickle.loads(buf.numpy().tobytes())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, endpoints: list[str], master: str) -> dict[str, str]:
    """The environment paddle.distributed.launch gives a rank of one node."""
    return {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(world_size),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
        "PADDLE_MASTER": master,
        "PADDLE_GLOBAL_RANK": str(rank),
        "PADDLE_GLOBAL_SIZE": str(world_size),
        "PADDLE_LOCAL_RANK": str(rank),
        "PADDLE_LOCAL_SIZE": str(world_size),
        "PADDLE_RANK_IN_NODE": str(rank),
        "PADDLE_NNODES": "1",
        "PADDLE_DISTRI_BACKEND": "nccl" if paddle.is_compiled_with_cuda() else "gloo",
        "FLAGS_selected_gpus": str(rank),  # the launcher's: this rank's GPU (of those visible)
    }


def spawn_workers(world_size: int, worker_argv: list[str]) -> tuple[list[subprocess.Popen], list[int]]:
    """Start ranks 1..world_size-1 on this node (``python -m fastdeploy.worker.tp_worker ARGV``)
    and give this process rank 0's environment; each worker beats into a pipe whose write end it
    inherits (``BEAT_ENV``). Returns the processes and the pipes' read ends (non-blocking)."""
    endpoints = [f"127.0.0.1:{free_port()}" for _ in range(world_size)]
    master = f"127.0.0.1:{free_port()}"
    procs, beats = [], []
    for r in range(1, world_size):
        rd, wr = os.pipe()
        os.set_blocking(rd, False)
        env = {**os.environ, **rank_env(r, world_size, endpoints, master), BEAT_ENV: str(wr)}
        argv = [sys.executable, "-m", "fastdeploy.worker.tp_worker", *worker_argv]
        procs.append(subprocess.Popen(argv, env=env, pass_fds=(wr,)))
        os.close(wr)
        beats.append(rd)
    os.environ.update(rank_env(0, world_size, endpoints, master))
    return procs, beats


def start_beating(activity: Activity, interval: float = BEAT_S) -> None:
    """A worker started by ``spawn_workers``: write a byte into the liveness pipe every
    ``interval`` s from a thread of its own, so that the driver notices a process that is
    stopped (SIGSTOP, a debugger, a swapped-out host) even while no step runs; the byte says
    whether the rank computed since its last beat or only waited in a collective
    (``COMPUTING`` / ``WAITING``, from ``activity``). A no-op elsewhere."""
    fd = os.environ.pop(BEAT_ENV, None)
    if fd is None:
        return

    def beat() -> None:
        while True:
            try:
                os.write(int(fd), COMPUTING if activity.computed() else WAITING)
            except OSError:  # the driver is gone
                return
            time.sleep(interval)

    threading.Thread(target=beat, name="fastdeploy-beat", daemon=True).start()


def init_tensor_parallel(
    world_size: int, worker_argv: list[str] | None = None, activity: Activity | None = None
) -> TPGroup:
    """This process's TPGroup. Under paddle.distributed.launch the rank comes from its environment
    (and the world size must match); otherwise the driver starts the other ranks itself.
    ``activity``: the one this rank's beats already read (a new one if None)."""
    activity = activity or Activity()
    if world_size == 1:
        return TPGroup(activity=activity)
    workers, beats = [], []
    if LAUNCH_ENV not in os.environ:
        workers, beats = spawn_workers(world_size, worker_argv or [])
    launched = int(os.environ[LAUNCH_ENV])
    if launched != world_size:
        raise ValueError(f"tensor_parallel_size={world_size} but the launcher started {launched} ranks")
    import paddle.distributed as dist

    dist.init_parallel_env()
    # host arrays over gloo: on CPU the default group already is gloo (a second one only races)
    cpu = dist.new_group(list(range(world_size)), backend="gloo") if paddle.is_compiled_with_cuda() else None
    return TPGroup(dist.get_rank(), world_size, None, cpu, workers, beats, activity)


@dataclass
class Parallel:
    """This process's groups: ``tp`` its tensor-parallel group (the model split), ``ep`` the
    expert-parallel group (None: experts split over ``tp`` as the rest of the model), ``dp`` the
    data-parallel engine cores' drivers stepping together (None: this core steps alone; on
    other ranks of a core's TP group: None too)."""

    tp: TPGroup
    ep: TPGroup | None = None
    dp: TPGroup | None = None


def init_parallel(pc: Any, worker_argv: list[str] | None = None, activity: Activity | None = None) -> Parallel:
    """The groups of this process for ``pc`` (a ParallelConfig). Without expert parallelism over
    data-parallel cores, each core is a TP world of its own (``init_tensor_parallel``). With it
    (``pc.lockstep``), the front started every rank of one world of D x TP (core r's TP group is
    ranks r*TP .. r*TP + TP - 1, its driver r*TP): experts split over the world, host ints for the
    cores' lockstep over the drivers. Every rank creates every group, in the same order."""
    activity = activity or Activity()
    if not pc.lockstep:
        tp = init_tensor_parallel(pc.tensor_parallel_size, worker_argv, activity)
        ep = None
        if pc.enable_expert_parallel:  # one core: the experts' group is its TP group
            ep = TPGroup(tp.rank, tp.world_size, tp.group, tp.cpu_group, activity=activity)
        return Parallel(tp, ep)
    T, world = pc.tensor_parallel_size, pc.data_parallel_size * pc.tensor_parallel_size
    launched = int(os.environ.get(LAUNCH_ENV, "0"))
    if launched != world:
        raise ValueError(
            f"data_parallel_size x tensor_parallel_size = {world} ranks, but {launched or 'no'} were launched "
            "(the data-parallel front starts them)"
        )
    import paddle.distributed as dist

    dist.init_parallel_env()
    g = dist.get_rank()
    gpu = paddle.is_compiled_with_cuda()

    def group(ranks: list[int]) -> tuple[Any, Any]:  # (device collectives, host collectives)
        dev = dist.new_group(ranks)
        return dev, dist.new_group(ranks, backend="gloo") if gpu else dev

    world_cpu = dist.new_group(list(range(world)), backend="gloo") if gpu else None
    ep = TPGroup(g, world, None, world_cpu, activity=activity)
    tp = TPGroup(activity=activity)
    for r in range(pc.data_parallel_size):
        ranks = list(range(r * T, (r + 1) * T))
        dev, cpu = group(ranks) if T > 1 else (None, None)
        if g in ranks and T > 1:
            tp = TPGroup(g - r * T, T, dev, cpu, activity=activity, src=r * T)
    drivers = list(range(0, world, T))
    dp_dev, dp_cpu = group(drivers) if T > 1 else (None, world_cpu)
    dp = TPGroup(g // T, len(drivers), dp_dev, dp_cpu, activity=activity) if g % T == 0 else None
    return Parallel(tp, ep, dp)
