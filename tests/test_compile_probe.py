"""The torch.compile engine of ``graphburst bench real`` runs, or is reported ``not run``; it never
takes the bench down (a compiler segfault killed the whole H200 run once: rc 139)."""

from __future__ import annotations

import types

import pytest
import torch

from graphburst.bench import compile_probe


def test_a_dying_probe_is_a_reason_not_a_crash():
    """A child that fails (here: an unknown model) becomes one ``not run: ...`` line with its last words."""
    why = compile_probe.probe(types.SimpleNamespace(name="no-such-model"), 1, 4, 64, 8, "bfloat16")
    assert why.startswith("not run: torch.compile probe died (exit status 1)"), why
    assert "no-such-model" in why


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
