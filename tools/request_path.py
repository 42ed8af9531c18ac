"""The request's path through the code: the fastdeploy frames from ``POST /v1/chat/completions``
to the sparse MLA kernel's launch, as hops (frames) and files.

A chat completion goes through an in-process server (the tiny checkpoint, Triton kernels in the
interpreter) and three stacks are recorded, each cut to fastdeploy's own frames:
- the handler's, where it hands the request to the engine thread (``AsyncLLMEngine.add``);
- the one that makes the engine request (``Request.__post_init__``; a thread of the pool when the
  handler makes it off the event loop);
- the engine thread's, at the first launch of ``_sparse_mla_kernel`` (a decode step).
Hops: the frames of the three together (a frame in two stacks counts once); files: the distinct
files among them. Also ``touched``: every fastdeploy file with a function called, in any thread,
from the POST until that launch (the scheduler, the block manager, the step's planning and the
prefill step run there but are off the launch's stack).

    PYTHONPATH=TREE python tools/request_path.py [--json OUT]

TREE is a checkout of the project (the command measures whichever fastdeploy it imports).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")


def own_frames(stack: list[traceback.FrameSummary], root: str) -> list[tuple[str, str]]:
    """(file relative to the package's parent, function) of the package's frames, outermost first."""
    return [(os.path.relpath(f.filename, root), f.name) for f in stack if f.filename.startswith(root + os.sep)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from fastapi.testclient import TestClient

    import fastdeploy
    from fastdeploy import request as request_mod
    from fastdeploy.engine.args import EngineArgs
    from fastdeploy.engine.async_engine import AsyncLLMEngine
    from fastdeploy.engine.engine import LLMEngine
    from fastdeploy.entrypoints.openai import api_server
    from fastdeploy.model_executor.ops.triton_ops import launcher
    from fastdeploy.tools.make_tiny_model import make_tiny_model

    root = os.path.dirname(os.path.dirname(os.path.abspath(fastdeploy.__file__)))
    pkg = os.path.join(root, "fastdeploy")
    stacks: dict[str, list] = {}
    touched: set[str] = set()
    tracing = {"on": False}

    def profile(frame, event, arg):
        if tracing["on"] and event == "call" and frame.f_code.co_filename.startswith(pkg + os.sep):
            touched.add(os.path.relpath(frame.f_code.co_filename, pkg))

    post_init = request_mod.Request.__post_init__

    def record_request(self):
        stacks.setdefault("make_request", traceback.extract_stack()[:-1])
        sys.setprofile(profile)  # the pool's thread, from here on
        return post_init(self)

    request_mod.Request.__post_init__ = record_request
    add = AsyncLLMEngine.add

    def record_add(self, req):
        stacks.setdefault("handler", traceback.extract_stack()[:-1])
        return add(self, req)

    AsyncLLMEngine.add = record_add
    inner = launcher.launch

    def record_launch(kernel, grid, *a, **meta):
        if kernel.fn.__name__ == "_sparse_mla_kernel" and "engine" not in stacks:
            stacks["engine"] = traceback.extract_stack()[:-1]
            tracing["on"] = False
        return inner(kernel, grid, *a, **meta)

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("fastdeploy.") and getattr(mod, "launch", None) is inner:
            mod.launch = record_launch

    step = LLMEngine.step

    def traced_step(self):
        sys.setprofile(profile)  # the engine thread
        return step(self)

    LLMEngine.step = traced_step
    model_dir = make_tiny_model(tempfile.mkdtemp(prefix="request-path-"))
    engine = AsyncLLMEngine(
        LLMEngine(EngineArgs(model=model_dir, kernel_backend="triton", block_size=16, num_gpu_blocks_override=160))
    )
    app = api_server.build_app(engine, "tiny")

    async def traced_app(scope, receive, send):
        sys.setprofile(profile)  # the event loop's thread
        await app(scope, receive, send)

    with TestClient(traced_app) as client:
        tracing["on"] = True
        r = client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert r.status_code == 200, r.text
    engine.shutdown()
    parts = {k: own_frames(v, pkg) for k, v in stacks.items()}
    path = []
    for k in ("handler", "make_request", "engine"):
        for f in parts.get(k, []):
            if f not in path:
                path.append(f)
    files = sorted({f for f, _ in path})
    res = {"hops": len(path), "files": len(files), "file_list": files, "stacks": parts, "touched": sorted(touched)}
    for k in ("handler", "make_request", "engine"):
        print(f"{k}: {len(parts.get(k, []))} frames")
        for f, name in parts.get(k, []):
            print(f"    {f}:{name}")
    print(f"hops {res['hops']}, files {res['files']}; files touched until the launch: {len(touched)}")
    print("    " + " ".join(sorted(touched)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
