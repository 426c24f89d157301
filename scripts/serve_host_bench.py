"""Host microseconds per burst of the pipelined serving loop at B=64, by phase.

The numpy backend's "graph" is a recorded program run on the host. With ``--host-only``
(the default) a replay runs only the program's last call, the copy of the output block
into the pinned host buffer, after a few real bursts have filled the device buffers: the
model's work costs nothing and what is left is the host path a GPU would wait on. Each
phase of ``ServeLoop`` (drain, launch/refill, deliver, boundary/admit) is timed by
wrapping the loop's own methods on one instance; "other" is the rest of ``step``.

Two workloads: ``steady`` (64 requests with long budgets, every slot busy, no
admission and no request finishing in the timed window) and ``refill`` (4x more requests than slots with short budgets, so slots
finish and are refilled at burst boundaries). ``--profile`` prints the top of a cProfile.

``--retire`` times instead, per request, the host work of a request finishing and of one
being admitted, with no model work at all: ``_deliver`` of one synthetic drained burst in
which N of the 64 running requests finish (retire, copy-out of their tokens, intake,
events, freeing; less the same burst with none finishing), and ``_take_waiting`` of N
waiting requests into N free slots. Trials interleave the sizes; figures are medians.

Usage: ``PYTHONPATH=. python scripts/serve_host_bench.py [--full-model] [--profile] [--retire] [--json FILE]``
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, ".")
from graphburst.backend import get_backend  # noqa: E402
from graphburst.bench.common import stub_models  # noqa: E402
from graphburst.burst_tokens import BurstTokens  # noqa: E402
from graphburst.capture import RecordedProgram  # noqa: E402
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop

PHASES = {"drain": ("pipeline", "drain"), "launch": ("pipeline", "launch"),
          "deliver": (None, "_deliver"), "boundary": (None, "_boundary")}
STEADY_BURSTS = 300  # x at most M * (k + 1) = 40 tokens per slot: far below the budget
WARM_BURSTS = 4  # real bursts before the model work is skipped: the output block then holds real tokens


def _workload(name: str, batch: int, new_tokens: int):
    rng = np.random.default_rng(0)
    n_req, budget = (batch, new_tokens) if name == "steady" else (4 * batch, 160)
    return [Request(rng.integers(0, 32000, 16).tolist(), budget, options={"seed": i}) for i in range(n_req)]


def measure(name: str, *, batch=64, k=4, m=8, new_tokens=16384, host_only=True, max_steps=None,
            profile=False) -> dict:
    """Per-burst host time of each phase over one run of the workload."""
    target, draft = stub_models(get_backend("numpy"), batch=batch, capacity=64 + new_tokens + m * (k + 1))
    loop = ServeLoop(target, draft, k=k, m_rounds=m)
    spent = dict.fromkeys(PHASES, 0.0)
    for phase, (part, meth) in PHASES.items():  # measurement only: the wrapped methods still run
        owner = loop if part is None else getattr(loop, part)
        real = getattr(owner, meth)

        def timed(*a, _real=real, _phase=phase):
            t = time.perf_counter()
            try:
                return _real(*a)
            finally:
                spent[_phase] += time.perf_counter() - t

        setattr(owner, meth, timed)
    for r in _workload(name, batch, new_tokens):
        loop.submit(r)
    for _ in range(WARM_BURSTS):
        loop.step()
    real_launch, in_launch = RecordedProgram.launch, [0.0]

    def launch(self, stream):  # the device's share of a replay: timed and taken out of the host figures
        t = time.perf_counter()
        if host_only:
            self.calls[-1](stream)  # only the copy of the output block (real tokens from the warm bursts)
        else:
            real_launch(self, stream)
        in_launch[0] += time.perf_counter() - t

    RecordedProgram.launch = launch
    prof = cProfile.Profile() if profile else None
    try:
        for key in spent:
            spent[key] = 0.0
        in_launch[0] = 0.0
        bursts0, steps, t0 = loop.bursts, 0, time.perf_counter()
        per_step = []  # host µs of each phase in each step: medians resist a loaded machine
        if prof:
            prof.enable()
        # steady: stop long before any budget runs out, so no request finishes in the window.
        max_steps = max_steps or (STEADY_BURSTS if name == "steady" else 10**6)
        while not loop.idle and steps < max_steps:
            before, launch0, t = dict(spent), in_launch[0], time.perf_counter()
            loop.step()
            total = time.perf_counter() - t - (in_launch[0] - launch0)
            row = {p: spent[p] - before[p] for p in PHASES}
            row["launch"] -= in_launch[0] - launch0
            row["other"] = total - sum(row.values())
            row["total"] = total
            per_step.append(row)
            steps += 1
        wall = time.perf_counter() - t0
        if prof:
            prof.disable()
    finally:
        RecordedProgram.launch = real_launch
    bursts = loop.bursts - bursts0
    host = (wall - in_launch[0]) / bursts * 1e6
    median = {p: float(np.median([r[p] for r in per_step])) * 1e6 for p in per_step[0]}
    out = {"workload": name, "batch": batch, "host_only": host_only, "bursts": bursts, "steps": steps,
           "mean_us_per_burst": host, "median_us_per_step": median}
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return out


RETIRE_SIZES = (0, 1, 4, 16, 64)  # requests finishing in one burst (0: the baseline delivery)
RETIRE_TRIALS = 400


def _refill_slots(loop, slots, budget: int) -> None:
    """Put a new running request in each of ``slots`` (free), skipping prefill: host state only."""
    for b in slots:
        loop.submit(Request([1, 2, 3], budget, options={"seed": b}))
    loop._take_waiting()
    for b in slots:
        del loop._prefilling[b]
        loop._running[b] = True
    loop.dec.host_left[slots] = budget


def measure_retire(*, batch=64, k=4, m=8, trials=RETIRE_TRIALS, log=True) -> dict:
    """Median host µs of finishing N requests in ``_deliver`` and of admitting N in ``_take_waiting``."""
    width = m * (k + 1)
    budget = 4 * width  # the tokens each trial delivers fit with room to spare
    target, draft = stub_models(get_backend("numpy"), batch=batch, capacity=64 + budget + width)
    loop = ServeLoop(target, draft, k=k, m_rounds=m)
    loop.log = [] if log else None  # the HTTP and JSONL servers read the log: its events are part of the cost
    _refill_slots(loop, range(batch), budget)
    rng = np.random.default_rng(0)
    ring = np.zeros((batch, 1 + width), np.int32)  # [B, 1 + R] int32: a drained ring, column 0 the count
    ring[:, 1:] = rng.integers(0, 32000, (batch, width))
    every = np.arange(batch)
    finish, admit = {n: [] for n in RETIRE_SIZES}, {n: [] for n in RETIRE_SIZES if n}
    for _ in range(trials):
        for n in rng.permutation(RETIRE_SIZES):
            n = int(n)
            done = np.sort(rng.choice(batch, n, replace=False))
            # Two bursts per trial: every request already holds tokens when it finishes (it copies them out).
            ring[:, 0] = rng.integers(1, width + 1, batch)
            loop.store.reset(every)
            loop._deliver(BurstTokens(ring.copy()), loop.store.acc)
            ring[:, 0] = rng.integers(0, width + 1, batch)  # a request may finish on a burst that gives it none
            tokens, acc = BurstTokens(ring.copy()), loop.store.acc.copy()
            loop.dec.host_left[done] = 0
            t = time.perf_counter()
            loop._deliver(tokens, acc)
            finish[n].append(time.perf_counter() - t)
            assert loop._n_occupied == batch - n and not loop._running[done].any()
            if n:
                for b in done:  # the admission half: submitted (validated) outside the timing
                    loop.submit(Request([1, 2, 3], budget, options={"seed": int(b)}))
                t = time.perf_counter()
                loop._take_waiting()
                admit[n].append(time.perf_counter() - t)
                assert loop._n_occupied == batch
                for b in done:
                    del loop._prefilling[b]
                    loop._running[b] = True
                loop.dec.host_left[done] = budget
            if loop.log is not None:
                loop.log.clear()
    base = float(np.median(finish[0])) * 1e6
    out = {"batch": batch, "trials": trials, "log": log, "deliver_us_none_finishing": base,
           "finish_us": {}, "finish_us_per_request": {}, "admit_us_per_request": {}}
    for n in RETIRE_SIZES[1:]:
        med = float(np.median(finish[n])) * 1e6
        out["finish_us"][n] = med - base
        out["finish_us_per_request"][n] = (med - base) / n
        out["admit_us_per_request"][n] = float(np.median(admit[n])) * 1e6 / n
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full-model", action="store_true", help="run the stub models too (time includes them)")
    p.add_argument("--profile", action="store_true", help="print a cProfile of the steady run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--retire", action="store_true", help="per-request host µs of finishing and admitting requests")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.retire:
        r = measure_retire()
        print(f"B={r['batch']}, {r['trials']} trials, events logged: _deliver with none finishing "
              f"{r['deliver_us_none_finishing']:.1f} µs")
        for n in RETIRE_SIZES[1:]:
            print(f"  {n:2d} finishing: +{r['finish_us'][n]:6.1f} µs ({r['finish_us_per_request'][n]:5.2f} µs each); "
                  f"admitting {n:2d}: {r['admit_us_per_request'][n]:5.2f} µs each")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(r, f, indent=1)
        return
    rows = []
    for name in ("steady", "refill"):
        # Refills change slots on the device, so the model must run: its time is subtracted instead.
        runs = [measure(name, host_only=not a.full_model and name == "steady",
                        profile=a.profile and i == 0 and name == "steady")
                for i in range(a.repeats)]
        best = min(runs, key=lambda r: r["median_us_per_step"]["total"])
        rows.append(best)
        phases = "  ".join(f"{k} {v:6.1f}" for k, v in best["median_us_per_step"].items())
        print(f"{name:7s} B={best['batch']} {'host only' if best['host_only'] else 'with model'}: "
              f"mean {best['mean_us_per_burst']:6.1f} µs/burst over {best['bursts']} bursts; median µs per step "
              f"(best of {a.repeats}): {phases}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
