"""Commands started with a standard stream closed (``>&-``, ``2>&-``): no traceback, and the work that
does not need the closed stream still runs (real subprocesses, the fds closed by the shell)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
CMD = f"exec {sys.executable} -m graphburst.cli"
SMALL = "--backend numpy --batch 2 --vocab 5003 --capacity 128"
REQUESTS = b'{"prompt": [5, 7], "max_new_tokens": 6}\n{"prompt": [9], "max_new_tokens": 3}\n'


def shell(line: str, tmp_path, stdin: bytes = b"", timeout: float = 120) -> subprocess.CompletedProcess:
    """``line`` run by bash (so its redirections close the fds) in ``tmp_path``."""
    return subprocess.run(["bash", "-c", line], check=False, input=stdin, capture_output=True, env=ENV, cwd=tmp_path,
                          timeout=timeout)


def no_traceback(res) -> str:
    err = res.stderr.decode()
    assert "Traceback" not in err and "Exception ignored" not in err, err
    return err


def test_serve_with_stderr_closed_serves_and_writes_only_records(tmp_path):
    """`graphburst serve 2>&-`: the records on stdout (no message line mixed in), exit 0."""
    (tmp_path / "r.jsonl").write_bytes(REQUESTS)
    res = shell(f"{CMD} serve {SMALL} --requests r.jsonl 2>&-", tmp_path)
    assert res.returncode == 0, res.stdout
    recs = [json.loads(x) for x in res.stdout.splitlines()]
    assert [r["line"] for r in sorted(recs, key=lambda r: r["line"])] == [1, 2]
    assert all(r["finish_reason"] == "length" for r in recs)


def test_serve_with_stdout_closed_writes_its_output_file(tmp_path):
    """`graphburst serve --output FILE >&-`: stdout is not needed; FILE gets one record per line, exit 0."""
    (tmp_path / "r.jsonl").write_bytes(REQUESTS)
    res = shell(f"{CMD} serve {SMALL} --requests r.jsonl --output out.jsonl >&-", tmp_path)
    err = no_traceback(res)
    assert res.returncode == 0, err
    recs = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and {r["line"] for r in recs} == {1, 2}


def test_serve_with_stderr_closed_and_a_bad_flag_exits_2(tmp_path):
    """A flag error with nowhere to say it still ends with exit 2, and stdout stays empty."""
    res = shell(f"{CMD} serve {SMALL} -k -1 2>&-", tmp_path)
    assert res.returncode == 2 and res.stdout == b""


@pytest.mark.parametrize("command", ["demo --backend numpy", "bench latency --quick --backend numpy --json b.json"])
def test_demo_and_bench_with_stdout_closed_run(command, tmp_path):
    """`graphburst demo >&-` checks its tokens and exits 0; `bench ... >&-` still writes its JSON."""
    res = shell(f"{CMD} {command} >&-", tmp_path)
    err = no_traceback(res)
    assert res.returncode == 0, err
    if "bench" in command:
        assert json.loads((tmp_path / "b.json").read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_server_with_stdout_closed_serves(tmp_path):
    """`graphburst serve --http PORT >&-`: it listens, answers, and stops on SIGTERM with exit 0."""
    port = _free_port()
    err_path = tmp_path / "err"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(["bash", "-c", f"{CMD} serve {SMALL} --http 127.0.0.1:{port} >&-"],
                                stdout=subprocess.DEVNULL, stderr=err, env=ENV, cwd=tmp_path)
    try:
        deadline, answer = time.monotonic() + 60, None
        while answer is None and proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                    answer = resp.status
            except OSError:
                time.sleep(0.2)
        assert answer == 200, err_path.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, err_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    text = err_path.read_text()
    assert "Traceback" not in text and "stopped after" in text, text
