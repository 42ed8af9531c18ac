"""Servers in processes of their own, on the tiny preset, closed (with every process they
started) after the test: ``procs(*flags)`` starts one."""

import pytest
from live_server import ServerProcess

FLAGS = ("--block-size", "16", "--num-gpu-blocks-override", "64", "--max-model-len", "256", "--log-level", "warning")


@pytest.fixture
def procs():
    made = []
    yield lambda *a: made.append(ServerProcess(*FLAGS, *a)) or made[-1]
    for p in made:
        p.close()
