"""JSONL serving under stress: stop signals, bounded reading ahead, outputs that fail, closed stdio.

Also the ServeConfig the serve command builds its loop from (serving/factory.py).
"""

from __future__ import annotations

import io
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from graphburst import greedy_reference
from graphburst.serving.factory import ConfigError, ServeConfig, build_loop
from graphburst.serving.jsonl import JsonlServer

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
VOCAB = 5003
SMALL = ["--backend", "numpy", "--batch", "2", "--vocab", str(VOCAB), "--capacity", "128"]
CMD = [sys.executable, "-m", "graphburst.cli", "serve"]


def _lines(n: int, new_tokens: int) -> bytes:
    return b"".join(b'{"prompt": [%d, 7], "max_new_tokens": %d}\n' % (1 + i % 50, new_tokens) for i in range(n))


def _records(out: bytes) -> list[dict]:
    return [json.loads(x) for x in out.splitlines()]


def _wait_for_stderr(proc, text: bytes, timeout: float = 60) -> None:
    """Read the child's stderr until ``text`` shows; never blocks past ``timeout``."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    seen, deadline = b"", time.monotonic() + timeout
    while text not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(timeout=left):
            raise AssertionError(f"no {text!r} on stderr: {seen.decode()!r}")
        chunk = os.read(proc.stderr.fileno(), 1 << 16)
        if not chunk:
            raise AssertionError(f"stderr closed without {text!r}: {seen.decode()!r}")
        seen += chunk


# ---------------------------------------------------------------------- signals


def test_first_signal_stops_reading_a_file_and_finishes_what_was_read(tmp_path):
    """After a signal no line is taken (the reader does not queue the whole file), every request taken
    runs to its end with its record, and the exit status is 0."""
    src = tmp_path / "long.jsonl"
    src.write_bytes(_lines(300, 100))
    proc = subprocess.Popen([*CMD, *SMALL, "--max-queue", "4", "--requests", str(src)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV)
    try:
        first = b""
        while b"\n" not in first:  # a record: serving is under way (os.read: communicate() reads the fd too)
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            assert chunk, "stdout closed before the first record"
            first += chunk
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "stopping; finishing" in err
    recs = _records(first + rest)
    assert 1 <= len(recs) < 50, len(recs)  # at most what was taken: 4 waiting, 2 running, a few more freed
    assert sorted(r["line"] for r in recs) == list(range(1, len(recs) + 1))  # nothing skipped before the stop
    for r in recs:
        assert r["finish_reason"] == "length"
        assert r["tokens"] == greedy_reference([1 + (r["line"] - 1) % 50, 7], 100, VOCAB)


def test_second_signal_cancels_quickly_writes_every_record_and_no_traceback(tmp_path):
    """A second Ctrl-C cancels what still runs, writes a record for every line taken and exits 130 (no
    KeyboardInterrupt inside a kernel twin, no lost records)."""
    src = tmp_path / "long.jsonl"
    src.write_bytes(_lines(50, 4000))
    proc = subprocess.Popen([*CMD, *SMALL, "--capacity", "4096", "--accept", "0", "--max-queue", "4",
                             "--requests", str(src)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    try:
        _wait_for_stderr(proc, b"numpy reference backend")
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _wait_for_stderr(proc, b"stopping; finishing")
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)  # serving all 50 x 4000 tokens would take minutes
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "aborted by a second SIGINT" in err
    recs = _records(out)
    assert 1 <= len(recs) <= 8 and sorted(r["line"] for r in recs) == list(range(1, len(recs) + 1))
    assert any(r["finish_reason"] == "cancelled" for r in recs)
    for r in recs:
        want = greedy_reference([1 + (r["line"] - 1) % 50, 7], 4000, VOCAB)
        assert r["tokens"] == want[: len(r["tokens"])]  # what it had, nothing made up


# ---------------------------------------------------------------------- backpressure


def test_reading_ahead_is_bounded_by_the_queue_limit(tmp_path):
    """Requests waiting for a slot never exceed max_queue, and the reader holds at most read_ahead lines
    beyond those taken, whatever the file's length (memory does not grow with the file)."""
    n_lines, max_queue, read_ahead = 400, 3, 5
    src = tmp_path / "many.jsonl"
    src.write_bytes(_lines(n_lines, 2))
    config = ServeConfig(backend="numpy", batch=2, vocab=VOCAB, capacity=64, max_queue=max_queue)
    loop = build_loop(config)
    sink = io.StringIO()
    peak = {"waiting": 0, "held": 0, "taken_before_first_step": None}
    with open(src, "rb") as source:
        server = JsonlServer(loop, source.fileno(), sink, max_queue=max_queue, err=Console(file=io.StringIO()),
                             read_ahead=read_ahead)
        step = loop.step

        def watched_step():
            if peak["taken_before_first_step"] is None:
                peak["taken_before_first_step"] = server.taken
            peak["waiting"] = max(peak["waiting"], len(loop.intake))
            peak["held"] = max(peak["held"], server.reader.handed - server.taken)
            return step()

        loop.step = watched_step
        assert server.serve() == 0
    recs = _records(sink.getvalue().encode())
    assert len(recs) == n_lines and all(r["finish_reason"] == "length" for r in recs)  # every line served
    assert peak["waiting"] <= max_queue
    assert peak["held"] <= read_ahead
    assert peak["taken_before_first_step"] <= max_queue


