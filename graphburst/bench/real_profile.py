"""``torch.profiler`` for ``graphburst bench real``: where a round's, a forward's or an admission's time goes.

``--trace DIR`` on the engine comparison: one checked run of each engine under the
profiler, a Chrome trace per engine in DIR (open it in Perfetto) and the top kernels by
device time per round in the JSON, so a missed target can be read from measurement
(which kernels, how many µs). The profile views (``--profile``, :mod:`.real_forward`,
:mod:`.real_prefill`) read their kernel times through :func:`op_totals` too.
"""

from __future__ import annotations

import os

TOP = 12


def activities(cuda: bool) -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])


def op_totals(prof, cuda: bool) -> dict[str, tuple[int, float]]:
    """``{name: (calls, µs)}`` of a finished profile: each kernel's device time on a GPU, each op's
    self CPU time on the CPU.

    Kernels only on a GPU (a CPU-side op's device total is its kernels' again), self time on
    the CPU (an op's total holds its children's): either way the figures sum without counting
    any time twice.
    """
    import torch

    out = {}
    for evt in prof.key_averages():
        if cuda:
            if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            # torch >= 2.4 names it device_time_total; older builds cuda_time_total.
            us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        else:
            us = evt.self_cpu_time_total
        if us > 0:
            out[evt.key] = (evt.count, us)
    return out


def top_rows(totals: dict, per: int, n: int = TOP) -> list[dict]:
    """The ``n`` names of most µs, as ``{name, calls_per_round, us_per_round}`` over ``per`` rounds or calls."""
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:n]
    return [dict(name=name[:120], calls_per_round=calls / per, us_per_round=us / per) for name, (calls, us) in rows]


def profiled(fn, cuda: bool, trace: str | None = None, only_cuda: bool = False):
    """Run ``fn()`` under the profiler (synced after on a GPU); the profile, its Chrome trace written to ``trace``.

    ``only_cuda``: record kernels alone on a GPU (no CPU-side ops, so the profiled calls keep
    their own launch pace).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if cuda and only_cuda else activities(cuda)
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(trace)
    return prof


def profile_run(engine, name: str, prompts, rounds: int, tokens: int, out_dir: str, tag: str, cuda: bool) -> dict:
    """Profile one run of ``engine`` (prefilled outside the profile); write ``{tag}_{name}.json`` to ``out_dir``.

    Returns
    -------
    dict with ``trace`` (path) and ``top``: up to TOP rows ``{name, calls_per_round, us_per_round}``
    sorted by device time (self CPU time on the CPU).
    """
    import torch

    engine.prefill(prompts)
    if cuda:
        torch.cuda.synchronize()
    path = os.path.join(out_dir, f"{tag}_{name}.json")
    prof = profiled(lambda: engine.run(rounds, tokens=tokens), cuda, path)
    return dict(trace=path, top=top_rows(op_totals(prof, cuda), rounds))


def profile_all(engines, prompts, s, tokens, out_dir, tag, cuda) -> dict:
    """One profiled run per engine; a failure is recorded, never fatal (the figures are already taken)."""
    out = {}
    for name, eng in engines.items():
        try:
            out[name] = profile_run(eng, name, prompts, s["rounds"], tokens, out_dir, tag, cuda)
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            out[name] = f"not profiled: {type(exc).__name__}: {exc}"[:300]
    return out
