"""A data-parallel engine core: one LLMEngine (its scheduler, KV pools and prefix cache, its TP
group) serving the requests the front routes to it (docs/design.md §4.19).

    python -m fastdeploy.engine.dp_core --config CONFIG --conn FD --front-pid PID

Started by the front (``DPEngine``) with a socket to it (``--conn``: a descriptor it inherits)
and, under expert parallelism, paddle.distributed's environment of global rank R x TP; or, under
paddle.distributed.launch, by the API server on a core's rank (``run_launched_core``), which
connects to the front over TCP (``front_address``, authenticated by ``authkey``). Messages,
pickled through ``multiprocessing.connection``: the front sends ("add", CoreRequest),
("abort", request id) and ("stop",); the core sends ("hello", its data-parallel rank) and
("ready", stats) once, then after each step ("out", a CoreOutput per request with new tokens, stats) and
("failed", request id, message) for a request it could not take.

With expert parallelism the cores step together: each loop turn every core's driver adds up
(has work, stop) over the data-parallel group; when any core has work every core steps once,
a core with nothing scheduled through a dummy step, so each MoE layer's gather finds every
core (vLLM's dummy batch). Each step then runs exactly one forward: the engine steps in turn
(``async_scheduling`` off), without speculation.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from multiprocessing.connection import Client, Connection

from fastdeploy.config import FDConfig, ParallelConfig
from fastdeploy.distributed.parallel import BEAT_S, Activity, start_beating
from fastdeploy.engine.dp_messages import CoreRequest, Deltas
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.metrics import engine_stats
from fastdeploy.worker.tp_worker import decode_config, exit_with_driver

logger = logging.getLogger("fastdeploy")

IDLE_POLL_S = 0.005  # an idle core's wait for a message before its next lockstep turn


def front_address(pc: ParallelConfig) -> tuple[str, int]:
    """Under paddle.distributed.launch: where the front (on global rank 0's host) listens for the
    cores: that host, port ``data_parallel_rpc_port`` or the launcher's master port + 1."""
    host = os.environ["PADDLE_TRAINER_ENDPOINTS"].split(",")[0].rsplit(":", 1)[0]
    return host, pc.data_parallel_rpc_port or int(os.environ["PADDLE_MASTER"].rsplit(":", 1)[1]) + 1


def authkey() -> bytes:
    """The key the front and launched cores prove to each other (``FD_DP_AUTHKEY``, the same on
    every node; else the launcher's master address, which keeps strays out, not attackers: the
    cluster's network is trusted, as by paddle's own TCP store)."""
    return os.environ.get("FD_DP_AUTHKEY", os.environ.get("PADDLE_MASTER", "fastdeploy")).encode()


def take(engine: LLMEngine, cr: CoreRequest) -> None:
    """Queue a routed request (ValueError if the engine refuses it)."""
    req = engine.make_request(cr.prompt_token_ids, cr.params, cr.request_id)
    req.prompt, req.arrival_time, req.group = cr.prompt, cr.arrival_time, cr.group
    if cr.prefill_after is not None:
        req.prefill_after = engine.requests.get(cr.prefill_after)
    engine.enqueue(req)


def serve(engine: LLMEngine, conn: Connection) -> None:
    """The core's loop until the front (or, in lockstep, any core's front message) says stop."""
    dp = engine.parallel.dp
    scheduled_at: dict[str, float | None] = {}  # of each request that got tokens this step
    engine.step_listeners.append(lambda req, now: scheduled_at.__setitem__(req.request_id, req.first_scheduled_time))
    deltas = Deltas()
    conn.send(("hello", dp.rank if dp is not None else 0))
    conn.send(("ready", engine_stats(engine)))
    stop = False
    while True:
        wait = 0 if engine.has_unfinished_requests() else IDLE_POLL_S
        while not stop and conn.poll(wait):
            msg, wait = conn.recv(), 0
            if msg[0] == "add":
                try:
                    take(engine, msg[1])
                except ValueError as e:
                    conn.send(("failed", msg[1].request_id, str(e)))
            elif msg[0] == "abort":
                engine.abort_request(msg[1])
                deltas.sent.pop(msg[1], None)
            else:
                stop = True
        busy = engine.has_unfinished_requests()
        if dp is not None:  # every core's turn together
            busy, stop = dp.all_reduce_host([int(busy), int(stop)])
        if stop:
            return
        if not busy:
            continue
        outs = engine.step()  # with nothing of this core's own: a dummy step
        sent = [deltas.of(o, scheduled_at.pop(o.request_id, None)) for o in outs]
        conn.send(("out", sent, engine_stats(engine)))


def run_core(fd: FDConfig, conn: Connection, front_pid: int | None) -> None:
    if front_pid:
        threading.Thread(target=exit_with_driver, args=(front_pid,), daemon=True).start()
    activity = Activity()
    start_beating(activity, min(BEAT_S, fd.parallel_config.dist_timeout / 4))
    engine = LLMEngine(fd, activity)
    try:
        serve(engine, conn)
        if engine.tp.world_size > 1 and not engine.tp.workers:  # its TP ranks, started by the front
            engine.runner.stop_workers()
    finally:
        engine.shutdown()


def run_launched_core(fd: FDConfig) -> None:
    """A core's rank under paddle.distributed.launch (not global rank 0, whose front starts its
    core itself): connect to the front, then serve."""
    address = front_address(fd.parallel_config)
    deadline = time.monotonic() + fd.parallel_config.dist_timeout
    while True:  # the front may not listen yet
        try:
            conn = Client(address, authkey=authkey())
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no data-parallel front at {address[0]}:{address[1]} (--dist-timeout)") from None
            time.sleep(0.2)
    run_core(fd, conn, None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fastdeploy.engine.dp_core")
    ap.add_argument("--config", required=True, help="the front's config (tp_worker.encode_config)")
    ap.add_argument("--conn", type=int, required=True, help="the descriptor of the socket to the front")
    ap.add_argument("--front-pid", type=int, default=None)
    ns = ap.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_core(decode_config(ns.config), Connection(ns.conn), ns.front_pid)


if __name__ == "__main__":
    main()
