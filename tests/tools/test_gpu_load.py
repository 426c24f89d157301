"""tools/gpu_load.py: its flags and sizing on any machine (no cupy needed for --help), and a short
run on a GPU that prints its two lines."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from marks import requires_gpu

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu_load.py"


@pytest.fixture(scope="module")
def tool():
    """tools/gpu_load.py as a module (tools/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_load", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(*args, timeout=60):
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_help_needs_no_cupy():
    out = run("--help")  # cupy is imported inside main, after the flags are parsed
    assert out.returncode == 0, out.stderr
    assert all(flag in out.stdout for flag in ("--seconds", "--mem-gb", "--duty", "pytest -m gpu"))


@pytest.mark.parametrize("args, message", [(["--seconds", "0"], "--seconds: must be a number > 0"),
                                           (["--seconds", "nan"], "--seconds: must be a number > 0"),
                                           (["--seconds", "x"], "--seconds: expected a number"),
                                           (["--mem-gb", "0.01"], "--mem-gb: must be at least 0.0625"),
                                           (["--duty", "1.5"], "--duty: must be at most 1"),
                                           (["--duty", "0"], "--duty: must be a number > 0")])
def test_bad_flags_exit_2_naming_the_flag(args, message):
    out = run(*args)
    assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.mark.parametrize("mem_gb", [1 / 16, 0.25, 2.0, 64.0])
def test_the_buffers_fit_the_budget(tool, mem_gb):
    sizes = tool.plan(mem_gb)
    assert 0 < sizes["device_bytes"] <= mem_gb * 2**30
    assert sizes["n"] % 128 == 0 and 0 < sizes["n"] <= tool.MAX_MATMUL_N
    assert 0 < sizes["copy_bytes"] <= tool.MAX_COPY_BYTES and sizes["copy_bytes"] % 2**20 == 0
    assert sizes["device_bytes"] == 2 * sizes["copy_bytes"] + 3 * sizes["n"] ** 2 * 4


@pytest.mark.gpu
@requires_gpu
def test_a_short_run_copies_and_computes():
    out = run("--seconds", "2", "--mem-gb", "0.25", "--duty", "0.5", timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("gpu_load: device ") and lines[1].startswith("gpu_load: done"), lines
    done = lines[1]
    assert " GB host-to-device, " in done and " GB device-to-host, " in done and " matmuls (" in done
    assert " 0.0 GB host-to-device" not in done and " 0 matmuls" not in done, done
    busy = dict(part.split() for part in done.split("; busy ")[1].split(", "))  # {"h2d": "48%", ...}
    assert set(busy) == {"h2d", "d2h", "matmul"}, done
    assert all(5 <= int(v.rstrip("%")) <= 70 for v in busy.values()), done  # resting: about half, never all
