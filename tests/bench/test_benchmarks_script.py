"""scripts/benchmarks.sh: every ``graphburst bench`` command it runs parses with the real command line (a renamed
or dropped flag fails here, not an hour into a GPU run), writes its JSON into OUT, and a failed step is reported
while the next one still runs."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "benchmarks.sh"
#: the steps behind docs/benchmarks.md's tables, in order, with the bench command each runs
STEPS = [("latency_quick", "latency"), ("capture", "capture"), ("serve", "serve"), ("serve_profile", "serve"),
         ("serve_1b_http", "serve"),
         *[(f"serve_exit_{load}_{dx}", "serve") for dx in ("on", "ladder", "off") for load in ("1b_r16", "1b_r128", "8b_r4")],
         ("real", "real"), ("real_summary", "real"), ("real_profile", "real"), ("forward_kernels", "real"),
         ("ngram", "ngram"), ("ngram_text_b1", "ngram"), ("ngram_text_b16_64", "ngram"), ("ngram_plain", "ngram"),
         ("ngram_folded", "ngram")]


def run_script(out, *args, **env):
    return subprocess.run(["bash", str(SCRIPT), str(out), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GRAPHBURST": "graphburst", **env})


def dry_run(out) -> dict[str, list[str]]:
    """``--dry-run``'s steps: name -> argv (``graphburst`` first)."""
    proc = run_script(out, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    steps = {}
    for line in proc.stdout.splitlines():
        head, _, command = line.partition("): ")
        assert line.startswith("== ") and command, line
        steps[head[3:].split(" (")[0]] = shlex.split(command)
    return steps


def test_the_steps_and_their_outputs(tmp_path):
    out = tmp_path / "out"
    steps = dry_run(out)
    assert [(name, argv[2]) for name, argv in steps.items()] == STEPS
    assert not out.exists()  # a dry run makes nothing
    for name, argv in steps.items():
        assert argv[:2] == ["graphburst", "bench"], argv
        if name == "real_summary":  # it reads the real step's JSON and writes none
            assert argv[argv.index("--summary") + 1] == str(out / "real.json")
            continue
        assert argv[argv.index("--json") + 1] == str(out / f"{name}.json"), argv
    assert "--profile" in steps["serve_profile"] and "--profile" in steps["real_profile"]
    assert steps["real"][steps["real"].index("--plot") + 1].startswith(str(out))  # never the docs' PNG


@pytest.mark.parametrize("name", [name for name, _ in STEPS])
def test_every_command_parses_with_the_real_command_line(tmp_path, monkeypatch, name):
    """graphburst.cli.main parses the step's argv with every command's real parser; only the benchmark's checks
    and its run are replaced (they need the GPU the script is for)."""
    from graphburst import bench, cli

    argv = dry_run(tmp_path / "out")[name]
    (tmp_path / "out").mkdir()  # as the script makes it before its first step (--json wants its folder)
    seen = []
    monkeypatch.setattr(bench, "check_args", lambda args: seen.append(args))
    monkeypatch.setattr(bench, "run", lambda args, console: 0)
    try:
        assert cli.main(argv[1:]) == 0
    except SystemExit as exc:  # argparse's exit on a flag it does not know
        pytest.fail(f"{name}: {shlex.join(argv)} does not parse (exit {exc.code})")
    (args,) = seen
    assert args.command == "bench" and args.benchmark == dict(STEPS)[name]


def test_a_failed_step_is_reported_and_the_next_runs(tmp_path):
    """A stand-in command that fails the real step: the script says so, runs the summary after it, exits 1."""
    fake = tmp_path / "fake_graphburst"
    fake.write_text(f"#!{sys.executable}\nimport sys\nprint('ran', *sys.argv[1:])\n"
                    "sys.exit(3 if '--plot' in sys.argv else 0)\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = run_script(out, GRAPHBURST=str(fake), STEPS="real real_summary")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "real: FAILED (exit status 3)" in proc.stdout and "real_summary: done" in proc.stdout
    assert f"== FAILED: real (logs in {out})" in proc.stdout
    assert (out / "real_summary.log").read_text().startswith(f"ran bench real --summary {out}/real.json")
    assert (out / "env.txt").exists() and not (out / "ngram.log").exists()
