"""The command line as a user runs it: one-line flag errors, streaming serve, one record per line."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graphburst import greedy_reference

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
SMALL = ["--backend", "numpy", "--batch", "2", "--vocab", "5003", "--capacity", "128"]


def cli(*args, stdin=b"", timeout=120):
    return subprocess.run([sys.executable, "-m", "graphburst.cli", *args], input=stdin, capture_output=True,
                          env=ENV, timeout=timeout)


def one_line_error(out, flag):
    err = out.stderr.decode()
    assert out.returncode == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in err, err
    return lines[0]


BAD_FLAGS = [("-k", "-1"), ("-k", "65"), ("-m", "0"), ("--rounds", "0"), ("--batch", "0"), ("--batch", "1000000"),
             ("--vocab", "1"), ("--layers", "0"), ("--capacity", "0"), ("--accept", "1.5"), ("--accept", "nan"),
             ("--cost-us", "-1"), ("--cost-us", "nan"), ("--capacity", "abc"), ("--prefill-chunk", "0"),
             ("--prefill-chunk", "x"), ("--pipeline-depth", "1"), ("--pipeline-depth", "9"),
             ("--prefill-warmup", "-1"), ("--prefill-warmup", "x"), ("--prefill-warmup", "65537")]


@pytest.mark.parametrize("flag, value", BAD_FLAGS)
def test_serve_flag_errors_are_one_line_naming_the_flag(flag, value):
    line = one_line_error(cli("serve", "--backend", "numpy", flag, value), flag)
    assert line.startswith("graphburst serve: error: ")


@pytest.mark.parametrize("flag, value", [("-k", "-1"), ("-k", "65"), ("-m", "0"), ("--batch", "0"),
                                         ("--bursts", "0"), ("--accept", "inf"), ("--p-min", "-0.1"),
                                         ("--layers", "0"), ("--vocab", "1"), ("--batch", "4096")])
def test_demo_flag_errors_are_one_line_naming_the_flag(flag, value):
    args = [flag, value] + (["--bursts", "10000"] if flag == "--batch" and value == "4096" else [])
    one_line_error(cli("demo", "--backend", "numpy", *args), flag)


def test_serve_sizes_are_checked_against_the_memory_they_take():
    line = one_line_error(cli("serve", "--backend", "numpy", "--batch", "65536", "--capacity", "100000"), "--batch")
    assert "GiB" in line


def test_backend_cupy_without_a_gpu_is_one_line():
    from graphburst.backend import cuda_available

    if cuda_available():
        pytest.skip("this machine has a GPU")
    for cmd in ("serve", "demo", "bench latency", "bench serve", "bench capture"):
        one_line_error(cli(*cmd.split(), "--backend", "cupy"), "--backend")


def test_request_and_output_paths_are_checked_before_anything_runs(tmp_path):
    one_line_error(cli("serve", *SMALL, "--requests", str(tmp_path / "missing.jsonl")), "--requests")
    one_line_error(cli("serve", *SMALL, "--requests", str(tmp_path)), "--requests")
    one_line_error(cli("serve", *SMALL, "--output", str(tmp_path / "no" / "dir" / "out.jsonl")), "--output")
    one_line_error(cli("serve", *SMALL, "--output", str(tmp_path)), "--output")


def test_output_naming_the_input_file_is_refused_and_the_input_kept(tmp_path):
    src = tmp_path / "req.jsonl"
    text = '{"prompt": [3], "max_new_tokens": 5}\n'
    src.write_text(text)
    one_line_error(cli("serve", *SMALL, "--requests", str(src), "--output", str(src)), "--output")
    one_line_error(cli("serve", *SMALL, "--requests", str(src), "--output", str(tmp_path / "." / "req.jsonl")),
                   "--output")
    assert src.read_text() == text


def test_bench_checks_its_flags_before_running(tmp_path):
    one_line_error(cli("bench", "latency", "--backend", "numpy", "--reps", "0"), "--reps")
    one_line_error(cli("bench", "latency", "--backend", "numpy", "--chunk", "-3"), "--chunk")
    one_line_error(cli("bench", "latency", "--backend", "numpy", "--json", str(tmp_path / "nodir" / "x.json")), "--json")
    one_line_error(cli("bench", "latency", "--backend", "numpy", "--reps", "1000", "--chunk", "10000"), "--reps")


def test_bench_honours_reps_and_chunk_on_cpu(tmp_path):
    out = tmp_path / "b.json"
    res = cli("bench", "latency", "--backend", "numpy", "--quick", "--no-peer", "--reps", "2", "--chunk", "2", "--json",
              str(out), timeout=300)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    meta = json.loads(out.read_text())["meta"]
    assert (meta["reps"], meta["chunk"]) == (2, 2)


def test_broken_pipe_is_a_quiet_exit():
    reqs = b"".join(b'{"prompt": [%d], "max_new_tokens": 30}\n' % i for i in range(40))
    cmd = (f"{sys.executable} -m graphburst.cli serve {' '.join(SMALL)} | head -1")
    res = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], input=reqs, capture_output=True, env=ENV,
                         timeout=120)
    assert len(res.stdout.splitlines()) == 1
    assert b"Traceback" not in res.stderr and b"BrokenPipe" not in res.stderr, res.stderr.decode()


def test_every_line_gets_one_record_with_its_line_number(tmp_path):
    lines = [b'{"id": "a", "prompt": [12, 7, 99], "max_new_tokens": 120}',  # long: still running at line 6
             b"[" * 100_000,
             b'{"id": "b", "prompt": [3], "max_new_tokens": 5}',
             b"\xff\xfe not utf-8",
             b"",
             b'{"id": "a", "prompt": [4], "max_new_tokens": 5}',  # "a" still in flight: duplicate
             b'{"id": "req-0", "prompt": [5], "max_new_tokens": 5}',
             b'{"prompt": [6], "max_new_tokens": 5}',  # a made-up id must not be "req-0"
             b'{"prompt": [1], "max_new_tokens": 1e400}',
             b'{"prompt": [1], "max_new_tokens": 99999999999999999999999}',
             b'{"prompt": [[[[1]]]], "max_new_tokens": 2}']
    src = tmp_path / "req.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.jsonl"
    res = cli("serve", *SMALL, "--requests", str(src), "--output", str(out))
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    by_line = {r["line"]: r for r in recs}
    assert len(recs) == len(by_line) == 10 and set(by_line) == {1, 2, 3, 4, 6, 7, 8, 9, 10, 11}
    assert {n for n, r in by_line.items() if "error" in r} == {2, 4, 6, 9, 10, 11}
    assert "already in flight" in by_line[6]["error"]
    assert by_line[1]["tokens"] == greedy_reference([12, 7, 99], 120, 5003)
    assert by_line[3]["tokens"] == greedy_reference([3], 5, 5003)
    assert by_line[8]["id"] not in {"a", "b", "req-0"} and by_line[8]["tokens"] == greedy_reference([6], 5, 5003)
    assert all(len(r["error"]) <= 300 for r in recs if "error" in r)


def test_exit_status_is_1_when_every_line_is_rejected():
    res = cli("serve", *SMALL, stdin=b"nope\n{}\n")
    assert res.returncode == 1 and len(res.stdout.splitlines()) == 2


def test_a_request_from_a_pipe_is_served_before_eof():
    proc = subprocess.Popen([sys.executable, "-m", "graphburst.cli", "serve", *SMALL], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    try:
        proc.stdin.write(b'{"id": "first", "prompt": [3], "max_new_tokens": 5}\n')
        proc.stdin.flush()
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 60
        first = b""
        while not first.endswith(b"\n") and time.monotonic() < deadline:  # the second line is not sent yet
            if sel.select(timeout=1):
                first += os.read(proc.stdout.fileno(), 1 << 16)
        rec = json.loads(first)
        assert rec["id"] == "first" and rec["line"] == 1 and rec["tokens"] == greedy_reference([3], 5, 5003)
        proc.stdin.write(b'{"id": "second", "prompt": [4], "max_new_tokens": 5}\n')
        proc.stdin.close()
        rest = proc.stdout.read()
        proc.wait(timeout=60)
        (second,) = [json.loads(x) for x in rest.splitlines()]
        assert second["id"] == "second" and second["line"] == 2
        assert proc.returncode == 0
    finally:
        proc.kill()


def test_sigterm_finishes_the_requests_already_read_then_exits_0():
    """JSONL serving is stopped the way HTTP is: no line read after the signal, but every
    request already read runs to its end and gets its record; stdin is still open."""
    proc = subprocess.Popen([sys.executable, "-m", "graphburst.cli", "serve", *SMALL, "--accept", "0",
                             "--capacity", "4096"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV)
    try:
        assert b"numpy reference backend" in proc.stderr.readline()  # up, about to read lines
        # accept 0: one token per round; 4000 tokens take seconds on numpy, past the signal
        proc.stdin.write(b'{"id": "long", "prompt": [3, 9], "max_new_tokens": 4000}\n')
        proc.stdin.flush()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode == 0, err
    assert "stopping; finishing 1 request(s) already read" in err  # it was still running at the signal
    (rec,) = [json.loads(x) for x in out.splitlines()]
    assert rec["id"] == "long" and rec["tokens"] == greedy_reference([3, 9], 4000, 5003)
