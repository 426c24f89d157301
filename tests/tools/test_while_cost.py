"""tools/while_cost.py on the CPU: its command line (the measurement itself needs a GPU and cuda-python,
and runs on one: docs/benchmarks.md, "Capture costs")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "while_cost.py"


def run(*args):
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


def test_help_needs_no_gpu():
    proc = run("--help")
    assert proc.returncode == 0 and "--rounds" in proc.stdout and "--kernels" in proc.stdout


@pytest.mark.parametrize("flag", ["--rounds", "--kernels", "--reps"])
def test_a_count_below_one_is_one_line_and_exit_2(flag):
    proc = run(flag, "0")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "must be >= 1" in proc.stderr
