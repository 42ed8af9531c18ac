"""The data-parallel front: one engine interface over D engine-core processes (docs/design.md
§4.19; vLLM's DP coordinator and SGLang's DP controller, in small).

``DPEngine`` makes and checks requests as ``LLMEngine`` does (it holds the tokenizer, no model),
routes each to a core (``Router``: longest routed prefix, then least loaded; the samples of one
prompt to one core), forwards aborts, and turns the cores' messages into the outputs, metrics
and listener calls an LLMEngine gives, so ``LLM`` and the API server run on either. It starts
the processes itself: D cores (``dp_core``), and under expert parallelism one paddle world of
D x TP ranks (core r is global rank r x TP; the other ranks of its TP group are
``tp_worker`` processes). Every process beats into a pipe the front's ``RankWatchdog`` reads; a
process that exits, stops beating or hangs with every rank waiting takes the TP failure path:
clients told, every process killed, exit 1 (``exit_on_rank_failure``).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import AuthenticationError, Connection, Listener, wait

from fastdeploy.distributed.parallel import BEAT_ENV, LAUNCH_ENV, free_port, rank_env
from fastdeploy.distributed.watchdog import RankWatchdog
from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.dp_core import authkey, front_address
from fastdeploy.engine.dp_messages import CoreRequest
from fastdeploy.engine.dp_router import Router
from fastdeploy.engine.engine import LLMEngine, RequestMaker, exit_on_rank_failure
from fastdeploy.request import Request, RequestOutput, RequestStatus
from fastdeploy.worker.kv_sizing import on_gpu
from fastdeploy.worker.tp_worker import encode_config

logger = logging.getLogger("fastdeploy")

STEP_WAIT_S = 0.05  # the longest ``step`` waits for a core's message


def create_engine(args: EngineArgs) -> LLMEngine | DPEngine:
    """The engine ``args`` ask for: one core, or a front over data_parallel_size of them."""
    return DPEngine(args) if args.data_parallel_size > 1 else LLMEngine(args)


class DPEngine(RequestMaker):
    """The engine interface over ``data_parallel_size`` engine-core processes it starts, feeds
    and watches: ``make_request`` / ``enqueue`` / ``abort_request`` / ``step`` /
    ``has_unfinished_requests``, the listeners, ``rank_stats`` and ``shutdown``."""

    def __init__(self, args: EngineArgs) -> None:
        super().__init__(args.create_config())
        sc, pc = self.config.scheduler_config, self.config.parallel_config
        self.fatal_listeners: list = []  # callables(exception) when a core fails
        self.step_listeners: list = []  # callables(request, now) for each request's new tokens
        self.finish_listeners: list = []  # callables(request_id, reason) for aborted or failed requests
        self._failing, self._failed = threading.Lock(), False
        self.requests: dict[str, Request] = {}  # this front's copy of each unfinished request
        self.rank_of: dict[str, int] = {}
        self.router = Router(pc.data_parallel_size, self.config.cache_config.block_size, sc.max_num_seqs)
        self.core_stats: list[dict] = [{} for _ in range(pc.data_parallel_size)]
        self.waiting_since: float | None = None  # the last core message while requests are out
        self.watchdog = None
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection | None] = []  # by data-parallel rank
        self.listener: Listener | None = None  # under a launcher: where the other cores connect
        self.accepted: list[Connection] = []
        self.inbox: queue.Queue = queue.Queue()  # (core, message), from the reader threads
        self.stopping = False
        try:
            beats, names = self._spawn()
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        for rank, conn in enumerate(self.conns):
            threading.Thread(target=self._read, args=(rank, conn), name=f"fastdeploy-dp-{rank}", daemon=True).start()
        self.watchdog = RankWatchdog(
            self.procs, self._step_started, pc.dist_timeout, self._rank_failed, beats=beats, names=names
        )
        atexit.register(self.shutdown)

    def _spawn(self) -> tuple[list[int], list[str]]:
        """Start every process (under paddle.distributed.launch only core 0, with this process's
        rank-0 environment: the launcher started the others, whose cores connect to
        ``listener``); returns the read ends of their beat pipes and their names."""
        pc = self.config.parallel_config
        T = pc.tensor_parallel_size
        world = pc.data_parallel_size * (T if pc.lockstep else 1)
        self.conns = [None] * pc.data_parallel_size
        if LAUNCH_ENV in os.environ:
            if not pc.lockstep:
                raise ValueError(
                    "data_parallel_size under paddle.distributed.launch needs enable_expert_parallel (one world of "
                    "D x TP ranks); for replicas, start one server a replica"
                )
            if int(os.environ[LAUNCH_ENV]) != pc.data_parallel_size * T:
                raise ValueError(
                    f"data_parallel_size x tensor_parallel_size = {pc.data_parallel_size * T} ranks, but the "
                    f"launcher started {os.environ[LAUNCH_ENV]}"
                )
            self.listener = Listener(front_address(pc), authkey=authkey())
            threading.Thread(target=self._accept, name="fastdeploy-dp-accept", daemon=True).start()
            world = 1
        step = T if pc.lockstep else 1  # global ranks a core apart
        word, pid = encode_config(self.config), str(os.getpid())
        endpoints = [f"127.0.0.1:{free_port()}" for _ in range(world)]
        master = f"127.0.0.1:{free_port()}"
        launch_keys = set(rank_env(0, 1, ["-"], "-"))
        beats, names = [], []
        for g in range(world):
            rd, wr = os.pipe()
            os.set_blocking(rd, False)
            env = {**os.environ, BEAT_ENV: str(wr)}
            if pc.lockstep and self.listener is None:
                env.update(rank_env(g, world, endpoints, master))
            elif not pc.lockstep:  # a replica: its own TP world, on its own GPUs (numbered from 0 inside it)
                env = {k: v for k, v in env.items() if k not in launch_keys}
                if on_gpu():
                    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(world * T)))).split(",")
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[g * T : (g + 1) * T])
            fds = [wr]
            if g % step == 0:
                front, core = socket.socketpair()
                argv = ["fastdeploy.engine.dp_core", "--conn", str(core.fileno()), "--front-pid", pid]
                fds.append(core.fileno())
                names.append(f"data-parallel engine core {g // step}")
            else:
                argv = ["fastdeploy.worker.tp_worker", "--driver-pid", pid]
                names.append(f"rank {g % step} of data-parallel engine core {g // step}")
            self.procs.append(subprocess.Popen([sys.executable, "-m", *argv, "--config", word], env=env, pass_fds=fds))
            os.close(wr)
            beats.append(rd)
            if g % step == 0:
                core.close()
                self.conns[g // step] = Connection(front.detach())
        return beats, names

    def _accept(self) -> None:
        """Under a launcher: take the cores' connections until the listener closes."""
        while True:
            try:
                self.accepted.append(self.listener.accept())
            except AuthenticationError:
                logger.warning("a connection to the data-parallel front failed authentication (FD_DP_AUTHKEY)")
            except OSError:
                return

    def _wait_ready(self) -> None:
        """Each core's "hello" (a launched core's connection: its rank) and "ready" (its stats);
        RuntimeError naming a process that exits, or a core that hangs up, first."""
        ready: set[int] = set()
        unknown: list[Connection] = []  # launched cores' connections before their hello
        while len(ready) < len(self.conns):
            while self.accepted:
                unknown.append(self.accepted.pop())
            live = [c for r, c in enumerate(self.conns) if c is not None and r not in ready] + unknown
            for conn in wait(live, timeout=0.2):
                try:
                    msg = conn.recv()
                except EOFError:
                    if conn in unknown:  # not a core yet: a stray
                        unknown.remove(conn)
                        continue
                    raise RuntimeError(
                        f"data-parallel engine core {self.conns.index(conn)} hung up while starting"
                    ) from None
                if msg[0] == "hello" and conn in unknown:
                    unknown.remove(conn)
                    self.conns[msg[1]] = conn
                elif msg[0] == "ready":
                    r = self.conns.index(conn)
                    self.core_stats[r] = msg[1]
                    ready.add(r)
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"a data-parallel process (pid {p.pid}) exited with status {p.returncode} while starting"
                    )
        if self.listener is not None:
            self.listener.close()

    def _step_started(self) -> float | None:
        return self.waiting_since if self.requests else None

    def _rank_failed(self, why: str) -> None:
        exit_on_rank_failure(self, why, self._kill)

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def _send(self, rank: int, msg: tuple) -> None:
        try:
            self.conns[rank].send(msg)
        except OSError:
            self._rank_failed(f"data-parallel engine core {rank} closed its connection")

    def enqueue(self, req: Request) -> None:
        """Route a request made by ``make_request`` to a core (a sample of a prompt already sent
        goes where the prompt went)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        first = req.prefill_after.request_id if req.prefill_after is not None else None
        rank = self.rank_of[first] if first in self.rank_of else self.router.choose(req.prompt_token_ids)
        if not self.requests:
            self.waiting_since = time.monotonic()
        self.requests[req.request_id], self.rank_of[req.request_id] = req, rank
        self.router.sent(rank, req.prompt_token_ids)
        cr = CoreRequest(
            req.request_id, req.prompt_token_ids, req.sampling_params, req.prompt, req.arrival_time, req.group, first
        )
        self._send(rank, ("add", cr))

    def abort_request(self, request_id: str) -> bool:
        """Abort a live request on its core; whether there was one to abort."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        rank = self._end(req, "abort")
        self._send(rank, ("abort", request_id))
        for listener in self.finish_listeners:
            listener(request_id, "abort")
        return True

    def _end(self, req: Request, reason: str) -> int:
        """Forget a finished request; its core."""
        req.finish_reason, req.status = req.finish_reason or reason, RequestStatus.FINISHED
        self.requests.pop(req.request_id)
        rank = self.rank_of.pop(req.request_id)
        self.router.finished(rank, req.prompt_token_ids + req.output_token_ids)
        return rank

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _read(self, rank: int, conn: Connection) -> None:
        """A core's messages into ``inbox``, from a thread of its own (the front never blocks a
        core's send); a connection that closes outside shutdown is the core's failure."""
        while True:
            try:
                self.inbox.put((rank, conn.recv()))
            except Exception as e:  # noqa: BLE001 - closed (EOFError, OSError) or a message not understood
                if not self.stopping:
                    why = "closed its connection" if isinstance(e, (EOFError, OSError)) else f"sent {e!r}"
                    self._rank_failed(f"data-parallel engine core {rank} {why}")
                return

    def step(self) -> list[RequestOutput]:
        """The outputs the cores sent since the last call (waits up to STEP_WAIT_S for one)."""
        outputs: list[RequestOutput] = []
        try:
            item = self.inbox.get(timeout=STEP_WAIT_S)
            while True:
                outputs += self._received(*item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return outputs

    def _received(self, rank: int, msg: tuple) -> list[RequestOutput]:
        now = time.monotonic()
        self.waiting_since = now
        if msg[0] == "failed":  # the core refused a request the front had checked
            _, rid, why = msg
            req = self.requests.get(rid)
            if req is None:
                return []
            req.error = why
            self._end(req, "error")
            for listener in self.finish_listeners:
                listener(rid, "error")
            return [req.to_output()]
        _, sent, self.core_stats[rank] = msg
        outputs = []
        for co in sent:
            req = self.requests.get(co.request_id)
            if req is None:  # aborted here since
                continue
            co.apply(req)
            if co.finished:
                self._end(req, co.finish_reason or "stop")
            if co.error is None:
                for listener in self.step_listeners:
                    listener(req, now)
            else:
                for listener in self.finish_listeners:
                    listener(co.request_id, "error")
            outputs.append(req.to_output())
        return outputs

    def rank_stats(self) -> list[tuple[dict[str, str], dict]]:
        """Each core's counts as of its latest step, labelled ``dp_rank``."""
        return [({"dp_rank": str(r)}, s) for r, s in enumerate(self.core_stats)]

    def shutdown(self) -> None:
        """Tell the cores to stop, give each process 10 s to exit, kill what is left."""
        self.stopping = True
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.listener is not None:
            self.listener.close()
        for conn in self.conns:
            try:
                if conn is not None:
                    conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
