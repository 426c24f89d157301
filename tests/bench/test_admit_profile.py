"""scripts/admit_profile.py on the CPU: the refill workload runs to the end with every request's tokens,
and the boundary phases it reports add up (a phase inside another never exceeds it)."""

from __future__ import annotations

import pytest
from scripts_import import import_script


@pytest.fixture(scope="module")
def ap():
    return import_script("admit_profile")


def test_refill_phases_nest_and_every_request_finishes(ap):
    r = ap.measure("numpy", requests=20, batch=4, new_tokens=12, k=2, m=2)
    assert r["model"] == "stubs" and r["bursts"] > 0
    assert r["admitting_boundaries"] >= 20 // 4  # 20 requests through 4 slots: at least five waves
    med = r["median_us_per_admitting_boundary"]
    assert 1 <= med["slots"] <= 4
    assert r["gpu_idle_fraction"] is None and r["gpu_admission_ms"] is None  # numpy: no device timing
    total = r["total_ms"]  # inclusive times: an inner phase's total never passes its caller's
    assert total["stage"] + total["models"] + total["admit"] <= total["prefill"] <= total["boundary"] <= total["step"]
    assert total["wait"] <= total["drain"] <= total["step"]
