"""Keep a GPU's copy engines and SMs busy for a while, with a bounded footprint.

A second load on the GPU is what turns a missing stream order into a failure: an upload
that lands late, a read that returns values from before the writes it should see. Run the
GPU suite under it:

  python tools/gpu_load.py --seconds 400 & python3 -m pytest -m gpu -q -n 4

Three non-blocking streams of its own: pinned host-to-device copies on one, pinned
device-to-host copies on another, float32 matmuls on the third. Each stream runs one
operation at a time and rests between them, so it is busy ``--duty`` of the time (default
0.5): a GPU is time-sliced between processes, and a load that never lets go (1.0) leaves
the suite's processes, whose tests sync after a few microseconds of work, waiting whole time
slices for each sync. Device memory: two copy buffers and three matrices, sized from
``--mem-gb`` (pinned host memory: two buffers of the copy size). One line at the start,
one at the end (what it moved and ran). Needs cupy; ``--help`` does not.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

MIN_MEM_GB = 1 / 16  # 64 MiB: a 16 MiB copy buffer each way and small matrices
MAX_COPY_BYTES = 64 * 2**20  # a copy of ~1.3 ms on PCIe 5: short busy spells, many of them
MAX_MATMUL_N = 4096  # ~2.5 ms a float32 matmul on an H200: a time slice's order, not many of them
DEFAULT_DUTY = 0.5  # share of the time each stream is busy
POLL_S = 0.0002  # between polls of the streams' events


def _number(minimum: float | None = None):
    """An argparse type: a finite float > 0 (and >= ``minimum`` when given)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g}, got {text}")
        return value
    return parse


def _fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    value = _number()(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be at most 1, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Example: python tools/gpu_load.py --seconds 400 & "
                                       "python3 -m pytest -m gpu -q -n 4")
    p.add_argument("--seconds", type=_number(), default=60.0, help="how long to run (default 60)")
    p.add_argument("--mem-gb", type=_number(MIN_MEM_GB), default=2.0,
                   help=f"device memory for its buffers, GiB (default 2, at least {MIN_MEM_GB:g}; cuBLAS adds its "
                        f"workspace)")
    p.add_argument("--duty", type=_fraction, default=DEFAULT_DUTY,
                   help=f"share of the time each stream is busy, in (0, 1] (default {DEFAULT_DUTY:g})")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    return p


