"""The state a device-exit burst's round loop reads and writes: the loop words and the stop flag.

A device-exit burst runs its rounds until a condition at a round boundary fails
(``kernels/round_exit.cu``): the count of rounds reached ``M_max`` (the decoder's
``m_rounds``), no slot has budget left, or the host asked it to stop. The graph runs the
rounds in a conditional WHILE node (:mod:`graphburst.engine.conditional`); the eager modes
and the numpy backend run the same condition kernel and loop on the host.

**The stop flag** is one int32 word of mapped, pinned host memory that the device reads
(volatile) at every boundary: the count of stop requests the host has made. The device keeps
the count it last answered (``state[EXIT_ACK]``); the flag is *set* while the two differ.
:meth:`RoundExit.request_stop` adds one (a serving loop calls it when a request arrives, a
cancel comes or shutdown begins). The device *clears* it at the boundary where a burst ends,
whatever ended it: ``ack`` becomes the count it read there, so every request made before that
boundary is answered by that burst's end, once. A request made while no burst runs is answered
by the next burst, which then runs zero rounds and changes nothing. Only the host writes the
word and only the device writes ``ack``, so no request is lost to a race.

**Held stops** (``hold``: a serving loop's bursts): a burst's end answers nothing, so every burst
launched before the answer runs zero rounds, however many are queued; :meth:`RoundExit.answer`
enqueues the answer on the stream (``ack`` <- the host's count when it was enqueued), behind the
admission the request asked for, and bursts launched after it run whole. A request made after the
answer was enqueued stays pending: the value is the kernel's argument, not a read at run time.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref

import numpy as np

from ..buffers import StreamBufs
from ..constants import (
    EXIT_ACK,
    EXIT_GO,
    EXIT_REASON,
    EXIT_ROUNDS,
    EXIT_WORDS,
    STOP_COUNT_MASK,
)
from .program import Call

#: what ``state[EXIT_REASON]`` names, for reports
EXIT_REASONS = {0: "running", 1: "m_max", 2: "idle", 3: "flag"}
#: the reason of a burst still running (never that of a drained one)
RUNNING = EXIT_REASONS[0]
#: why a drained burst ended: M_max rounds run, every slot stopped, or a stop request
BURST_EXIT_REASONS = tuple(r for r in EXIT_REASONS.values() if r != RUNNING)


class StopFlag:
    """One int32 word the host writes and the device reads: the count of stop requests.

    On cupy it is pinned host memory mapped into the device's address space
    (``cudaHostAlloc(cudaHostAllocMapped)`` through cuda.bindings, freed with the object);
    the device reads it through :attr:`device_address` with no copy. On numpy it is a plain
    array.

    Attributes
    ----------
    word : [1] int32 numpy array over the host memory
    device_address : int
        Where the device reads the word (0 on numpy).
    """

    def __init__(self, backend):
        self.backend = backend
        self._lock = threading.Lock()  # a request may come from any thread (an HTTP handler's, say)
        if not backend.is_gpu:
            self.word = np.zeros(1, np.int32)  # [1] int32
            self.device_address = 0
            return
        try:
            from cuda.bindings import runtime as cudart
        except ImportError as exc:
            raise RuntimeError(f"a device-exit burst's stop flag is mapped host memory, made through cuda-python "
                               f"(cuda.bindings), which is not installed: {exc}") from exc
        mapped = getattr(cudart, "cudaHostAllocMapped", 2)  # cudaHostAllocMapped is 2 in every CUDA release
        with backend.device():
            host = _checked(cudart.cudaHostAlloc(4, mapped), "cudaHostAlloc")
            weakref.finalize(self, cudart.cudaFreeHost, host)
            self.word = np.frombuffer((ctypes.c_int32 * 1).from_address(int(host)), np.int32)  # [1] int32
            self.word[0] = 0
            self.device_address = int(_checked(cudart.cudaHostGetDevicePointer(host, 0), "cudaHostGetDevicePointer"))

    def request(self) -> None:
        """One more stop request (the device answers it at its next round boundary)."""
        with self._lock:
            self.word[0] = (int(self.word[0]) + 1) & STOP_COUNT_MASK

    @property
    def count(self) -> int:
        return int(self.word[0])


def _checked(result, what: str):
    """The value of a cuda.bindings call returning ``(err, value)``; raises on an error."""
    err, value = result[0], result[1]
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return value


class RoundExit:
    """The loop state of one decoder's device-exit bursts, and its condition calls.

    Parameters
    ----------
    bufs : StreamBufs
        The decoder's buffers: the condition reads ``budget``; ``M_max`` is ``m_rounds``.
    backend : Backend
    stream
        The decoder's stream (the state is zeroed on it).

    Attributes
    ----------
    state : [EXIT_WORDS] int32 device array: ``[rounds, go, ack, reason]``
    flag : StopFlag
    m_max : int
    """

    def __init__(self, bufs: StreamBufs, backend, stream):
        self.bufs, self.backend, self.m_max = bufs, backend, bufs.m_rounds
        with backend.device(), stream:
            self.state = backend.zeros((EXIT_WORDS,), np.int32)  # [EXIT_WORDS] int32: rounds, go, ack, reason
            self.state[EXIT_ACK:EXIT_ACK + 1].fill(0)  # compiles the fill answer() enqueues, outside any capture
        self.flag = StopFlag(backend)
        self._stop_count = self.flag.device_address if backend.is_gpu else self.flag.word
        self.answered = 0  # the count of the last answer() enqueued (held stops)

    def call(self, *, begin: bool, handle: int = 0, hold: bool = False) -> Call:
        """The condition at a round boundary, bound: before the first round (``begin``) or after one.

        ``handle``: the WHILE node's conditional handle inside a graph, 0 in an eager burst.
        ``hold``: a burst's end leaves stop requests pending (held stops, see the module).
        """
        fn = functools.partial(self.backend.ops.round_exit, self.bufs.budget, self.state, self._stop_count,
                               m_max=self.m_max, begin=begin, hold=hold, handle=handle)
        return Call("round_exit_begin" if begin else "round_exit", fn)

    @property
    def pending(self) -> bool:
        """Held stops: a stop request was made that no :meth:`answer` enqueued so far covers."""
        return self.flag.count != self.answered

    def answer(self, stream, count: int | None = None) -> None:
        """Held stops: answer the stop requests up to ``count`` (default: every one made so far; a
        count read earlier leaves the requests made since pending), in stream order on ``stream``
        (one fill of ``ack``; no sync). Bursts launched after it run whole if none is left pending."""
        count = self.flag.count if count is None else int(count)
        with self.backend.device(), stream:
            self.state[EXIT_ACK:EXIT_ACK + 1].fill(count)
        self.answered = count

    def request_stop(self) -> None:
        """Ask the burst in flight to end at its next round boundary (or the next burst to run zero rounds)."""
        self.flag.request()

    def go(self, stream) -> bool:
        """Whether the loop runs another round, read from the device (a host sync on cupy)."""
        return bool(self.backend.to_host(self.state, stream)[EXIT_GO])

    def read(self, stream) -> np.ndarray:
        """``[EXIT_WORDS]`` host copy of the state (a host sync on cupy)."""
        return self.backend.to_host(self.state, stream)


def rounds_and_reason(state_host: np.ndarray) -> tuple[int, str]:
    """(rounds run, why the loop ended) from a host copy of the state."""
    return int(state_host[EXIT_ROUNDS]), EXIT_REASONS.get(int(state_host[EXIT_REASON]), "unknown")


__all__ = ["BURST_EXIT_REASONS", "EXIT_REASONS", "RUNNING", "RoundExit", "StopFlag", "rounds_and_reason"]
