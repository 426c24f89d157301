"""JSONL serving: requests in, one record per line out, over one :class:`ServeLoop`.

Each input line is ``{"id": "r1", "prompt": [12, 7, 99], "max_new_tokens": 64, "eos": 2}``
(``eos`` and ``id`` optional; ``temperature``, ``top_k``, ``top_p`` and ``seed`` are the
request's sampling settings, temperature > 0 needing ``sampling``; any other key is a
per-request model option, such as the stub draft's ``accept_prob``, and a key no model
claims is an error). Every non-blank line yields exactly one output line carrying its
``line`` number: the request's record (``id``, ``tokens``, ``finish_reason``, timings, and
``error`` if the loop had to give up on it), or ``{"error": ..., "line": N}`` for a line that
could not be served. A bad line costs only itself.

Input is served as it arrives, and only as far ahead as the queue limit allows: a reader
thread hands lines over through a bounded queue (``read_ahead`` lines), and the loop takes
a line only while fewer than ``max_queue`` requests wait for a batch slot. So a request
from a pipe starts before EOF, and memory stays flat in the length of the input.

Signals: the first SIGINT or SIGTERM stops the reading (no line is taken after it); every
request already taken runs to its end and gets its record; exit 0. A second one aborts:
the requests still running or waiting are cancelled, every taken line still gets its
record (``finish_reason: "cancelled"`` with the tokens so far), exit ``128 + signal``.

The input side, the reader thread (:class:`LineReader`) and :func:`parse_line`, is
:mod:`graphburst.serving.jsonl_input`.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from .request import RequestState, SamplingOff
from .loop import ServeLoop
from .jsonl_input import _EOF, MAX_LINE_BYTES, READ_AHEAD, STOP_POLL_S, LineReader, LineTooLong, parse_line
from .events import Retired

MAX_ERROR_CHARS = 300  # an error record stays one short line, whatever the input was
LIVE_PERIOD_S = 0.25  # the rich Live view is redrawn at most this often (not once per burst)


class OutputError(OSError):
    """The records cannot be written (a full disk, a closed file); not a broken pipe."""


def stderr_console() -> Console:
    """A console on stderr; a log file (not a terminal) gets plain lines: rich would wrap them at 80 columns."""
    return Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, soft_wrap=True, highlight=False)


def error_text(exc: BaseException) -> str:
    """One short line for an error record or message: the message (with the type unless a bad value)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, (ValueError, TypeError)):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def record(state: RequestState) -> dict:
    """The output record of a finished request."""
    rec = {"id": state.request.id, "line": state.line, "tokens": state.tokens,
           "finish_reason": state.finish_reason, **state.stats()}
    if state.error is not None:
        rec["error"] = state.error
    if state.sampling is not None and state.sampling.temperature > 0:
        rec["seed"] = state.sampling.seed  # drawn at random when the line had none: replays the request
    return rec


