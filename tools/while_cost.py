"""Where a device-exit burst's per-round cost goes: the condition kernel, its read of the
mapped stop word, and the WHILE node's iteration, each against a fixed-M graph.

Every graph runs M rounds of R tiny kernels (one 32-thread block each: what a zero-cost
stub round is made of, launch-bound work), captured on one CuPy stream:

  fixed            M x R kernels
  fixed+cond       M x (R kernels + the condition kernel), the stop word in mapped host memory
  fixed+cond(dev)  the same, the stop word in device memory
  while            the device-exit burst's shape: the condition, then a WHILE node whose body
                   is R kernels + the condition (mapped stop word), M_max = M, every round run
  while(dev)       the same with the stop word in device memory

Each graph is replayed ``--reps`` times, timed with CUDA events one replay at a time; the
median per replay, and per round the differences: the condition kernel in a graph, the
mapped read (mapped minus device word) and the WHILE iteration (while minus fixed+cond).

  python tools/while_cost.py --rounds 8 --kernels 10 --json while_cost.json

Needs cupy and cuda-python (cuda.bindings); ``--help`` does not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

SPIN_SOURCE = r"""
extern "C" __global__ void tick(int* x) { if (threadIdx.x == 0) x[0] += 1; }
"""


def _graphs(rounds: int, kernels: int):
    import cupy
    import numpy as np

    from graphburst.backend import Backend
    from graphburst.constants import EXIT_ROUNDS, EXIT_WORDS
    from graphburst.engine import conditional
    from graphburst.engine.collector import COLLECTOR_PAUSE
    from graphburst.engine.program import Call
    from graphburst.engine.round_exit import StopFlag
    from graphburst.kernels import round_exit_cuda

    backend = Backend("cupy", 0)
    round_exit_cuda.warm_up(0)
    tick = cupy.RawModule(code=SPIN_SOURCE).get_function("tick")
    stream, body_stream = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    counter = cupy.zeros(1, np.int32)  # [1] int32 the tiny kernels bump
    budget = cupy.full(1, 1 << 20, np.int32)  # [1] int32: a slot that never runs out
    state = cupy.zeros(EXIT_WORDS, np.int32)  # [EXIT_WORDS] int32 loop state
    mapped = StopFlag(backend)  # the stop word in pinned, mapped host memory (what a burst reads)
    device_word = cupy.zeros(1, np.int32)  # [1] int32: the same word in device memory
    cupy.cuda.runtime.deviceSynchronize()  # the buffers were zeroed on the current stream, not on ``stream``

    def ticks(s):
        for _ in range(kernels):
            tick((1,), (32,), (counter,), stream=s)

    def cond(word, begin, handle, s):
        round_exit_cuda.round_exit(budget, state, word, m_max=rounds, begin=begin, handle=handle, stream=s)

    def fixed(word):
        def build(s):  # word None: no condition kernel at all
            if word is not None:
                cond(word, True, 0, s)
            for _ in range(rounds):
                ticks(s)
                if word is not None:
                    cond(word, False, 0, s)
        return build

    def looped(word):
        def build(s):
            handle = conditional.create_handle(s)
            cond(word, True, int(handle), s)

            body = [Call("ticks", lambda *, stream: ticks(stream)),
                    Call("cond", lambda *, stream: cond(word, False, int(handle), stream))]

            def failed(call, exc):
                raise RuntimeError(f"body capture failed in {call.name}: {exc}") from exc

            conditional.capture_while(s, body_stream, handle, body, on_error=failed)
        return build

    variants = {"fixed": fixed(None), "fixed+cond": fixed(mapped.device_address),
                "fixed+cond(dev)": fixed(device_word.data.ptr), "while": looped(mapped.device_address),
                "while(dev)": looped(device_word.data.ptr)}
    graphs = {}
    with COLLECTOR_PAUSE:
        for name, build in variants.items():
            stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeGlobal)
            build(stream)
            graphs[name] = stream.end_capture()
            graphs[name].upload(stream)
    # Check before timing: a WHILE graph ran its M rounds, and each round its R kernels
    for name, g in graphs.items():
        before = int(counter.get(stream=stream)[0])
        g.launch(stream)
        done = int(counter.get(stream=stream)[0]) - before
        if done != rounds * kernels:
            raise RuntimeError(f"{name}: {done} kernels ran, expected {rounds * kernels}")
        if name.startswith("while") and int(state.get(stream=stream)[EXIT_ROUNDS]) != rounds:
            raise RuntimeError(f"{name}: the loop ran {int(state.get(stream=stream)[EXIT_ROUNDS])} rounds, "
                               f"expected {rounds}")
    # the graphs read these buffers: they must outlive them (the mapped word's memory is freed with its object)
    keep = (tick, counter, budget, state, mapped, device_word, body_stream)
    return graphs, stream, keep


def measure(rounds: int, kernels: int, reps: int) -> dict:
    import cupy

    graphs, stream, _keep = _graphs(rounds, kernels)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    us = {}
    for name, g in graphs.items():
        for _ in range(20):  # warm-up
            g.launch(stream)
        samples = []
        for _ in range(reps):
            start.record(stream)
            g.launch(stream)
            end.record(stream)
            end.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
        us[name] = statistics.median(samples)
    per_round = {
        "condition_kernel_us": (us["fixed+cond"] - us["fixed"]) / rounds,
        "condition_kernel_device_word_us": (us["fixed+cond(dev)"] - us["fixed"]) / rounds,
        "mapped_read_us": (us["fixed+cond"] - us["fixed+cond(dev)"]) / rounds,
        "while_iteration_us": (us["while"] - us["fixed+cond"]) / rounds,
        "device_exit_total_us": (us["while"] - us["fixed"]) / rounds,
        "device_exit_total_device_word_us": (us["while(dev)"] - us["fixed"]) / rounds,
        "tiny_kernel_us": us["fixed"] / (rounds * kernels),
    }
    return {"rounds": rounds, "kernels_per_round": kernels, "reps": reps, "graph_us": us, "per_round_us": per_round}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8, help="M: rounds per graph (default 8)")
    p.add_argument("--kernels", type=int, default=10, help="R: tiny kernels per round (default 10)")
    p.add_argument("--reps", type=int, default=2000, help="timed replays per graph (default 2000)")
    p.add_argument("--json", default=None, help="write the figures here too")
    args = p.parse_args(argv)
    if min(args.rounds, args.kernels, args.reps) < 1:
        print("while_cost: --rounds, --kernels and --reps must be >= 1", file=sys.stderr)
        return 2
    out = measure(args.rounds, args.kernels, args.reps)
    for name, v in out["graph_us"].items():
        print(f"{name:18s} {v:9.2f} us per graph")
    for name, v in out["per_round_us"].items():
        print(f"{name:34s} {v:7.2f} us")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