def test_a_line_over_the_limit_costs_only_itself(tmp_path):
    """A line of more than MAX_LINE_BYTES is one error record, read in linear time and without being held
    (it was re-copied on every 64 KiB read, and kept whole); the lines around it are served."""
    from graphburst.serving import jsonl

    src = tmp_path / "long.jsonl"
    with open(src, "wb") as f:
        f.write(_lines(1, 3))
        f.write(b'{"prompt": [' + b"1, " * (jsonl.MAX_LINE_BYTES // 3 + 10) + b'1], "max_new_tokens": 2}\n')
        f.write(_lines(1, 3))
    res = subprocess.run([*CMD, *SMALL, "--requests", str(src)], capture_output=True, env=ENV, timeout=120)
    assert res.returncode == 0, res.stderr.decode()
    recs = {r["line"]: r for r in _records(res.stdout)}
    assert sorted(recs) == [1, 2, 3]
    assert "over the 16 MiB limit" in recs[2]["error"] and "tokens" not in recs[2]
    assert recs[1]["finish_reason"] == recs[3]["finish_reason"] == "length"


def test_a_loop_that_fails_still_writes_a_record_for_every_line_taken(tmp_path):
    """A loop that raises (a device error, a lost --tp peer) ended the command with a traceback and
    without the records of the lines it had taken; now each gets one, with the error, and exit 1."""
    src = tmp_path / "three.jsonl"
    src.write_bytes(_lines(3, 40))
    loop = build_loop(ServeConfig(backend="numpy", batch=2, vocab=VOCAB, capacity=128))
    step, calls = loop.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return step()

    loop.step = failing_step
    sink, err = io.StringIO(), io.StringIO()
    with open(src, "rb") as source:
        rc = JsonlServer(loop, source.fileno(), sink, max_queue=8, err=Console(file=err)).serve()
    assert rc == 1 and "the serving loop failed: RuntimeError: device lost" in err.getvalue()
    recs = _records(sink.getvalue().encode())
    assert sorted(r["line"] for r in recs) == [1, 2, 3]
    assert all(r["finish_reason"] == "error" and "device lost" in r["error"] for r in recs)


# ---------------------------------------------------------------------- output and terminal errors


def _one_error_line(res, *words) -> str:
    err = res.stderr.decode()
    assert res.returncode == 2, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    hits = [x for x in err.splitlines() if all(w in x for w in words)]
    assert len(hits) == 1, err
    return hits[0]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_output_is_one_line_and_exit_2():
    """--output /dev/full (a write that fails) is one line and an exit status, not an OSError traceback."""
    reqs = _lines(3, 5)
    res = subprocess.run([*CMD, *SMALL, "--output", "/dev/full"], input=reqs, capture_output=True, env=ENV,
                         timeout=120)
    _one_error_line(res, "graphburst serve:", "No space left on device")
    with open("/dev/full", "w") as full:  # --output - on a full stdout: the same line
        res = subprocess.run([*CMD, *SMALL], input=reqs, stdout=full, stderr=subprocess.PIPE, env=ENV, timeout=120)
    _one_error_line(res, "graphburst serve:", "No space left on device")


@pytest.mark.parametrize("redirect, flag", [("<&-", "--requests"), (">&-", "--output")])
def test_closed_stdin_or_stdout_is_one_line_and_exit_2(redirect, flag):
    """`graphburst serve <&-` and `... | graphburst serve >&-` end in one line and exit 2, not a traceback."""
    cmd = " ".join([*CMD, *SMALL]) + f" {redirect}"
    res = subprocess.run(["bash", "-c", f"exec {cmd}"], input=_lines(1, 3), capture_output=True, env=ENV,
                         timeout=120)
    line = _one_error_line(res, flag, "closed")
    assert line.startswith("graphburst serve: error: ")


# ---------------------------------------------------------------------- ServeConfig


@pytest.mark.parametrize("kw, field", [(dict(batch=0), "batch"), (dict(k=65), "k"), (dict(rounds=True), "rounds"),
                                       (dict(accept=float("nan")), "accept"), (dict(engine="fast"), "engine"),
                                       (dict(dtype="float32"), "dtype"), (dict(model="tiny-random", vocab=9), "vocab"),
                                       (dict(model="tiny-random", draft="x"), "draft"),
                                       (dict(model="/no/such/dir", draft="/no/such/dir"), "model"),
                                       (dict(max_queue=0), "max_queue"), (dict(backend="tpu"), "backend"),
                                       (dict(decode_kernels="pdl"), "decode_kernels"),
                                       (dict(model="tiny-random", decode_kernels="fast"), "decode_kernels"),
                                       (dict(model="tiny-random", tp=2, decode_kernels="off"), "decode_kernels")])
def test_serve_config_names_the_field_and_value(kw, field):
    with pytest.raises(ValueError) as info:
        ServeConfig(**kw)
    assert isinstance(info.value, ConfigError) and info.value.field == field
    msg, value = str(info.value), kw[field]
    assert msg.startswith(f"{field}: ") and (repr(value) in msg or str(value) in msg), msg


@pytest.mark.parametrize("kw, field", [(dict(tokenizer="/tmp"), "tokenizer"), (dict(served_model_name="m"),
                                        "served_model_name"), (dict(http="127.0.0.1:0", requests="r.jsonl"), "requests"),
                                        (dict(http="127.0.0.1:0", live=True), "live"),
                                        (dict(draft="ngram", accept=0.9), "accept"),
                                        (dict(model="tiny-random", draft="ngram", p_min=0.1), "p_min")])
def test_a_field_the_mode_would_ignore_is_refused(kw, field):
    """Fields of the other serving mode, or of the draft model that prompt lookup replaces, were accepted
    and dropped; each is refused now, naming the field."""
    with pytest.raises(ConfigError) as info:
        ServeConfig(**kw)
    assert info.value.field == field


def test_validate_then_submit_and_refused_requests_use_no_id():
    """validate() made up an id, which submit() then refused as a made-up form; a refused submit used one up."""
    from graphburst.serving.request import Request

    loop = build_loop(ServeConfig(backend="numpy", batch=2, vocab=VOCAB, capacity=128))
    req = Request([1, 2], 4)
    loop.validate(req)
    assert req.id is None
    with pytest.raises(ValueError):
        loop.submit(Request([1], 4, options={"no_such_option": 1}))
    assert loop.submit(req).request.id == "auto-0"


def test_serve_config_fills_the_stub_defaults_and_builds_that_loop():
    config = ServeConfig(backend="numpy", batch=3, k=2, rounds=3, capacity=40, vocab=97, pipelined=False)
    assert (config.layers, config.accept, config.cost_us) == (4, 0.7, 0.0)
    loop = build_loop(config)
    assert (loop.dec.batch, loop.dec.k, loop.dec.m_rounds, loop.dec.capacity, loop.vocab) == (3, 2, 3, 40, 97)
    assert not loop.pipelined
    with pytest.raises(TypeError, match="ServeConfig"):
        build_loop(vars(config))


def test_a_model_loop_runs_the_decode_kernels_it_was_given():
    """``decode_kernels`` reaches both models (None: "auto"; the stubs have none); served on the fused path's
    references, a request's tokens are the SDPA path's ("off")."""
    pytest.importorskip("torch")
    from graphburst.models import llama_decode
    from graphburst.serving.request import Request

    assert ServeConfig(vocab=VOCAB).decode_kernels is None
    assert ServeConfig(model="tiny-random").decode_kernels == "auto"
    tokens = {}
    for kernels in ("reference", "off"):
        loop = build_loop(ServeConfig(backend="numpy", model="tiny-random", batch=2, capacity=64, k=2, rounds=2,
                                      decode_kernels=kernels))
        modules = (loop.dec.target.module, loop.dec.draft.module)
        assert all((m.decode_ops is None) == (kernels == "off") for m in modules)
        assert all(isinstance(m.decode_ops, llama_decode.DecodeOps) for m in modules if kernels != "off")
        state = loop.submit(Request([5, 7, 11], 9))
        loop.run_until_idle()
        tokens[kernels] = state.tokens
    assert tokens["reference"] == tokens["off"] and len(tokens["off"]) == 9

