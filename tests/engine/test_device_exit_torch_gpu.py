"""Torch ops in a WHILE body: ``tools/torch_while_probe.py`` in a process of its own (a failed capture
may leave torch's allocator in capture state) must find the body run 3 times with its temporaries in
the graph's pool, the check that lets device exit serve torch models; ``-s`` shows its line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from marks import gpu

pytestmark = gpu
ROOT = Path(__file__).resolve().parents[2]


def test_torch_while_body_allocator_probe():
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "torch_while_probe.py")], capture_output=True,
                          text=True, env=env, timeout=300, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TORCH_WHILE_PROBE ")]
    print(f"\nexit {proc.returncode}; {lines[-1] if lines else proc.stderr[-2000:]}")
    assert lines, proc.stderr[-2000:]
    report = json.loads(lines[-1].split(" ", 1)[1])
    assert report["ok"] and report["x"] == 8.0 and report["body_temps_in_graph_pool"] is True, report


def _pair_decoders(backend, n=2):
    from graphburst import SpecDecoder
    from graphburst.models.checkpoint import tiny_random_pair

    decs = []
    for _ in range(n):
        target, draft = tiny_random_pair(batch=3, capacity=512, backend=backend, seed=1)
        decs.append(SpecDecoder(target, draft, k=3, m_rounds=4))
    return decs


def _run_until_idle(graph, dec, out):
    bursts = rounds = 0
    while (dec.host_left > 0).any():
        for b, t in enumerate(graph.run()):
            out[b] += t.tolist()
        bursts, rounds = bursts + 1, rounds + graph.last_rounds
    return bursts, rounds


def test_a_torch_pair_in_the_while_body_gives_the_fixed_burst_tokens_over_1000_bursts_of_churn():
    """The tiny random Llama pair (fp32, torch-captured) in a device-exit graph and in a fixed-M graph,
    captured once each: new prompts and budgets for every slot whenever all are done, until the
    device-exit graph has run 1000 bursts; every sequence's tokens equal the fixed graph's, and bursts
    end early (idle) where budgets run out."""
    pytest.importorskip("torch")
    from graphburst.backend import Backend
    from graphburst.capture import BurstGraph

    backend = Backend("cupy")
    dec, twin = _pair_decoders(backend)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, int(rng.integers(1, 9))).tolist() for _ in range(3)]
    budgets = [int(b) for b in rng.integers(1, 24, 3)]
    for d in (dec, twin):
        d.prefill(prompts, max_new_tokens=budgets)
    graph, fixed = BurstGraph(dec, device_exit=True), BurstGraph(twin)
    assert graph.device_exit and "torch:" in graph.device_exit_probe, graph.device_exit_probe
    bursts, rounds, short, cycles = 0, 0, 0, 0
    while bursts < 1000:
        out, want = [[] for _ in range(3)], [[] for _ in range(3)]
        n, r = _run_until_idle(graph, dec, out)
        _run_until_idle(fixed, twin, want)
        assert out == want, f"cycle {cycles}"
        assert [len(o) for o in out] == budgets, f"cycle {cycles}"
        bursts, rounds, short, cycles = bursts + n, rounds + r, short + (r < n * 4), cycles + 1
        prompts = [rng.integers(1, 500, int(rng.integers(1, 9))).tolist() for _ in range(3)]
        budgets = [int(b) for b in rng.integers(1, 24, 3)]
        for d in (dec, twin):
            d.prefill(prompts, max_new_tokens=budgets)
    assert graph.captures == 1 and fixed.captures == 1
    print(f"\n{bursts} device-exit bursts over {cycles} cycles, {rounds / bursts:.2f} rounds a burst (M_max 4)")
    assert short > 0  # some cycle's bursts ran fewer rounds than M_max in all: the idle exit


def test_a_torch_pair_with_a_stop_before_launch_runs_zero_rounds_and_changes_nothing():
    pytest.importorskip("torch")
    from graphburst.backend import Backend
    from graphburst.capture import BurstGraph

    backend = Backend("cupy")
    dec, twin = _pair_decoders(backend)
    for d in (dec, twin):
        d.prefill([[1, 2, 3], [4, 5], [6]], max_new_tokens=[30, 30, 30])
    graph, ref = BurstGraph(dec, device_exit=True, hold_stops=True), BurstGraph(twin, device_exit=True)
    graph.request_stop()
    assert graph.run().total == 0 and graph.last_rounds == 0 and graph.last_exit_reason == "flag"
    assert graph.run().total == 0  # held: still pending
    graph.answer_stop()
    for _ in range(3):
        assert [t.tolist() for t in graph.run()] == [t.tolist() for t in ref.run()]
        assert graph.last_rounds == ref.last_rounds == 4