class StopSignals:
    """SIGTERM/SIGINT while installed: the first sets ``stop``, the second sets ``abort``
    (remembering which signal), and from the third on the previous handlers act.

    Only the main thread may install handlers; elsewhere (tests) this is a no-op.
    """

    def __init__(self):
        self.stop = threading.Event()
        self.abort: int | None = None  # the second signal's number
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in self._previous:
            signal.signal(sig, self._on_signal)

    def undo(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        if not self.stop.is_set():
            self.stop.set()
            return
        self.abort = signum
        self.undo()  # a loop stuck inside one step can still be killed the usual way


def _view(loop: ServeLoop) -> Table:
    s = loop.stats()
    table = Table(title="graphburst serve")
    for col in ("active slots", "queued", "bursts", "tokens", "tokens/s", "GPU idle"):
        table.add_column(col, justify="right")
    idle = "-" if s["gpu_idle_fraction"] is None else f"{s['gpu_idle_fraction']:.1%}"
    table.add_row(str(s["active_slots"]), str(s["queued"]), str(s["bursts"]), str(s["tokens"]),
                  f"{s['tokens_per_s']:.0f}", idle)
    return table


class JsonlServer:
    """Serve the lines of ``source_fd`` through ``loop``, writing records to ``sink`` (a text file).

    Parameters
    ----------
    max_queue : int
        Lines are taken only while fewer requests than this wait for a batch slot.
    err : rich Console on stderr; live : bool, show the live view there.
    read_ahead : int
        Lines the reader thread may hold beyond those taken.
    """

    def __init__(self, loop: ServeLoop, source_fd: int, sink, *, max_queue: int, err: Console, live: bool = False,
                 read_ahead: int = READ_AHEAD):
        self.loop, self.sink, self.err = loop, sink, err
        self.max_queue = max_queue
        self.reader = LineReader(source_fd, read_ahead)
        self.signals = StopSignals()
        self.counts = {"lines": 0, "rejected": 0, "served": 0, "failed": 0, "cancelled": 0}
        self.taken = 0  # lines taken from the reader (blank ones included)
        self.pending: list[RequestState] = []  # submitted, record not yet written
        self.reading = True
        self.read_error: BaseException | None = None
        self.live = Live(_view(loop), console=err, refresh_per_second=4, transient=False,
                         auto_refresh=False) if live else None
        self._next_view = 0.0

    # ------------------------------------------------------------------ output

    def _write(self, text: str) -> None:
        try:
            self.sink.write(text)
        except BrokenPipeError:
            raise  # the reader went away (| head): the command stops quietly
        except OSError as exc:
            raise OutputError(exc.errno, f"cannot write the records to {_name(self.sink)}: "
                                         f"{exc.strerror or exc}") from None

    def _flush(self) -> None:
        try:
            self.sink.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(exc.errno, f"cannot write the records to {_name(self.sink)}: "
                                         f"{exc.strerror or exc}") from None

    def _emit(self, rec: dict) -> None:
        self._write(json.dumps(rec) + "\n")

    def _write_finished(self) -> None:
        still = []
        for s in self.pending:
            if s.done:
                self._emit(record(s))
                key = "failed" if s.error else "cancelled" if s.cancelled else "served"
                self.counts[key] += 1
            else:
                still.append(s)
        self.pending = still
        self._flush()

    # ------------------------------------------------------------------ input

    def _take(self, n: int, raw: bytes) -> None:
        if isinstance(raw, LineTooLong):
            self.counts["lines"] += 1
            self.counts["rejected"] += 1
            self._emit({"error": f"the line is {int(raw)} bytes, over the {MAX_LINE_BYTES // 2**20} MiB limit",
                        "line": n})
            return
        if not raw.strip():
            return
        self.counts["lines"] += 1
        try:
            self.pending.append(self.loop.submit(parse_line(raw.decode("utf-8")), line=n))
        except SamplingOff as exc:  # the remedy is the command's flag, not the library's argument
            self._emit({"error": f"temperature {exc.temperature} needs sampling, but this loop decodes greedily: "
                                 "start graphburst serve with --sampling", "line": n})
            self.counts["rejected"] += 1
        except Exception as exc:  # noqa: BLE001 - a bad line costs only itself
            self._emit({"error": error_text(exc), "line": n})
            self.counts["rejected"] += 1

    def _take_lines(self) -> None:
        """Take lines while requests may wait; wait for one only when the loop has nothing to do."""
        block = self.loop.idle
        # (a --tp rank 0 wakes every heartbeat_s to keep its followers' plan wait alive)
        wait = (self.loop.heartbeat_s or STOP_POLL_S) if block else None
        while self.reading and len(self.loop.intake) < self.max_queue and not self.signals.stop.is_set():
            try:
                item = self.reader.lines.get(block=block, timeout=wait)
            except queue.Empty:
                return
            block = False
            if item is _EOF:
                self.reading = False
            elif isinstance(item, Exception):
                self.read_error = item
            else:
                self.taken += 1
                self._take(*item)

    # ------------------------------------------------------------------ the loop

    def serve(self) -> int:
        """Serve until the input ends (or a signal), then write the summary; the exit status."""
        self.loop.log = []  # what each step retired: records are written only then
        self.signals.install()
        self.reader.start()
        if self.live:
            self.live.start()
        try:
            while True:
                if self.signals.abort is not None:
                    return self._abort(self.signals.abort)
                if self.signals.stop.is_set() and self.reading:
                    self.reading = False
                    self.reader.stop()
                    self.err.print(f"graphburst serve: stopping; finishing {len(self.pending)} request(s) already "
                                   f"read (a second signal cancels them)")
                self._take_lines()
                if not self.loop.idle:
                    try:
                        self.loop.step()
                    except (OutputError, BrokenPipeError):
                        raise
                    except Exception as exc:  # noqa: BLE001 - the loop is dead: fail what it held, with records
                        return self._loop_failed(exc)
                # Per burst only the loop's log is read: pending is scanned when something finished.
                if any(isinstance(event, Retired) for event in self.loop.log):
                    self._write_finished()
                self.loop.log.clear()
                self._show()
                if not self.reading and self.loop.idle and not self.pending:
                    break
        finally:
            self.signals.undo()
            self.reader.stop()
            if self.live:
                self.live.update(_view(self.loop), refresh=True)
                self.live.stop()
        self._flush()
        self._summary()
        if self.read_error is not None:
            self.err.print(f"graphburst serve: reading the requests failed: {error_text(self.read_error)}")
            return 1
        # Exit 1 when no line was served: every input line was rejected (or failed).
        return 1 if self.counts["lines"] and not self.counts["served"] else 0

    def _loop_failed(self, exc: BaseException) -> int:
        """The loop raised (a device error, a lost --tp peer): every taken line still gets a record."""
        why = f"the serving loop failed: {error_text(exc)}"
        self._write_finished()  # what finished before the failure keeps its tokens
        for s in self.pending:
            rec = record(s)
            rec.update(error=why, finish_reason="error")
            self._emit(rec)
            self.counts["failed"] += 1
        self.pending = []
        self._flush()
        self._summary()
        self.err.print(f"graphburst serve: {why}")
        return 1

    def _abort(self, signum: int) -> int:
        """A second signal: cancel what still runs or waits, write every record, exit 128 + signal."""
        for s in self.pending:
            self.loop.cancel(s)
        self._write_finished()
        self._summary()
        self.err.print(f"graphburst serve: aborted by a second {signal.Signals(signum).name}")
        return 128 + signum

    def _show(self) -> None:
        if self.live and time.monotonic() >= self._next_view:
            self.live.update(_view(self.loop), refresh=True)
            self._next_view = time.monotonic() + LIVE_PERIOD_S

    def _summary(self) -> None:
        c, stats = self.counts, self.loop.stats()
        cancelled = f", {c['cancelled']} cancelled" if c["cancelled"] else ""
        self.err.print(f"served {c['served']} requests ({c['rejected']} lines rejected, {c['failed']} failed"
                       f"{cancelled}) in {stats['bursts']} bursts, {stats['tokens']} tokens, "
                       f"{stats['tokens_per_s']:.0f} tokens/s")


def _name(sink) -> str:
    name = getattr(sink, "name", None)
    return "standard output" if name in (None, "<stdout>", 1) else repr(name)


def run(config, loop: ServeLoop, err: Console | None = None) -> int:
    """Serve ``config.requests`` to ``config.output`` (``'-'``: stdin, stdout) through ``loop``.

    Returns the exit status: 0, 1 when no line was served or reading failed, 2 when the
    records cannot be written (one line on stderr, never a traceback), ``128 + signal``
    after a second stop signal. A broken pipe on the output propagates (the caller stops quietly).
    """
    err = err or stderr_console()
    for name, stream, flag in (("input", sys.stdin, "--requests"), ("output", sys.stdout, "--output")):
        if getattr(config, flag[2:]) == "-" and stream is None:  # started with <&- or >&-
            print(f"graphburst serve: standard {name} is closed; give {flag} FILE", file=sys.stderr)
            return 2
    try:
        source = sys.stdin.buffer if config.requests == "-" else open(config.requests, "rb")  # noqa: SIM115
        sink = sys.stdout if config.output == "-" else open(config.output, "w")  # noqa: SIM115 - closed below
    except OSError as exc:
        print(f"graphburst serve: cannot open {exc.filename!r}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    server = JsonlServer(loop, source.fileno(), sink, max_queue=config.max_queue, err=err,
                         live=err.is_terminal or config.live)
    failure = None
    try:
        code = server.serve()
    except OutputError as exc:
        code, failure = 2, exc.strerror
    finally:
        if source is not sys.stdin.buffer:
            source.close()
    closed = _close_sink(sink, failed=failure is not None)
    if failure is None and closed is not None:  # the last buffered records could not be written
        code, failure = 2, closed
    if failure is not None:
        print(f"graphburst serve: {failure}", file=sys.stderr)
    return code


def _close_sink(sink, *, failed: bool) -> str | None:
    """Close the output; a message if its last records could not be written."""
    if sink is sys.stdout:
        if failed:
            # Records still buffered would fail again at the interpreter's exit flush, with a traceback.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return None
    try:
        sink.close()
    except OSError as exc:
        return f"cannot write the records to {_name(sink)}: {exc.strerror or exc}"
    return None
