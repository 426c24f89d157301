"""scripts/version_ab.py: another commit's package imported beside the working tree's, the
workload's checks, and the summary's pairs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from scripts_import import import_script

version_ab = import_script("version_ab")


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def test_another_commits_package_imports_under_its_own_name(tmp_path):
    repo = tmp_path / "repo"
    pkg = repo / "graphburst"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('from .part import VALUE\nLAZY = {"x": "graphburst.part"}\n')
    (pkg / "part.py").write_text("VALUE = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    (pkg / "part.py").write_text("VALUE = 2\n")  # the working copy moves on; the commit's is imported
    into = tmp_path / "into"
    into.mkdir()
    try:
        base = version_ab.import_base("HEAD", into, repo=str(repo))
        assert base.__name__ == version_ab.BASE_NAME and base.VALUE == 1
        assert base.LAZY == {"x": f"{version_ab.BASE_NAME}.part"}  # absolute names follow the package
    finally:
        sys.path.remove(str(into))
        for name in [n for n in sys.modules if n.split(".")[0] == version_ab.BASE_NAME]:
            del sys.modules[name]
    into = tmp_path / "from_tree"
    into.mkdir()
    try:  # the working copy as a tree (a machine without the repository)
        base = version_ab.import_base(None, into, tree=str(repo))
        assert base.VALUE == 2 and base.LAZY == {"x": f"{version_ab.BASE_NAME}.part"}
    finally:
        sys.path.remove(str(into))
        for name in [n for n in sys.modules if n.split(".")[0] == version_ab.BASE_NAME]:
            del sys.modules[name]


def test_a_run_serves_every_request_and_the_summary_counts_pairs(monkeypatch):
    import graphburst

    monkeypatch.setattr(version_ab, "REQUESTS", 12)
    monkeypatch.setattr(version_ab, "NEW", 20)
    row = version_ab.run(graphburst, "numpy", 2, 2)
    assert row["code"] == "graphburst" and row["bursts"] > 0 and row["idle"] is None  # no GPU timing on numpy
    rows = [row | {"rep": 0}, row | {"code": version_ab.BASE_NAME, "rep": 0}]
    assert any("idle -" in line for line in version_ab.summarize(rows))
    timed = [{**r, "idle": i} for r, i in zip(rows, (0.1, 0.2))] + [
        {**r, "idle": i, "rep": 1} for r, i in zip(rows, (0.3, 0.2))]
    other = [{**r, "m": 3, "idle": 0.5 if r["code"] == "graphburst" else 0.1} for r in timed]  # another M's pairs
    lines = version_ab.summarize(timed + other)
    assert lines[2] == "M=2 depth=2: the working tree idled less in 1 of 2 pairs"
    assert lines[-1] == "M=3 depth=2: the working tree idled less in 0 of 2 pairs"
    assert "graphburst idle  20.0% (runs 10.0, 30.0)" in lines[1]


def test_a_request_short_of_its_tokens_fails_the_run(monkeypatch):
    import dataclasses

    import graphburst
    from graphburst.serving.loop import ServeLoop

    monkeypatch.setattr(version_ab, "REQUESTS", 4)
    monkeypatch.setattr(version_ab, "NEW", 10)
    real = ServeLoop.submit

    def one_short(self, req, **kw):  # a loop that serves the workload's requests one token fewer than asked
        short = req.max_new_tokens - (req.max_new_tokens == 10)
        return real(self, dataclasses.replace(req, max_new_tokens=short), **kw)

    monkeypatch.setattr(ServeLoop, "submit", one_short)
    with pytest.raises(AssertionError, match="without all their tokens"):
        version_ab.run(graphburst, "numpy", 2, 2)


def test_coalesce_ab_runs_the_shared_workload_and_puts_the_rule_back(monkeypatch):
    from graphburst.serving.admit import LoopAdmission

    coalesce_ab = import_script("coalesce_ab")
    real = LoopAdmission._coalesce_limit
    monkeypatch.setattr(version_ab, "REQUESTS", 8)
    monkeypatch.setattr(version_ab, "NEW", 12)
    for rule in coalesce_ab.RULES:
        row = coalesce_ab.run("numpy", 2, rule, depth=3)
        assert row["rule"] == rule and row["bursts"] > 0 and row["deferred"] == 0  # numpy: never host-bound
        assert LoopAdmission._coalesce_limit is real
    monkeypatch.setattr(version_ab, "NEW", 0)  # refused at submission: the run fails, the rule is put back
    with pytest.raises(ValueError):
        coalesce_ab.run("numpy", 2, "one")
    assert LoopAdmission._coalesce_limit is real
