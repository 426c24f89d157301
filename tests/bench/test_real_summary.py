"""``graphburst bench real --summary FILE ...``: one line per config of saved results, nothing run; a file that is
not bench real's JSON, or a run flag beside it, is one line on stderr and exit 2."""

from __future__ import annotations

import json

import pytest
from real_cli import cli

WHY = "not run: torch.compile probe died (signal 11 (SIGSEGV)): compiling"
COMPARISON = {"meta": {"failures": ["1b B=4 ε=0.02: hf: FAILED correctness"]}, "results": {"configs": [
    {"model": "1b", "batch": 1, "eps": 0.0213, "floor_us": 4312.4,
     "engines": {"graphburst": {"tokens_per_s": 986.2, "us_per_round": 4361.0, "acceptance": 0.83, "x_floor": 1.0113},
                 "compile": {"tokens_per_s": 700.4, "us_per_round": 6100.2, "acceptance": 0.8, "x_floor": None,
                             "compile_s": 61.7}},
     "not_run": {"gapless": WHY, "hf": "not run: opt-in"}}]}}
PROFILE = {"meta": {"failures": []}, "results": {
    "forward": [{"shape": "8b-tp2", "batch": 1, "T": 5, "capacity": 1024, "valid": 512, "attention": "gqa",
                 "path": "fused", "graph_us": 2150.4, "x_floor": 1.21, "gemm_us": 1700.0, "attention_us": 120.0,
                 "fused_us": 90.0, "other_us": 40.0, "gap_us": 200.4, "nongemm_per_layer_us": 14.08},
                {"shape": "1b", "batch": 64, "T": 1, "capacity": 1024, "valid": 512, "attention": "fold",
                 "path": "sdpa", "graph_us": 900.0, "x_floor": 1.22},
                {"shape": "1b", "batch": 1, "T": 1, "capacity": 64, "valid": 32, "attention": "gqa",
                 "path": "fused", "failed": "fused forward disagrees with SDPA"}],
    "prefill": [{"model": "1b", "prefill": "packed", "results": [
        {"case": "1 x 128", "rows": 1, "tokens": 128, "padded_to_longest": 128, "host_ms": 1.234, "gpu_ms": 2.5,
         "captures": 3},
        {"case": "4 x 128", "rows": 4, "failed": "slot 3: not a near-tie"}]}]}}


def write(tmp_path, name, doc):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def test_comparison_lines(tmp_path):
    """Each engine's tokens/s, µs per round, acceptance and x floor; every engine that did not run with its
    reason (but HF's, the same in every B > 1 config); then the failures."""
    path = write(tmp_path, "real.json", COMPARISON)
    proc = cli("--summary", path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{path}: 1b B=1 eps=0.0213 floor 4312 us: graphburst 986 tok/s 4361 us/round acc 0.83 1.011x floor; "
        f"compile 700 tok/s 6100 us/round acc 0.80 (compiled in 62 s); gapless {WHY}",
        f"{path}: FAILURE: 1b B=4 ε=0.02: hf: FAILED correctness"]


def test_profile_lines_and_several_files(tmp_path):
    a, b = write(tmp_path, "a.json", PROFILE), write(tmp_path, "b.json", COMPARISON)
    proc = cli("--summary", a, b, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:5] == [
        f"{a}: forward 8b-tp2 B=1 T=5 cap=1024 gqa fused: graph 2150 µs (1.21x floor); GEMM 1700, attention 120, "
        f"fused 90, other 40, gap 200 µs; non-GEMM 14.08 µs/layer",
        f"{a}: forward 1b B=64 T=1 cap=1024 fold sdpa: graph 900 µs (1.22x floor)",
        f"{a}: forward 1b B=1 T=1 cap=64 gqa fused: FAILED: fused forward disagrees with SDPA",
        f"{a}: prefill 1b packed 1 x 128: host 1.23 ms, GPU 2.50 ms, 128 tokens (128 padded to the longest), "
        f"captures 3",
        f"{a}: prefill 1b packed 4 x 128: FAILED: slot 3: not a near-tie"]
    assert len(lines) == 7 and all(line.startswith(f"{b}: ") for line in lines[5:])


@pytest.mark.parametrize("content, why", [(None, "cannot read"), ("{", "is not JSON"),
                                          ({"meta": {}, "results": [1]}, "is not the JSON of graphburst bench real")])
def test_a_file_that_is_not_results_is_one_line_exit_2(tmp_path, content, why):
    path = tmp_path / "missing.json" if content is None else write(tmp_path, "x.json", content)
    proc = cli("--summary", write(tmp_path, "ok.json", COMPARISON), path, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.count("\n") == 1 and "--summary" in proc.stderr and why in proc.stderr, proc.stderr


@pytest.mark.parametrize("flags, named", [(["--models", "1b"], "--models"), (["--profile"], "--profile"),
                                          (["--json", "x.json"], "--json"), (["--trials", "3"], "--trials")])
def test_summary_takes_no_run_flags(tmp_path, flags, named):
    proc = cli("--summary", write(tmp_path, "ok.json", COMPARISON), *flags, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and named in proc.stderr, proc.stderr
