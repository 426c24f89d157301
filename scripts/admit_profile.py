"""Where a burst boundary's host time goes in the serving loop's ``refill`` workload.

256 requests (16-token prompts, 256 new tokens each) flow through 64 slots of zero-cost
stubs (k=4, M=8), the workload whose GPU idle figure ``graphburst bench serve`` reports.
Each phase of a boundary (freeing, taking waiting requests, per-slot options, staging, the
models' prefill, the slot writes) is timed on the host by wrapping the methods of one loop,
and so are the plain steps' drain (apart from its wait for the GPU) and delivery; the
figures are medians over boundaries and over plain steps, with the slots admitted per
boundary. On a GPU the burst clock gives device busy, idle and admission-span time.

``--model 1b`` runs a random-weight shape of ``graphburst bench real`` instead (prompts and
outputs lognormal, mean 128, in [16, 512], as the open-loop load benchmark draws them), all
requests submitted at once, with no HTTP: the loop's own idle under a real model.

Usage: ``PYTHONPATH=. python scripts/admit_profile.py [--backend cupy] [-m 8 16 32] [--depth 2 4] [--admission late]
[--model 1b] [--json FILE]``
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
from graphburst.bench.common import VOCAB, stub_models  # noqa: E402
from graphburst.bench.load_server import shape_models  # noqa: E402
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop

LOAD_MAX = 512  # --model: prompt and output lengths lognormal, mean 128, in [16, 512] (the load benchmark's default)
# (label, owner attribute path from the loop ("" is the loop), method): timed inclusively
PHASES = (("boundary", "", "_boundary"), ("release", "dec", "release"), ("take", "", "_take_waiting"),
          ("options", "dec", ("_set_slot_options", "set_slot_options")), ("prefill", "dec", "_prefill_checked"),
          ("stage", "dec", "_stage_prompts"),
          ("models", "dec", "_prefill_models"), ("admit", "dec", "_admit"),
          ("drain", "pipeline", "drain"), ("deliver", "", "_deliver"), ("step", "", "step"))


def _wrap(loop, totals: dict, prof=None) -> None:
    for label, path, meths in PHASES:
        owner = getattr(loop, path) if path else loop
        # the first of the names this tree has (an older graphburst in a before/after comparison
        # on one lease may lack some: those phases are not timed)
        meth = next((m for m in ((meths,) if isinstance(meths, str) else meths) if hasattr(owner, m)), None)
        if meth is None:
            continue
        real = getattr(owner, meth)

        def timed(*a, _real=real, _label=label, **kw):
            t = time.perf_counter()
            if _label == "prefill":
                totals["slots"] += len(a[0])  # the slots (a list, or a dict slot -> chunk)
            if prof is not None and _label == prof.label:
                prof.enable()
            try:
                return _real(*a, **kw)
            finally:
                totals[_label] += time.perf_counter() - t
                if prof is not None and _label == prof.label:
                    prof.disable()

        setattr(owner, meth, timed)


class _TimedEvent:
    """A graph's completion event whose ``synchronize`` (the drain's wait for the GPU) is timed,
    so the drain's host work can be told from its waiting."""

    def __init__(self, event, totals: dict):
        self.event, self.totals = event, totals

    def record(self, stream=None):
        self.event.record(stream)

    def synchronize(self):
        t = time.perf_counter()
        self.event.synchronize()
        self.totals["wait"] += time.perf_counter() - t


