"""The cyclic garbage collector held off while a CUDA graph is captured.

An object the collector frees in the middle of a capture may own a CUDA object (another graph's
executable, a stream, an event), and destroying it is an unsafe call inside a capture: in global
mode it invalidates the capture in progress, and ending a capture whose WHILE node was invalidated
can crash the driver. Every capture in the library runs under :data:`COLLECTOR_PAUSE`.
"""

from __future__ import annotations

import gc
import threading


class CollectorPause:
    """The cyclic collector off while any thread captures (a context manager): destroying a CUDA
    object it frees (another graph, a stream) is an unsafe call inside a capture, which invalidates
    it. Counted under a lock, so a capture ending in one thread does not turn the collector back on
    under another's, and it is turned back on only if it ran before the first."""

    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._was_enabled = False

    def __enter__(self):
        with self._lock:
            if self._depth == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._was_enabled:
                gc.enable()


COLLECTOR_PAUSE = CollectorPause()  # one per process, as the collector itself is
