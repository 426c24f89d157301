"""``graphburst bench real`` as a user runs it, for the tests of its runs and views.

``cli``: the command in a fresh interpreter (its exit status, stdout, stderr); ``cli_json``:
the same, asserting exit 0, with the JSON it wrote; ``cli_here``: the command in this process
(so a test can replace a part, a check say, and see the command report it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cli(*args, cwd, timeout=240, env=None):
    """``env``: variables to set in the child beyond this process's own."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "graphburst.cli", "bench", "real", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)


def cli_json(*args, cwd, name="out.json", env=None):
    """Run with ``--json cwd/name``; (the JSON document, stdout). The run must exit 0."""
    out = Path(cwd) / name
    proc = cli(*args, "--json", out, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def cli_here(*args, capsys) -> tuple[int, str]:
    """``graphburst bench real ARGS`` in this process; (exit status, stdout)."""
    from graphburst import cli as command

    rc = command.main(["bench", "real", *map(str, args)])
    return rc, capsys.readouterr().out
