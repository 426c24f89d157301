"""Diagnostic: does torch's capture allocator serve a WHILE body's temporaries from the graph's pool?

Runs ``tools/torch_while_probe.py`` in a process of its own (a failed capture may leave torch's
allocator in capture state) and prints its JSON line; ``-s`` shows it. It asserts only that the
probe ran to a report: the finding decides whether device exit may be offered to torch models,
which graphburst refuses today (``conditional.TORCH_REFUSAL``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    assert "capture" in report or "error" in report
