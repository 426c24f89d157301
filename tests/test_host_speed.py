"""scripts/host_speed.py: one timing per CPU and pass, and the process's affinity restored."""

from __future__ import annotations

import os

import pytest
from scripts_import import import_script

host_speed = import_script("host_speed")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_every_cpu_is_timed_each_pass_and_the_affinity_comes_back(tmp_path, capsys):
    before = os.sched_getaffinity(0)
    out = tmp_path / "speed.json"
    host_speed.main(["--iterations", "2000", "--passes", "2", "--tries", "1", "--json", str(out)])
    assert os.sched_getaffinity(0) == before
    lines = capsys.readouterr().out.splitlines()
    assert [int(line.split()[0]) for line in lines] == sorted(before)
    assert all(len(line.split()) == 3 and all(float(t) > 0 for t in line.split()[1:]) for line in lines)
    assert out.exists()


def test_a_longer_loop_takes_longer():
    assert host_speed.loop_ms(2_000_000) > host_speed.loop_ms(2_000)
