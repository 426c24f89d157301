"""``graphburst bench ngram`` run as a user runs it, on numpy with the tiny model (every code path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_ngram_smoke_on_numpy(tmp_path):
    out = tmp_path / "out.json"
    args = ["--smoke", "--backend", "numpy", "--json", str(out), "--batches", "1,3", "--histories", "1,40",
            "--e2e-batches", "1", "--workloads", "repeat,echo", "--prompt-len", "12", "--new-tokens", "10"]
    proc = subprocess.run([sys.executable, "-m", "graphburst.cli", "bench", "ngram", *args], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert "CPU REFERENCE" in res["meta"]["label"]
    assert [(r["batch"], r["history"]) for r in res["results"]["search"]] == [(1, 1), (1, 40), (3, 1), (3, 40)]
    assert all(r["checked"] and r["us_median"] > 0 for r in res["results"]["search"])
    e2e = res["results"]["e2e"]
    assert {(r["workload"], r["engine"]) for r in e2e} == {
        (w, e) for w in ("repeat", "echo") for e in ("graphburst-ngram", "plain", "hf-lookup", "hf-plain")}
    assert all(r["agreed_tokens"] == 10 for r in e2e)  # fp32 on the CPU: every engine's tokens agree


def test_bench_ngram_flag_errors():
    for args, flag in ((["--batches", "0"], "--batches"), (["--workloads", "x"], "--workloads")):
        proc = subprocess.run([sys.executable, "-m", "graphburst.cli", "bench", "ngram", "--backend", "numpy", *args],
                              capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
        assert proc.returncode == 2 and flag in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_an_engine_that_diverges_is_recorded_not_a_crash(tmp_path, monkeypatch):
    """A comparison engine whose tokens leave graphburst's (not at a near-tie) is a FAILED row and exit status 1,
    as in bench real; the other engines are still timed and the JSON is still written."""
    from graphburst import cli
    from graphburst.bench import real_checks

    honest = real_checks.compare_other

    def strict(name, *args, **kw):
        if name.startswith("hf-lookup"):
            raise AssertionError(f"{name}: token 3 is 1, graphburst's is 2, and the reference logits differ")
        return honest(name, *args, **kw)

    monkeypatch.setattr(real_checks, "compare_other", strict)
    out = tmp_path / "out.json"
    rc = cli.main(["bench", "ngram", "--smoke", "--backend", "numpy", "--parts", "e2e", "--e2e-batches", "1",
                   "--workloads", "repeat", "--prompt-len", "12", "--new-tokens", "6", "--json", str(out)])
    assert rc == 1
    rows = {r["engine"]: r for r in json.loads(out.read_text())["results"]["e2e"]}
    assert "token 3 is 1" in rows["hf-lookup"]["failed"] and "tokens_per_s" not in rows["hf-lookup"]
    assert rows["plain"]["tokens_per_s"] > 0 and rows["graphburst-ngram"]["speedup_vs_plain"] > 0
