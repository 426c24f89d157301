"""scripts/idle_gaps.py: the gap classification by hand, and a checked run on numpy."""

from __future__ import annotations

import json

from scripts_import import import_script

idle_gaps = import_script("idle_gaps")


def test_gaps_go_to_the_launch_after_an_admission_and_the_one_after_it():
    admitted = [64, 0, 5, 0, 0, 3, 2, 0]
    gaps = [None, 0.001, 0.2, 0.05, 0.002, 0.1, 0.3, None]  # ms; the first burst has none
    got = idle_gaps.classify(admitted, gaps)
    assert got["admit"] == (3, 600.0)  # launches 2, 5 and 6
    assert got["after"] == (3, 51.0)  # launches 1 (after 0), 3 (after 2) and 7 (after 6, no gap)
    assert got["plain"] == (1, 2.0)  # launch 4
    assert got["plain_p50_us"] == 2.0


def test_a_small_run_on_numpy_is_checked_and_counted(tmp_path, capsys):
    out = tmp_path / "gaps.json"
    rows = idle_gaps.main(["--backend", "numpy", "-m", "2", "--repeats", "1", "--requests", "12", "--batch", "4",
                           "--new", "9", "--json", str(out)])
    assert len(rows) == 1 and rows[0]["bursts"] > 3 and not rows[0]["timed"]
    assert "GPU idle by what preceded each launch" in capsys.readouterr().out
    assert json.loads(out.read_text())["runs"] == rows
