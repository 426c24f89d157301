"""The host's per-burst bookkeeping in C (``host_ops.c``), built once per machine, through ctypes.

Between bursts the serving loop's host makes ~25 numpy calls over B-element arrays to read a
drained burst into its mirrors and hand the slots their tokens; each costs about a microsecond
of fixed overhead on an H200 host, and at M=8 with zero-cost stubs a burst lasts
~0.1 ms, so the GPU waits on them. ``gb_drain`` and ``gb_append`` do that work in one call
each. The numpy code they replace stays: it is the reference the tests hold them to, and the
path taken where no C compiler is found (:func:`library` returns None then, with one warning).

The shared object is compiled with the system's ``cc`` into a cache directory
(``$GRAPHBURST_CACHE``, else ``$XDG_CACHE_HOME/graphburst`` or ``~/.cache/graphburst``), named by
the machine and the source's hash, so an edit rebuilds it and concurrent processes never load a
partial file.

:class:`Mirror` and :class:`Store` hold the C structs: raw pointers into arrays their owners
allocate once and never rebind (the decoder's host mirror; a serving loop's token rows), and
references that keep those arrays alive.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import warnings

import numpy as np

SOURCE = pathlib.Path(__file__).with_name("host_ops.c")
#: drained blocks carved out of one allocation (Mirror.new_block): ~11 KB each at B=64, M=8, k=4
BLOCKS_PER_ALLOCATION = 64
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def cache_dir() -> pathlib.Path:
    """Where the compiled object is kept."""
    if os.environ.get("GRAPHBURST_CACHE"):
        return pathlib.Path(os.environ["GRAPHBURST_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "graphburst"


def _build() -> pathlib.Path:
    """Compile ``host_ops.c`` unless this source's object is cached; its path."""
    source = SOURCE.read_bytes()
    # named by the source and the machine: a cache shared by hosts of two architectures keeps both
    out = cache_dir() / f"host_ops-{platform.machine()}-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if out.exists():
        return out
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on the PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name, then renamed: a process loading it never sees half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-std=c99", str(SOURCE), "-o", tmp], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


@functools.cache
def library():
    """The loaded library, or None (after one warning) where it cannot be built."""
    try:
        # PyDLL: the calls keep the GIL, so another thread (a stream reading a request's tokens) never
        # sees a row half appended, as with the numpy calls they replace; each lasts about a microsecond.
        lib = ctypes.PyDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr.strip().splitlines()[-1] if isinstance(exc, subprocess.CalledProcessError) and \
            exc.stderr else str(exc)
        warnings.warn(f"graphburst: the C host path is unavailable ({detail}); the loop's per-burst host work "
                      "runs in numpy", RuntimeWarning, stacklevel=2)
        return None
    lib.gb_drain.restype = _I64
    lib.gb_drain.argtypes = [_PTR, _PTR, _PTR, _PTR]
    lib.gb_append.restype = _I64
    lib.gb_append.argtypes = [_PTR, _PTR, ctypes.c_double]
    return lib


def _addr(array: np.ndarray, dtype) -> int:
    """The address of a C-contiguous array of ``dtype`` (checked once, when a struct is set up)."""
    if array.dtype != np.dtype(dtype) or not array.flags.c_contiguous:
        raise TypeError(f"host_ops needs a C-contiguous {np.dtype(dtype)} array, got {array.dtype} "
                        f"{'contiguous' if array.flags.c_contiguous else 'strided'}")
    return array.ctypes.data


class _MirrorStruct(ctypes.Structure):
    _fields_ = [("batch", _I64), ("row", _I64), ("slot_gen", _PTR), ("inflight", _PTR), ("host_pos", _PTR),
                ("host_left", _PTR)]


class _StoreStruct(ctypes.Structure):
    _fields_ = [("batch", _I64), ("row", _I64), ("max_tokens", _I64), ("tokens", _PTR), ("when", _PTR),
                ("count", _PTR), ("counters", _PTR), ("running", _PTR), ("left", _PTR), ("receiving", _PTR),
                ("finished", _PTR), ("n_finished", _I64), ("total", _I64)]


class Mirror:
    """``gb_drain`` over a decoder's host mirror (each ``[B]`` int64) for rings of ``row`` = R + 1 columns."""

    def __init__(self, lib, *, row: int, slot_gen, inflight, host_pos, host_left):
        self._lib, self.batch, self.row = lib, len(slot_gen), int(row)
        self._keep = (slot_gen, inflight, host_pos, host_left)
        self._struct = _MirrorStruct(self.batch, self.row, *(_addr(a, np.int64) for a in self._keep))
        self._ptr = ctypes.addressof(self._struct)
        self.block_size = self.batch * (self.row + 3)  # [B*R1 ring | B counts | 2B acc] int32
        self._blocks, self._blocks_addr, self._next_block = None, 0, BLOCKS_PER_ALLOCATION

    def new_block(self) -> tuple[np.ndarray, int]:
        """A fresh ``[block_size]`` int32 block for :meth:`drain` to fill, and its address.

        Blocks are rows of a larger allocation, so a block's address is that allocation's plus an
        offset: ``ndarray.ctypes.data`` costs the host about a microsecond a call, once a burst.
        A block is never handed out twice (the tokens drained into it are the caller's to keep),
        and an allocation is freed once no block of it is referenced."""
        i = self._next_block
        if i == BLOCKS_PER_ALLOCATION:
            self._blocks = np.empty((BLOCKS_PER_ALLOCATION, self.block_size), np.int32)
            self._blocks_addr, i = self._blocks.ctypes.data, 0
        self._next_block = i + 1
        return self._blocks[i], self._blocks_addr + i * self.block_size * 4  # 4: bytes per int32

    def drain(self, pinned_addr: int, out_addr: int, launch_gen: np.ndarray | None) -> int:
        """Read a graph's pinned output block (at ``pinned_addr``) into a block of :attr:`block_size`
        int32 (at ``out_addr``) and the mirror; ``launch_gen``: None when no slot generation moved
        since the launch. Returns the slots the burst committed for."""
        gen = None if launch_gen is None else launch_gen.ctypes.data
        return self._lib.gb_drain(self._ptr, pinned_addr, out_addr, gen)


class Store:
    """``gb_append`` over a serving loop's token rows and delivery masks (``serving.slot_tokens``)."""

    def __init__(self, lib, *, row: int, max_tokens: int, tokens, when, count, counters, running, left,
                 receiving, finished):
        self._lib = lib
        self._keep = (tokens, when, count, counters, running, left, receiving, finished)
        addrs = [_addr(tokens, np.int32), _addr(when, np.float64), _addr(count, np.int32),
                 _addr(counters, np.int64), _addr(running, np.bool_), _addr(left, np.int64),
                 _addr(receiving, np.bool_), _addr(finished, np.bool_)]
        self._struct = _StoreStruct(len(running), int(row), int(max_tokens), *addrs, 0, 0)
        self._ptr = ctypes.addressof(self._struct)

    def append(self, block_addr: int, now: float) -> int:
        """Append the block at ``block_addr`` (as :meth:`Mirror.drain` wrote it); the slots receiving.

        Raises IndexError, before any row changes, when a receiving slot's row is full."""
        receiving = self._lib.gb_append(self._ptr, block_addr, now)
        if receiving < 0:
            raise IndexError("a slot's token row is full: more tokens than the cache holds")
        return receiving

    @property
    def n_finished(self) -> int:
        """Running slots with no budget left, as of the last :meth:`append`."""
        return self._struct.n_finished

    @property
    def total(self) -> int:
        """Tokens the last appended burst committed over every slot."""
        return self._struct.total
