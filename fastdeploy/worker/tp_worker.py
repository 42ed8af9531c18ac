"""A tensor-parallel worker rank: the model shard and its KV caches, running the driver's steps.

    python -m fastdeploy.worker.tp_worker --engine-args JSON [--driver-pid PID]

Started by the driver (``init_tensor_parallel``) with paddle.distributed's environment, or by
``api_server`` on ranks other than 0 under paddle.distributed.launch. It exits when the driver
says so, or when the driver process is gone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time

from fastdeploy.distributed.parallel import init_tensor_parallel
from fastdeploy.engine.args import EngineArgs
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

logger = logging.getLogger("fastdeploy")


def _exit_with_driver(pid: int) -> None:
    """A worker blocked in a collective cannot notice its driver died; this thread can."""
    while True:
        time.sleep(0.5)
        try:
            os.kill(pid, 0)
        except OSError:
            os._exit(1)


def run_worker(args: EngineArgs, driver_pid: int | None = None) -> None:
    if driver_pid:
        threading.Thread(target=_exit_with_driver, args=(driver_pid,), daemon=True).start()
    fd = args.create_config()
    tp = init_tensor_parallel(fd.parallel_config.tensor_parallel_size)
    runner = GPUModelRunner(fd, args.dtype, tp)
    logger.info("tensor-parallel rank %d of %d ready", tp.rank, tp.world_size)
    runner.serve_steps()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fastdeploy.worker.tp_worker")
    ap.add_argument("--engine-args", required=True, help="EngineArgs as JSON")
    ap.add_argument("--driver-pid", type=int, default=None)
    ns = ap.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_worker(EngineArgs(**json.loads(ns.engine_args)), ns.driver_pid)


if __name__ == "__main__":
    main()