def measure(backend_name: str, *, requests=256, batch=64, new_tokens=256, k=4, m=8, prefill_chunk=None,
            prof=None, model=None, depth=2, order=None) -> dict:
    backend = get_backend(backend_name)
    rng = np.random.default_rng(0)
    if model is None:
        target, draft = stub_models(backend, batch=batch, capacity=64 + new_tokens + m * (k + 1))
        reqs = [Request(rng.integers(0, VOCAB, 16).tolist(), new_tokens, options={"seed": i}) for i in range(requests)]
    else:  # a random-weight shape of bench real, lengths as the load benchmark draws them by default
        target, draft = shape_models(model, batch=batch, capacity=2 * LOAD_MAX + m * (k + 1), k=k, dtype="bfloat16",
                                     eps=0.01, seed=0, backend=backend, lookup=False)
        lens = np.clip(np.rint(rng.lognormal(np.log(128) - 0.125, 0.5, (2, requests))), 16, LOAD_MAX).astype(int)
        reqs = [Request(rng.integers(0, target.vocab, p).tolist(), int(n)) for p, n in lens.T]
    deeper = {} if depth == 2 else {"depth": depth}  # an older graphburst has no depth (always 2)
    if order is not None:  # nor an admission order (always late)
        deeper["admission"] = order
    loop = ServeLoop(target, draft, k=k, m_rounds=m, prefill_chunk=prefill_chunk, **deeper)
    warm = loop.submit(Request([1, 2, 3], m * (k + 1)))  # compiles kernels, captures the graph
    loop.run_until_idle()
    assert warm.done and not warm.error, warm.error
    clock = loop.pipeline.clock
    busy0, idle0, adm0 = clock.overall.busy_ms, clock.overall.idle_ms, getattr(clock.overall, "admission_ms", 0.0)
    totals = {label: 0.0 for label, _, _ in PHASES} | {"wait": 0.0, "slots": 0}
    per_boundary, plain_steps = [], []  # steps with and without a boundary
    _wrap(loop, totals, prof)
    graph = loop.pipeline.graph
    graph._events = [_TimedEvent(e, totals) for e in graph._events]
    states = [loop.submit(r) for r in reqs]
    t0 = time.perf_counter()
    while not loop.idle:
        before, occupied = dict(totals), loop._n_occupied
        loop.step()
        row = {k: (totals[k] - before[k]) * (1 if k == "slots" else 1e6) for k in totals}
        if totals["boundary"] != before["boundary"]:
            row["occupied_before"] = occupied
            per_boundary.append(row)
        else:
            plain_steps.append(row)
    wall = time.perf_counter() - t0
    bad = [s.request.id for s, r in zip(states, reqs) if s.error or len(s.tokens) != r.max_new_tokens]
    assert not bad, f"requests without all their tokens: {bad[:5]}"
    busy, idle = clock.overall.busy_ms - busy0, clock.overall.idle_ms - idle0
    admission = getattr(clock.overall, "admission_ms", 0.0) - adm0
    admitting = [r for r in per_boundary if r["prefill"] > 0]
    med = {k: float(np.median([r[k] for r in admitting])) for k in admitting[0] if k != "occupied_before"} \
        if admitting else {}
    return {"backend": backend.name, "model": model or "stubs", "requests": requests, "batch": batch, "k": k, "m": m,
            "depth": depth, "admission": order or "default",
            "wall_ms": wall * 1e3,
            "bursts": loop.bursts, "boundaries": len(per_boundary), "admitting_boundaries": len(admitting),
            "deferred_boundaries": getattr(loop, "deferred_boundaries", None),  # an older graphburst has none
            "gpu_busy_ms": busy if backend.is_gpu else None, "gpu_idle_ms": idle if backend.is_gpu else None,
            "gpu_idle_fraction": idle / (busy + idle) if backend.is_gpu and busy + idle > 0 else None,
            "gpu_admission_ms": admission if backend.is_gpu else None,
            "host_us_per_step": totals["step"] * 1e6 / max(loop.bursts, 1),
            "median_us_per_admitting_boundary": med,
            # steps with no boundary: drain (including any wait for the GPU), launch, deliver
            "median_us_per_plain_step": {k: float(np.median([r[k] for r in plain_steps]))
                                         for k in ("wait", "drain", "deliver", "step")} if plain_steps else {},
            "total_ms": {k: v * 1e3 for k, v in totals.items() if k != "slots"}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", choices=("auto", "cupy", "numpy"))
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--model", help="a random-weight shape of bench real (1b, 8b, ...) instead of zero-cost stubs")
    p.add_argument("--prefill-chunk", type=int)
    p.add_argument("-k", type=int, default=4, help="drafts per round")
    p.add_argument("-m", type=int, nargs="+", default=[8], help="rounds per burst (several: a sweep)")
    p.add_argument("--depth", type=int, nargs="+", default=[2], help="bursts kept in flight (several: a sweep)")
    p.add_argument("--admission", choices=("auto", "early", "late"),
                   help="the loop's admission order (default: the loop's own, auto)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", choices=[label for label, _, _ in PHASES],
                   help="print a cProfile of this phase in the first run (boundary, step, ...)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    prof = None
    if a.profile:
        prof = cProfile.Profile()
        prof.label = a.profile
    runs = [measure(a.backend, requests=a.requests, k=a.k, m=m, prof=prof if i == 0 else None, model=a.model,
                    prefill_chunk=a.prefill_chunk, depth=d, order=a.admission)
            for m in a.m for d in a.depth for i in range(a.repeats)]
    if prof is not None:
        steps = runs[0]["bursts"]
        rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:45]
        print(f"cProfile of {a.profile} (first run), own time in µs per burst over {steps} bursts:")
        for (file, line, fn), (_, calls, own, cum, _) in rows:
            print(f"{own * 1e6 / steps:8.2f} own {cum * 1e6 / steps:8.2f} cum {calls / steps:6.2f} calls  "
                  f"{file.split('/')[-1]}:{line}({fn})")
    for r in runs:
        med = "  ".join(f"{k} {v:.0f}" for k, v in r["median_us_per_admitting_boundary"].items())
        idle = "-" if r["gpu_idle_fraction"] is None else f"{100 * r['gpu_idle_fraction']:.1f}%"
        plain = "  ".join(f"{k} {v:.0f}" for k, v in r["median_us_per_plain_step"].items())
        print(f"{r['backend']} {r['model']} k={r['k']} M={r['m']} depth={r['depth']} admission={r['admission']}: "
              f"{r['bursts']} bursts, wall {r['wall_ms']:.1f} ms, "
              f"{r['admitting_boundaries']}/{r['boundaries']} admitting boundaries "
              f"({r['deferred_boundaries']} deferred), "
              f"host {r['host_us_per_step']:.0f} µs/step, GPU busy {r['gpu_busy_ms']} ms idle {r['gpu_idle_ms']} ms "
              f"({idle}; admission spans {r['gpu_admission_ms']} ms); median µs per admitting boundary: {med}; "
              f"per plain step: {plain}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
