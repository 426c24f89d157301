"""The two execution backends: ``cupy`` (CUDA kernels) and ``numpy`` (the reference).

Orchestration code is written once against :class:`Backend`; only the array module,
the kernel namespace (``ops``) and stream handling differ.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np

BACKEND_NAMES = ("auto", "cupy", "numpy")


class HostStream:
    """Stand-in for a CUDA stream on the numpy backend: work runs in program order."""

    ptr = 0

    def synchronize(self) -> None:
        """Nothing to wait for: host kernels have already run."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


@functools.cache
def cuda_available() -> bool:
    """True when cupy imports and sees at least one CUDA device."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - any driver/runtime failure means "no usable GPU"
        return False


@functools.cache
def _announce_numpy_fallback() -> None:
    # functools.cache makes this fire once per process, which is the point.
    warnings.warn(
        "graphburst: no CUDA device found; using the numpy backend (CPU reference, not GPU timings)",
        RuntimeWarning,
        stacklevel=3,
    )


class Backend:
    """Array module, kernels and streams of one backend.

    Parameters
    ----------
    name : {"cupy", "numpy"}
    device_id : int, optional
        CUDA device for the cupy backend (the current device when omitted).
    """

    def __init__(self, name: str, device_id: int | None = None):
        if name == "cupy":
            if not cuda_available():
                raise ValueError("backend='cupy' needs cupy and a CUDA device; none was found")
            import cupy

            from .kernels import cuda_ops

            self.xp = cupy
            self.ops = cuda_ops
            self.device_id = cupy.cuda.Device().id if device_id is None else int(device_id)
        elif name == "numpy":
            from .kernels import reference

            self.xp = np
            self.ops = reference
            self.device_id = None
        else:
            raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
        self.name = name

    @property
    def is_gpu(self) -> bool:
        return self.name == "cupy"

    def __repr__(self) -> str:
        dev = "" if self.device_id is None else f", device={self.device_id}"
        return f"Backend({self.name!r}{dev})"

    def device(self):
        """Context manager that makes this backend's device current (no-op on numpy)."""
        if self.is_gpu:
            return self.xp.cuda.Device(self.device_id)
        return HostStream()

    def new_stream(self):
        """A fresh non-blocking stream (capture never works on the legacy stream)."""
        if self.is_gpu:
            with self.device():
                return self.xp.cuda.Stream(non_blocking=True)
        return HostStream()

    def current_stream(self):
        """The device's current stream: the legacy default stream unless a ``with stream:`` is open.

        Pass it explicitly where work is meant for whatever stream is current (a model built before
        any decoder: :meth:`order_after_current` then orders it before the decoder's stream).
        """
        if self.is_gpu:
            with self.device():
                return self.xp.cuda.get_current_stream()
        return HostStream()

    def _stream(self, stream, what: str):
        # Every transfer names its stream: ``None`` meant "the current stream", the legacy default
        # stream by default, which a non-blocking stream does not wait for. A kernel there read an
        # upload before it landed, and a host read returned values older than the kernels before it.
        if stream is None and self.is_gpu:
            raise ValueError(f"{what} needs the stream that orders it: the stream whose kernels read or wrote the "
                             f"array (backend.current_stream() for the current one)")
        return stream

    def order_after_current(self, stream) -> None:
        """Make ``stream`` wait for the work already enqueued on the device's current stream.

        ``cupy.zeros`` and ``arr[...] = v`` run on the current stream (the legacy null
        stream by default), which a non-blocking stream does not wait for. An event
        recorded there and waited on by ``stream`` orders that work first with no host
        sync. A no-op on numpy, and when ``stream`` is the current stream.
        """
        if not self.is_gpu:
            return
        with self.device():
            current = self.xp.cuda.get_current_stream()
            if current.ptr == stream.ptr:
                return
            event = self.xp.cuda.Event(disable_timing=True)
            event.record(current)
            stream.wait_event(event)

    def zeros(self, shape, dtype):
        with self.device():
            return self.xp.zeros(shape, dtype=dtype)

    def full(self, shape, value, dtype):
        with self.device():
            return self.xp.full(shape, value, dtype=dtype)

    def to_device(self, host, stream, dtype=None):
        """A new device array holding a copy of ``host``, allocated and copied on ``stream``.

        ``stream`` is the stream whose kernels read the array (or one they are ordered after):
        required on cupy, where a copy issued on another stream may land after those kernels
        have run. A copy on numpy too, so the array never aliases the caller's.
        """
        host = np.array(host, dtype=dtype, copy=True, order="C")
        if not self.is_gpu:
            return host
        with self.device(), self._stream(stream, "to_device"):
            # ``stream`` current: the pool block is one of its own (reused in its order only), and CuPy
            # stages the bytes in pinned memory and copies them on it, never blocking the host on a
            # stream that is still busy (a pageable copy may wait for the stream to stage it)
            return self.xp.asarray(host)

    def address(self, arr) -> int:
        """Device (or host) address of an array's (or a torch tensor's) first element."""
        if hasattr(arr, "data_ptr"):  # a torch tensor, duck-typed so torch stays optional
            return int(arr.data_ptr())
        return int(arr.data.ptr) if self.is_gpu else int(arr.ctypes.data)

    def to_host(self, arr, stream) -> np.ndarray:
        """Copy to a numpy array once the work on ``stream`` (required on cupy: the stream that wrote
        ``arr``) has run; a host sync on that stream only."""
        if self.is_gpu:
            return arr.get(stream=self._stream(stream, "to_host"))
        return np.array(arr, copy=True)

    def host_buffer(self, shape) -> np.ndarray:
        """A zeroed host int32 array: pinned on cupy, so a copy into it is truly asynchronous."""
        if not self.is_gpu:
            return np.zeros(shape, np.int32)
        n = int(np.prod(shape))
        mem = self.xp.cuda.alloc_pinned_memory(n * 4)
        arr = np.frombuffer(mem, np.int32, n).reshape(shape)
        arr[...] = 0
        return arr  # the array keeps ``mem`` alive through its base

    def copy_to_host(self, host_dst: np.ndarray, src, stream) -> None:
        """Stream-ordered copy of a device array into a (pinned, :meth:`host_buffer`) host array:
        no host sync; the host reads it once an event recorded after it has completed. A plain
        copy on numpy."""
        if self.is_gpu:
            rt = self.xp.cuda.runtime
            stream = self._stream(stream, "copy_to_host")
            rt.memcpyAsync(host_dst.ctypes.data, src.data.ptr, src.nbytes, rt.memcpyDeviceToHost, stream.ptr)
        else:
            np.copyto(host_dst, src)

    def upload(self, dst, host: np.ndarray, stream) -> None:
        """Stream-ordered host-to-device copy into an existing array (no allocation); ``stream``
        (required on cupy) is the stream whose kernels read ``dst``."""
        host = np.ascontiguousarray(host, dtype=dst.dtype)
        if self.is_gpu:
            stream = self._stream(stream, "upload")
            if host.size != dst.size or not dst.flags.c_contiguous:
                raise ValueError(f"upload of {host.shape} into a {'' if dst.flags.c_contiguous else 'strided '}"
                                 f"device array of {dst.shape}")
            # The runtime's copy straight from the (pageable) host array, which it stages
            # before returning: ndarray.set's checks and wrappers cost the host ~10 µs, and
            # admission uploads while the GPU may be waiting on it.
            rt = self.xp.cuda.runtime
            rt.memcpyAsync(dst.data.ptr, host.ctypes.data, host.nbytes, rt.memcpyHostToDevice, stream.ptr)
        else:
            np.copyto(dst, host.reshape(dst.shape))

    def scatter(self, dst, rows, values, stream) -> None:
        """Stream-ordered ``dst[rows] = values``: only the named rows change.

        Unlike a read-modify-write through the host (``to_host`` then ``upload``), this
        never syncs and never overwrites rows the device changed since the host last
        looked, so it may be enqueued behind bursts still in flight. ``rows`` is a host
        int array; ``values`` a scalar or one entry (row) per element of ``rows``; ``stream``
        (required on cupy) the stream whose kernels read ``dst``. Allocates two small
        temporaries from the pool: never inside a capture.
        """
        rows = np.asarray(rows, np.int64)
        if rows.size == 0:
            return
        if not self.is_gpu:
            dst[rows] = values
            return
        with self.device(), self._stream(stream, "scatter"):
            idx = self.xp.asarray(rows)  # the H2D copies run on ``stream``, like the scatter
            dst[idx] = values if np.isscalar(values) else self.xp.asarray(np.asarray(values, dst.dtype))

    def copy_rows(self, dst, src, rows, stream) -> None:
        """Stream-ordered ``dst[rows] = src[rows]`` on the device (no host round trip)."""
        rows = np.asarray(rows, np.int64)
        if rows.size == 0:
            return
        if not self.is_gpu:
            dst[rows] = src[rows]
            return
        with self.device(), self._stream(stream, "copy_rows"):
            idx = self.xp.asarray(rows)
            dst[idx] = src[idx]

    def check_device(self, name: str, arr) -> None:
        """Raise ValueError when an array or torch tensor lives on another device than this backend."""
        if hasattr(arr, "data_ptr"):  # a torch tensor: CUDA on this device for cupy, CPU for numpy
            kind, index = arr.device.type, arr.device.index
            want = ("cuda", self.device_id) if self.is_gpu else ("cpu", None)
            if (kind, index if kind == "cuda" else None) != want:
                where = f"cuda:{want[1]}" if self.is_gpu else "cpu"
                raise ValueError(f"{name} is a torch tensor on {arr.device}, but the {self.name} backend needs {where}")
            return
        if self.is_gpu and arr.device.id != self.device_id:
            raise ValueError(f"{name} is on CUDA device {arr.device.id}, but the backend uses device {self.device_id}")


def get_backend(name: str | Backend = "auto") -> Backend:
    """Resolve a backend name; ``"auto"`` picks cupy when a GPU is present.

    With no CUDA device, ``"auto"`` falls back to numpy and says so once per process.

    Parameters
    ----------
    name : {"auto", "cupy", "numpy"} or Backend

    Returns
    -------
    Backend
    """
    if isinstance(name, Backend):
        return name
    if name == "auto":
        if cuda_available():
            return Backend("cupy")
        _announce_numpy_fallback()
        return Backend("numpy")
    return Backend(name)
