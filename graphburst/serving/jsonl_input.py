"""JSONL requests in: the input's lines as they arrive, and one line parsed into a :class:`Request`.

:class:`LineReader` is the reader thread: it hands ``(line number, bytes)`` over through a
bounded queue, so it runs at most ``read_ahead`` lines ahead of the loop, and a line over
``MAX_LINE_BYTES`` is handed over as its size (:class:`LineTooLong`), never held whole.
:func:`parse_line` turns one line into a request: the known fields, and every other key a
per-request model option.
The serving side (:class:`~graphburst.serving.jsonl.JsonlServer`, the records, the signals and
``run``) is :mod:`graphburst.serving.jsonl`.
"""

from __future__ import annotations

import os
import queue
import threading

from .request import MAX_REQUEST_BYTES, Request
from ..validate import parse_json

# Request's sampling settings and logits processing fields, not model options
SAMPLING_FIELDS = {"temperature", "top_k", "top_p", "seed", "logit_bias", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_p", "min_tokens", "ignore_eos"}
FIELDS = {"prompt", "max_new_tokens", "eos", "id"} | SAMPLING_FIELDS  # every other key is a model option
READ_CHUNK = 1 << 16  # bytes per read of the requests
READ_AHEAD = 64  # lines the reader thread holds that the loop has not taken yet
STOP_POLL_S = 0.5  # an idle loop, or a reader waiting for room, wakes this often to see a stop


def parse_line(text: str) -> Request:
    """A request from one JSONL line; raises ValueError/TypeError naming what is wrong."""
    obj = parse_json(text)
    if not isinstance(obj, dict):
        raise TypeError(f"a request must be a JSON object, got {type(obj).__name__}")
    missing = [f for f in ("prompt", "max_new_tokens") if f not in obj]
    if missing:
        raise ValueError(f"missing field(s): {', '.join(missing)}")
    # Other keys are per-request model options, e.g. the stub draft's accept_prob and
    # seed; the models refuse any key they do not claim, so a typo is an error record.
    options = {k: v for k, v in obj.items() if k not in FIELDS}
    req = Request(**{k: v for k, v in obj.items() if k in FIELDS}, options=options or None)
    if req.id is not None and (not isinstance(req.id, (str, int)) or isinstance(req.id, bool)):
        raise TypeError(f"id must be a string or an integer, got {type(req.id).__name__}")
    return req  # an int id stays an int: 7 and "7" are two ids, written back as given


_EOF = object()
MAX_LINE_BYTES = MAX_REQUEST_BYTES  # one request line at most, as an HTTP body


class LineTooLong(int):
    """The size of a request line over MAX_LINE_BYTES, handed over instead of its bytes."""


class LineReader(threading.Thread):
    """Reads ``fd`` and hands over ``(line number, bytes)`` per line through a bounded queue, then _EOF.

    ``lines`` holds at most ``read_ahead`` lines; the reader waits for room (and so reads no
    further) while it is full, and after :meth:`stop` it reads nothing more. Reads with
    ``os.read``, not a buffered reader: a stop ends the server while this thread may still
    wait on an open stdin, and a thread blocked inside a buffered reader holds its lock,
    which aborts the interpreter at exit.
    """

    def __init__(self, fd: int, read_ahead: int = READ_AHEAD):
        super().__init__(name="graphburst-serve-reader", daemon=True)
        self.fd = fd
        self.lines: queue.Queue = queue.Queue(maxsize=read_ahead)
        self.handed = 0  # lines put into ``lines`` so far
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self.lines.put(item, timeout=STOP_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        # A line is gathered in one bytearray and each chunk is searched once, so a long line
        # costs linear time; past MAX_LINE_BYTES its bytes are dropped up to the newline and
        # the line becomes one error record (a bad input costs only itself, in time and memory).
        n, buf, dropped = 0, bytearray(), 0
        try:
            while not self._stop.is_set() and (chunk := os.read(self.fd, READ_CHUNK)):
                start = 0
                while (end := chunk.find(b"\n", start)) >= 0:
                    n += 1
                    item = self._line(n, buf, dropped, chunk[start:end])
                    buf.clear()
                    dropped = 0
                    if not self._put(item):
                        return
                    self.handed += 1
                    start = end + 1
                rest = chunk[start:]
                if dropped or len(buf) + len(rest) > MAX_LINE_BYTES:
                    dropped += len(buf) + len(rest)
                    buf.clear()
                else:
                    buf += rest
            if (buf or dropped) and not self._stop.is_set() and self._put(self._line(n + 1, buf, dropped, b"")):
                self.handed += 1
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            self._put(exc)
        finally:
            self._put(_EOF)

    @staticmethod
    def _line(n: int, buf: bytearray, dropped: int, last: bytes) -> tuple:
        """``(n, line bytes)``, or ``(n, LineTooLong)`` for a line over MAX_LINE_BYTES."""
        size = dropped + len(buf) + len(last)
        if size > MAX_LINE_BYTES:
            return n, LineTooLong(size)
        return n, bytes(buf) + last
