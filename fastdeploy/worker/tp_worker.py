"""A tensor-parallel worker rank: the model shard and its KV caches, running the driver's steps.

    python -m fastdeploy.worker.tp_worker --config CONFIG [--driver-pid PID]

Started by the driver (``init_tensor_parallel``) with paddle.distributed's environment and the
driver's own resolved config (``encode_config``: the FDConfig, the model's dtype in its model config), or run in
process by ``api_server`` on ranks other than 0 under paddle.distributed.launch. It exits when
the driver says so, or when the driver process is gone.
"""

from __future__ import annotations

import argparse
import base64
import logging
import os
import pickle
import threading
import time

from fastdeploy.config import FDConfig
from fastdeploy.distributed.parallel import BEAT_S, Activity, init_parallel, start_beating
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

logger = logging.getLogger("fastdeploy")


def encode_config(fd: FDConfig) -> str:
    """The driver's config as one command-line word (its own child reads it back)."""
    return base64.b64encode(pickle.dumps(fd)).decode("ascii")


def decode_config(word: str) -> FDConfig:
    return pickle.loads(base64.b64decode(word))


def exit_with_driver(pid: int) -> None:
    """A worker blocked in a collective cannot notice its driver died; this thread can."""
    while True:
        time.sleep(0.5)
        try:
            os.kill(pid, 0)
        except OSError:
            os._exit(1)


def run_worker(fd: FDConfig, driver_pid: int | None = None) -> None:
    """Serve the driver's steps with the driver's config ``fd``."""
    if driver_pid:
        threading.Thread(target=exit_with_driver, args=(driver_pid,), daemon=True).start()
    activity = Activity()
    start_beating(activity, min(BEAT_S, fd.parallel_config.dist_timeout / 4))
    groups = init_parallel(fd.parallel_config, activity=activity)
    tp = groups.tp
    runner = GPUModelRunner(fd, tp, groups.ep)
    logger.info("tensor-parallel rank %d of %d ready", tp.rank, tp.world_size)
    runner.serve_steps()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fastdeploy.worker.tp_worker")
    ap.add_argument("--config", required=True, help="the driver's config (encode_config)")
    ap.add_argument("--driver-pid", type=int, default=None)
    ns = ap.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_worker(decode_config(ns.config), ns.driver_pid)


if __name__ == "__main__":
    main()