def plan(mem_gb: float) -> dict:
    """Buffer sizes for a budget of ``mem_gb`` GiB: half for the two copy buffers, half for the
    three ``[n, n]`` float32 matrices (n a multiple of 128)."""
    budget = int(mem_gb * 2**30)
    copy_bytes = min(budget // 4, MAX_COPY_BYTES) // 2**20 * 2**20
    n = min(math.isqrt(budget // 2 // 12) // 128 * 128, MAX_MATMUL_N)
    return {"copy_bytes": copy_bytes, "n": n, "device_bytes": 2 * copy_bytes + 3 * n * n * 4}


class _Lane:
    """One stream running one operation at a time (``issue(stream)`` enqueues it), resting after
    each for as long as it ran times ``(1 - duty) / duty``, so it is busy ``duty`` of the time."""

    def __init__(self, cp, issue, duty: float):
        self.cp, self.issue, self.duty = cp, issue, duty
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.started = self.ended = None  # the operation in flight: events around it
        self.rest_until = 0.0  # monotonic time the next operation may start
        self.issued = 0
        self.busy_ms = 0.0

    def top_up(self, now: float) -> None:
        if self.ended is not None:
            if not self.ended.done:
                return
            ran = self.cp.cuda.get_elapsed_time(self.started, self.ended)  # ms
            self.busy_ms += ran
            self.rest_until = now + ran / 1e3 * (1 - self.duty) / self.duty
            self.started = self.ended = None
        if now < self.rest_until:
            return
        self.started, self.ended = self.cp.cuda.Event(), self.cp.cuda.Event()
        self.started.record(self.stream)
        self.issue(self.stream)
        self.ended.record(self.stream)
        self.issued += 1


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        import cupy as cp
    except ImportError:
        print("gpu_load: needs cupy (pip install '.[cuda12]' or '.[cuda13]')", file=sys.stderr)
        return 2
    try:
        devices = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError as exc:  # no driver or no device
        print(f"gpu_load: no CUDA device: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.device < devices:
        print(f"gpu_load: no CUDA device {args.device} ({devices} found)", file=sys.stderr)
        return 2
    sizes = plan(args.mem_gb)
    copy_bytes, n = sizes["copy_bytes"], sizes["n"]
    with cp.cuda.Device(args.device):
        free, _ = cp.cuda.runtime.memGetInfo()
        if sizes["device_bytes"] > free:
            print(f"gpu_load: --mem-gb {args.mem_gb:g} needs {sizes['device_bytes'] / 2**30:.2f} GiB, "
                  f"{free / 2**30:.2f} GiB free", file=sys.stderr)
            return 2
        rt = cp.cuda.runtime
        h2d_src = cp.cuda.alloc_pinned_memory(copy_bytes)  # [copy_bytes] pinned host
        d2h_dst = cp.cuda.alloc_pinned_memory(copy_bytes)  # [copy_bytes] pinned host
        h2d_dst = cp.empty(copy_bytes, cp.uint8)  # [copy_bytes] uint8
        d2h_src = cp.zeros(copy_bytes, cp.uint8)  # [copy_bytes] uint8
        a = cp.full((n, n), 1.0 / n, cp.float32)  # [n, n] float32
        b = cp.ones((n, n), cp.float32)  # [n, n] float32
        c = cp.empty((n, n), cp.float32)  # [n, n] float32
        cp.cuda.Device().synchronize()  # the fills above, before the lanes' streams use the buffers

        def h2d(s):
            rt.memcpyAsync(h2d_dst.data.ptr, h2d_src.ptr, copy_bytes, rt.memcpyHostToDevice, s.ptr)

        def d2h(s):
            rt.memcpyAsync(d2h_dst.ptr, d2h_src.data.ptr, copy_bytes, rt.memcpyDeviceToHost, s.ptr)

        def matmul(s):
            with s:
                cp.matmul(a, b, out=c)

        lanes = {name: _Lane(cp, issue, args.duty) for name, issue in (("h2d", h2d), ("d2h", d2h),
                                                                          ("matmul", matmul))}
        name = cp.cuda.runtime.getDeviceProperties(args.device)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        print(f"gpu_load: device {args.device} ({name}) for {args.seconds:g} s: {copy_bytes / 2**20:.0f} MiB "
              f"pinned host-to-device and device-to-host copies on two streams, {n}x{n} float32 matmuls on a "
              f"third, each busy {args.duty:.0%} of the time; {sizes['device_bytes'] / 2**30:.2f} GiB of device memory",
              flush=True)
        start = time.monotonic()
        deadline = start + args.seconds
        stopped = ""
        try:
            while time.monotonic() < deadline:
                now = time.monotonic()
                for lane in lanes.values():
                    lane.top_up(now)
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            stopped = " (interrupted)"
        for lane in lanes.values():
            lane.stream.synchronize()
        elapsed = time.monotonic() - start
    gb = 1e9
    print(f"gpu_load: done after {elapsed:.1f} s{stopped}: {lanes['h2d'].issued * copy_bytes / gb:.1f} GB "
          f"host-to-device, {lanes['d2h'].issued * copy_bytes / gb:.1f} GB device-to-host, "
          f"{lanes['matmul'].issued} matmuls ({lanes['matmul'].issued * 2 * n**3 / 1e12:.1f} TFLOP); busy "
          + ", ".join(f"{name} {lane.busy_ms / 1e3 / elapsed:.0%}" for name, lane in lanes.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
