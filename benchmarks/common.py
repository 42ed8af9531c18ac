"""What the GPU benchmarks share: timers, the ceilings measured in the same run, the error
measure, and the L2 size read off the device (METHOD.md: time beside ceilings of the same run;
rotate inputs over several times the L2 so a call reads cold memory).

Timers, all in milliseconds a call of ``fn``:
- ``bench_ms``: Triton's ``do_bench`` (mean or median over ``rep`` ms of calls, L2 flushed);
- ``events_ms``: back-to-back calls between two CUDA events, divided by the calls;
- ``per_call_ms``: the median of CUDA events around each call;
- ``replay_ms``: one CUDA graph of ``n`` calls (no host launch cost), divided by n;
- ``cold_replay_ms``: one CUDA graph over enough weight copies that each call reads its weight
  from HBM;
- ``kernel_sum_ms``: the GPU kernels' own times a call (profiler), no gaps between them.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton.testing


def l2_bytes() -> int:
    """The device's L2 size (50 MB on an H100, 60 MB on an H200)."""
    return torch.cuda.get_device_properties(0).L2_cache_size


def bench_ms(fn, rep: int = 200, warmup: int = 25, mode: str = "mean", graph: bool = False) -> float:
    """``do_bench`` (``graph``: ``do_bench_cudagraph``, which always takes the median)."""
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode=mode)


def events_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def per_call_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return float(np.median(out))


def capture(fn, n: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of n calls of fn, warmed up on a side stream first (compiles, lazy buffers)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    return graph


def replay_ms(fn, n: int = 20, timer=bench_ms) -> float:
    graph = capture(fn, n)
    ms = timer(graph.replay) / n
    del graph
    return ms


def cold_replay_ms(fn, weight: torch.Tensor, timer=bench_ms) -> float:
    """fn(w) for w over ``weight`` and its copies (>= 4x L2 in all), as one CUDA graph: the GPU
    time a serving engine's captured decode step sees, without the host's launch cost."""
    nbytes = weight.numel() * weight.element_size()
    copies = [weight] + [weight.clone() for _ in range(max(1, -(-4 * l2_bytes() // nbytes)) - 1)]
    graph = capture(rotating(lambda i: fn(copies[i]), len(copies)), len(copies))
    ms = timer(graph.replay) / len(copies)
    del graph
    return ms


def kernel_sum_ms(fn, iters: int = 5) -> float:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / iters


def rotation(nbytes: int, cap: int = 16) -> int:
    """Copies of an input so that a round of calls reads >= 4x L2 of cold memory."""
    return max(1, min(cap, math.ceil(4 * l2_bytes() / max(nbytes, 1))))


def rotating(fn, n: int):
    """A no-argument callable that calls fn(0), fn(1), ..., fn(n - 1), fn(0), ... in turn."""
    state = {"i": -1}

    def call():
        state["i"] = (state["i"] + 1) % n
        fn(state["i"])

    return call


# ------------------------------------------------------------------ ceilings of this run
def copy_gbps(nbytes: int = 2**31, timer=bench_ms) -> float:
    """Device-to-device copy of ``nbytes``, GB/s counting bytes read and written."""
    x = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * nbytes / timer(lambda: y.copy_(x)) / 1e6


def bf16_tflops(n: int = 8192) -> float:
    """An n x n x n bf16 matrix product on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / bench_ms(lambda: a @ b) / 1e9


def fp8_rowwise_tflops(n: int = 8192) -> float:
    """An n x n x n e4m3 product with row-wise scales (``torch._scaled_mm``)."""
    a8 = torch.randn(n, n, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    b8 = a8.t()  # column-major, as _scaled_mm wants
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    return 2 * n**3 / bench_ms(lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16)) / 1e9


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in float64."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp(min=1e-30))
