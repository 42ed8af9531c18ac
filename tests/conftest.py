"""Tests run on CPU: Triton kernels go through the interpreter (set before any kernel is defined)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FD_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "fd"))

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import pytest  # noqa: E402

paddle.set_device("cpu")


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh random data per test, reproducible from the test's name."""
    return np.random.default_rng(abs(hash(request.node.nodeid)) % (2**32))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from fastdeploy.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")))


import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # tests/numpy_refs.py
