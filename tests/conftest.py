"""Tests run on CPU: Triton kernels go through the interpreter (set before any kernel is defined)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FD_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "fd"))

import zlib  # noqa: E402

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import pytest  # noqa: E402

paddle.set_device("cpu")


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Random data per test, reproducible from the test's name (crc32: stable across processes,
    unlike hash(), so a failure can be rerun as it was)."""
    salt = os.environ.get("FD_TEST_SEED", "")  # set it to draw other data: a robustness sweep
    return np.random.default_rng(zlib.crc32((request.node.nodeid + salt).encode()))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from fastdeploy.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def dsa_model_dir(tmp_path_factory) -> str:
    """A tiny hybrid of every attention kind: layer 0 SWA (W 32), 1 and 3 DSA (index_topk 16), 2 full."""
    from fastdeploy.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("dsa")), swa_layers=[0], dsa_layers=[1, 3], index_topk=16)


@pytest.fixture(scope="session")
def mtp_model_dir(tmp_path_factory) -> str:
    """The tiny model with an MTP layer (SWA, W = 32), fitted to the model's continuations."""
    from fastdeploy.tools.make_tiny_model import make_tiny_model
    from fastdeploy.tools.mtp_fit import fit_mtp

    d = make_tiny_model(str(tmp_path_factory.mktemp("mtp")), first_k_dense=0, mtp=True)
    fit_mtp(d, 0, n_fit=8, n_test=4, gen_len=48)
    return d


import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # tests/ref.py
