"""The torch.compile engine of ``graphburst bench real`` runs, or is reported ``not run``; it never
takes the bench down (a compiler segfault killed the whole H200 run once: rc 139)."""

from __future__ import annotations

import signal
import sys
import types

import pytest
import torch
from torch._dynamo.utils import counters

from graphburst.bench import compile_probe


def test_a_dying_probe_is_a_reason_not_a_crash():
    """A child that fails (here: an unknown model) becomes one ``not run: ...`` line with its last words."""
    why = compile_probe.probe(types.SimpleNamespace(name="no-such-model"), 1, 4, 64, 8, "bfloat16")
    assert why.startswith("not run: torch.compile probe died (exit status 1)"), why
    assert "no-such-model" in why


def test_a_segfaulting_probe_is_a_reason_not_a_crash():
    """The H200's failure (rc 139): the child dies of SIGSEGV; the parent gets one line and goes on."""
    cmd = [sys.executable, "-c", "import os, signal, sys; print('compiling', file=sys.stderr, flush=True); "
                                 "os.kill(os.getpid(), signal.SIGSEGV)"]
    why = compile_probe.child_verdict(cmd, 60)
    assert why == f"not run: torch.compile probe died (signal {int(signal.SIGSEGV)} (SIGSEGV)): compiling", why


def test_a_hung_probe_is_a_reason_not_a_wait():
    why = compile_probe.child_verdict([sys.executable, "-c", "import time; time.sleep(60)"], 0.5)
    assert why == "not run: torch.compile probe took over 0.5 s", why
    assert compile_probe.child_verdict([sys.executable, "-c", "pass"], 60) is None


def test_compile_engine_compiles_each_shape_once():
    """Dynamo traces the draft step (T = 1) and the verify (T = k + 1) once each, and engines built one
    after another in one process (the bench builds one per model and batch) each compile theirs.

    Once a fresh ``pos + j`` per draft step made every step a recompile (dynamo guards the
    length tensor's identity) until the recompile limit (8), past which the forward ran
    uncompiled under the compile engine's name. Dynamo's guards do not depend on the backend,
    so the CPU counts them under ``"eager"`` (inductor on a CPU takes a minute)."""
    from graphburst.bench.real_engines import TorchLoop
    from graphburst.bench.real_models import MODELS, random_target

    spec = MODELS["tiny"]
    src = random_target(spec, batch=2, capacity=64, kv_slack=6, dtype=torch.float32, device="cpu")
    for batch in (1, 2, 1, 2, 1):  # 5 engines: 10 frames, past the limit of 8 without the reset
        before = counters["frames"]["ok"]
        eng = TorchLoop(src, draft_layers=spec.draft_layers, batch=batch, k=4, compile_forward=True,
                        compile_backend="eager")
        assert counters["frames"]["ok"] - before == 2
        eng.prefill([[1, 2, 3, 4, 5, 6, 7, 8]] * batch)
        run = eng.run(6)
        assert counters["frames"]["ok"] - before == 2, "a compiled engine recompiled while it ran"
        assert all(len(t) >= 6 for t in run.tokens)


@pytest.mark.gpu
def test_compile_engine_runs_or_says_why():
    """On the GPU: the probe of the tiny model passes and the compiled engine runs its captured rounds.

    Its kernels differ (inductor), so only the first committed token, from the shared
    eager prefill, must equal the vllm-style loop's."""
    from graphburst.bench.real_engines import TorchLoop
    from graphburst.bench.real_models import MODELS, random_target

    spec = MODELS["tiny"]
    assert compile_probe.probe(spec, 2, 4, 128, 8, "float32") is None
    src = random_target(spec, batch=2, capacity=128, kv_slack=6, dtype=torch.float32, device="cuda")
    runs = []
    for kw in (dict(graphs=True), dict(compile_forward=True)):
        eng = TorchLoop(src, draft_layers=spec.draft_layers, batch=2, k=4, **kw)
        eng.prefill([[1, 2, 3, 4, 5, 6, 7, 8]] * 2)
        runs.append(eng.run(6).tokens)
    assert [t[0] for t in runs[0]] == [t[0] for t in runs[1]]
    assert all(len(t) >= 6 for t in runs[1])

