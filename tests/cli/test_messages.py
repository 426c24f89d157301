"""What the command line says is right: the --eps refusal explains the value it refuses, bench real counts
the engines it runs, and a record of the serve command advises its flag, never a Python call."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from graphburst.bench.real_args import DEFAULT_ENGINES

from flag_errors import flag_error

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


@pytest.mark.parametrize("value", ["0", "1.5"])
def test_the_eps_refusal_says_what_the_refused_value_would_do(capsys, value):
    """ε scales the target's blocks past the draft: 0 is refused because the target would compute the draft
    itself, not offered as a setting ("0: the target is the draft"), and 1 is the blocks as drawn."""
    line = flag_error(capsys, "bench", "real", "--backend", "numpy", "--smoke", "--eps", value)
    assert "(0, 1]" in line and f"got {float(value)}" in line
    assert "(0: " not in line and "at 0 they vanish and the target computes the draft itself" in line, line
    assert "1 leaving them as drawn" in line, line


@pytest.mark.parametrize("engines", [None, "graphburst,hf"])
def test_bench_real_counts_the_engines_it_runs(capsys, engines):
    flags = [] if engines is None else ["--engines", engines]
    line = flag_error(capsys, "bench", "real", "--backend", "numpy", "--batches", "100000", *flags)
    n = len((engines or DEFAULT_ENGINES).split(","))
    assert re.search(rf"\b{n} engines and their source model x batch 100000\b", line), line


def test_a_serve_record_advises_the_flag_not_a_python_call():
    """`graphburst serve` without --sampling: a line with temperature > 0 gets a record naming --sampling."""
    res = subprocess.run([sys.executable, "-m", "graphburst.cli", "serve", "--backend", "numpy", "--batch", "2",
                          "--vocab", "100", "--capacity", "64"],
                         input=b'{"prompt": [1, 2], "max_new_tokens": 3, "temperature": 0.8}\n', capture_output=True,
                         env=ENV, timeout=120, check=False)
    (rec,) = map(json.loads, res.stdout.splitlines())
    assert rec["error"].startswith("temperature 0.8 needs sampling, but this loop decodes greedily"), rec
    assert "--sampling" in rec["error"] and "(" not in rec["error"] and "=True" not in rec["error"], rec


def test_the_library_error_still_names_the_python_argument():
    from graphburst import stub_pair
    from graphburst.serving.loop import ServeLoop
    from graphburst.serving.request import Request, SamplingOff

    target, draft = stub_pair(2, 50, 1, 1, 64, backend="numpy")
    with pytest.raises(SamplingOff, match=r"ServeLoop\(\.\.\., sampling=True\)") as info:
        ServeLoop(target, draft, k=2, m_rounds=2).submit(Request([1, 2], 5, temperature=0.7))
    assert "graphburst serve" not in str(info.value) and info.value.temperature == 0.7
