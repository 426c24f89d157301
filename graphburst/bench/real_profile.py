"""``graphburst bench real --profile DIR``: where a round's time goes, per engine.

One checked run of an engine under ``torch.profiler``: a Chrome trace per engine in DIR
(open it in Perfetto) and the top kernels by device time per round in the JSON, so a
missed target can be read from measurement (which kernels, how many µs).
"""

from __future__ import annotations

import os

TOP = 12


def _device_us(evt, cuda: bool) -> float:
    if not cuda:
        return evt.cpu_time_total
    # torch >= 2.4 names it device_time_total; older builds cuda_time_total.
    return getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)


def profile_run(engine, name: str, prompts, rounds: int, tokens: int, out_dir: str, tag: str, cuda: bool) -> dict:
    """Profile one run of ``engine`` (prefilled outside the profile); write ``{tag}_{name}.json`` to ``out_dir``.

    Returns
    -------
    dict with ``trace`` (path) and ``top``: up to TOP rows ``{name, calls_per_round, us_per_round}``
    sorted by device time (CPU time on the CPU).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine.prefill(prompts)
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        engine.run(rounds, tokens=tokens)
        if cuda:
            torch.cuda.synchronize()
    path = os.path.join(out_dir, f"{tag}_{name}.json")
    prof.export_chrome_trace(path)
    events = [e for e in prof.key_averages() if _device_us(e, cuda) > 0]
    if cuda:  # kernels only: the CPU-side ops' device totals would count each kernel twice
        events = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: _device_us(e, cuda), reverse=True)
    top = [dict(name=e.key[:120], calls_per_round=e.count / rounds, us_per_round=_device_us(e, cuda) / rounds)
           for e in events[:TOP]]
    return dict(trace=path, top=top)


def profile_all(engines, prompts, s, tokens, out_dir, tag, cuda) -> dict:
    """One profiled run per engine; a failure is recorded, never fatal (the figures are already taken)."""
    out = {}
    for name, eng in engines.items():
        try:
            out[name] = profile_run(eng, name, prompts, s["rounds"], tokens, out_dir, tag, cuda)
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            out[name] = f"not profiled: {type(exc).__name__}: {exc}"[:300]
    return out
