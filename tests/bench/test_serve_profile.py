"""``graphburst bench serve --profile`` run as a user runs it, on numpy, small sizes: its three views
come out checked and consistent; every method its phase table names exists (a rename fails here);
the gap classification by hand; the flags it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from graphburst.backend import get_backend
from graphburst.bench import serve_profile
from graphburst.serving.request import Request

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--refill-requests", "20", "--batch", "4", "--new-tokens", "12", "-k", "2", "-m", "2", "--repeats", "2"]
SHAPE = {"model": None, "requests": 20, "new_tokens": 12, "batch": 4, "k": 2, "m": 2, "admission": "auto",
         "prefill_chunk": None}


def _cli(*args, tmp_path=None, check=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    extra = [] if tmp_path is None else ["--json", str(tmp_path / "profile.json")]
    proc = subprocess.run([sys.executable, "-m", "graphburst.cli", "bench", "serve", "--profile", "--backend", "numpy",
                           *args, *extra], capture_output=True, text=True, env=env, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profile")
    proc = _cli(*SMALL, "--pipeline-depth", "2", "3", tmp_path=tmp)
    return proc.stdout, json.loads((tmp / "profile.json").read_text())


def test_the_three_views_are_printed_and_written(profiled):
    out, res = profiled
    for title in ("host time of a burst boundary by phase", "host µs per step by phase",
                  "GPU idle by what preceded each launch"):
        assert title in out
    assert res["meta"]["profile"] and res["meta"]["backend"] == "numpy" and "CPU REFERENCE" in res["meta"]["label"]
    assert (res["meta"]["requests"], res["meta"]["batch"], res["meta"]["repeats"]) == (20, 4, 2)
    views = [(r["view"], r["depth"]) for r in res["results"]]
    assert views == [("boundary", 2), ("boundary", 3), ("host", 2), ("host", 3)] + [("gaps", 2)] * 2 + [("gaps", 3)] * 2


def test_the_boundary_view_times_nested_phases_of_every_wave(profiled):
    for r in (r for r in profiled[1]["results"] if r["view"] == "boundary"):
        assert r["admitting_boundaries_per_run"] >= 20 // 4  # 20 requests through 4 slots: five waves at least
        med = r["median_us_per_admitting_boundary"]
        assert 1 <= med["slots"] <= 4
        # inclusive times, each boundary's inner phase within its caller: so are their medians
        assert 0 < med["stage"] <= med["prefill"] <= med["boundary"] <= med["step"]
        assert med["graph"] <= med["prefill"] and med["take"] <= med["boundary"] and med["release"] <= med["free"]
        assert med["wait"] <= med["drain"]
        plain = r["median_us_per_plain_step"]
        assert 0 < plain["deliver"] <= plain["step"] and plain["wait"] <= plain["drain"]
        assert r["gpu_idle_fraction"] is None and r["gpu_admission_ms"] is None  # numpy: no device clock
        assert all(run["bursts"] > 0 and run["boundaries"] >= r["admitting_boundaries_per_run"] for run in r["runs"])


def test_the_host_view_leaves_the_device_work_out(profiled):
    for r in (r for r in profiled[1]["results"] if r["view"] == "host"):
        med = r["median_us_per_step"]
        assert r["steps"] >= r["bursts"] > 0 and r["mean_host_us_per_burst"] > 0
        assert med["device"] > 0  # numpy ran the graphs' programs on the host: timed, then taken out
        assert all(med[c] >= 0 for c in ("drain", "wait", "launch", "deliver", "boundary"))
        assert max(med["drain"], med["launch"], med["deliver"]) <= med["total"]


def test_the_gaps_view_counts_launches_without_a_device_clock(profiled):
    rows = [r for r in profiled[1]["results"] if r["view"] == "gaps"]
    assert [(r["depth"], r["run"]) for r in rows] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert all(r["bursts"] > 3 and not r["timed"] and r["idle_pct"] is None for r in rows)


def test_every_method_the_phase_table_names_exists():
    loop = serve_profile.build_loop(get_backend("numpy"), dict(SHAPE), 2)
    for view, phases in serve_profile.PHASES.items():
        for label, path, method in phases:
            found = serve_profile.owners(loop, path)
            assert found, (view, label, path)
            for owner in found:
                obj = owner[0][owner[1]] if isinstance(owner, tuple) else owner
                assert callable(getattr(obj, method, None)), f"{view}/{label}: {path}.{method} is gone"
    with pytest.raises(AttributeError):
        serve_profile.owners(loop, "boundary.no_such_part")


def test_a_run_whose_tokens_are_not_the_greedy_references_fails_its_check():
    loop = serve_profile.build_loop(get_backend("numpy"), dict(SHAPE), 2)
    state = loop.submit(Request([5, 9], 6))
    loop.run_until_idle()
    serve_profile._check(SHAPE, "ok", [state])
    state._tokens = list(state.tokens[:-1]) + [(state.tokens[-1] + 1) % 32000]
    with pytest.raises(AssertionError, match="differs from the greedy reference"):
        serve_profile._check(SHAPE, "altered", [state])
    state._tokens = state._tokens[:-1]
    with pytest.raises(AssertionError, match="without all their tokens"):
        serve_profile._check(SHAPE, "short", [state])


def test_gaps_go_to_the_launch_after_an_admission_and_the_one_after_it():
    admitted = [64, 0, 5, 0, 0, 3, 2, 0]
    gaps = [None, 0.001, 0.2, 0.05, 0.002, 0.1, 0.3, None]  # ms; the first burst has none
    got = serve_profile.classify(admitted, gaps)
    assert got["admit"] == (3, 600.0)  # launches 2, 5 and 6
    assert got["after"] == (3, 51.0)  # launches 1 (after 0), 3 (after 2) and 7 (after 6, no gap)
    assert got["plain"] == (1, 2.0)  # launch 4
    assert got["plain_p50_us"] == 2.0 == got["plain_p90_us"]
    assert np.isclose(sum(got[c][1] for c in serve_profile.GAP_CATEGORIES), 653.0)


@pytest.mark.parametrize("flags,message", [
    (["--http"], "--http: the profile runs the loop in process"),
    (["--model", "no-such-shape"], "--profile takes a random-weight shape"),
    (["--refill-requests", "0"], "--refill-requests: --profile runs the refill workload"),
    (["--rates", "2"], "--rates: applies to the open-loop benchmark only"),
])
def test_flags_the_profile_refuses(flags, message):
    proc = _cli(*flags, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_repeats_belongs_to_the_profile():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "graphburst.cli", "bench", "serve", "--repeats", "2", "--backend",
                           "numpy"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "--repeats: applies to --profile only" in proc.stderr, proc.stderr


def test_a_timer_leaves_its_loop_as_it_found_it():
    """Leaving a PhaseTimer unwraps every method: the loop's own show again, and the dead loop is
    freed by reference counting (a cycle would leave its graphs to the cyclic collector, which may
    run inside a later loop's capture)."""
    import gc
    import weakref

    loop = serve_profile.build_loop(get_backend("numpy"), dict(SHAPE), 2)
    events = list(loop.pipeline.graph._events)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for view in serve_profile.PHASES:
            with serve_profile.PhaseTimer(loop, view) as timer:
                assert "run" in vars(loop.boundary) or view == "gaps"
                loop.submit(Request([2, 7], 5))
                loop.run_until_idle()
            assert any(timer.spent.values())
            assert "run" not in vars(loop.boundary) and loop.pipeline.graph._events == events
        ref = weakref.ref(loop)
        del loop
        assert ref() is None
    finally:
        if enabled:
            gc.enable()
