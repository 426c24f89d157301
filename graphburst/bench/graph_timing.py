"""Timing enqueued torch work: CUDA events on a GPU, ``perf_counter`` on the CPU, in µs.

:func:`graph_us` is how the real-model profiles (``graphburst bench real --profile``) and
the maintainers' kernel sweeps (``tools/gemv_bench.py``) time a forward or a kernel: the
calls captured once as a CUDA graph and the graph replayed, so launch overhead is the
graph's, not Python's, and the figure is the median of several replays.
"""

from __future__ import annotations

import statistics
import time

import torch


class Timer:
    """GPU time of enqueued work (CUDA events) or host time on the CPU, in µs."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def measure(self, fn, n: int) -> float:
        """µs per call of ``n`` calls of ``fn`` back to back (device time on a GPU, synced after)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) * 1e6 / n


def graph_us(fn, reps: int, trials: int = 15, *, cuda: bool = True) -> float:
    """Median µs per call of ``fn``: ``reps`` calls captured as one CUDA graph, replayed ``trials`` times.

    Two warm-up calls on a side stream first (library handles, kernel choice, Triton compiles,
    allocations: nothing of that may happen inside the capture), and one untimed replay.
    ``cuda=False``: the same calls run plainly and timed on the host (CPU torch has no graphs).
    """
    if reps < 1 or trials < 1:
        raise ValueError(f"reps ({reps}) and trials ({trials}) must be >= 1")
    if not cuda:
        fn()  # the warm-up: first-call allocations and dispatch caches
        return statistics.median(Timer("cpu").measure(fn, reps) for _ in range(trials))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    timer = Timer("cuda")
    return statistics.median(timer.measure(graph.replay, 1) / reps for _ in range(trials))
