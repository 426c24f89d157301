"""Keep a GPU's copy engines and SMs busy for a while, with a bounded footprint.

A second load on the GPU is what turns a missing stream order into a failure: an upload
that lands late, a read that returns values from before the writes it should see. Run the
GPU suite under it:

  python tools/gpu_load.py --seconds 400 & python3 -m pytest -m gpu -q -n 4

Three non-blocking streams of its own: pinned host-to-device copies on one, pinned
device-to-host copies on another, float32 matmuls on the third, each kept two operations
deep until the time is up. Device memory: two copy buffers and three matrices, sized from
``--mem-gb`` (pinned host memory: two buffers of the copy size). One line at the start,
one at the end (what it moved and ran). Needs cupy; ``--help`` does not.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import time

MIN_MEM_GB = 1 / 16  # 64 MiB: a 16 MiB copy buffer each way and small matrices
MAX_COPY_BYTES = 512 * 2**20  # a copy of ~10 ms on PCIe 5: the loop stays responsive to its deadline
MAX_MATMUL_N = 8192  # ~20 ms a matmul on an H200
DEPTH = 2  # operations in flight per stream: the next is queued before the last ends
POLL_S = 0.0005  # between polls of the streams' events


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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Example: python tools/gpu_load.py --seconds 400 & "
                                       "python3 -m pytest -m gpu -q -n 4")
    p.add_argument("--seconds", type=_number(), default=60.0, help="how long to run (default 60)")
    p.add_argument("--mem-gb", type=_number(MIN_MEM_GB), default=2.0,
                   help=f"device memory for its buffers, GiB (default 2, at least {MIN_MEM_GB:g}; cuBLAS adds its "
                        f"workspace)")
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
    """One stream kept ``DEPTH`` operations deep; ``issue(stream)`` enqueues one operation."""

    def __init__(self, cp, issue):
        self.cp, self.issue = cp, issue
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.pending: collections.deque = collections.deque()
        self.issued = 0

    def top_up(self) -> None:
        while self.pending and self.pending[0].done:
            self.pending.popleft()
        while len(self.pending) < DEPTH:
            self.issue(self.stream)
            event = self.cp.cuda.Event(disable_timing=True)
            event.record(self.stream)
            self.pending.append(event)
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

        lanes = {"h2d": _Lane(cp, h2d), "d2h": _Lane(cp, d2h), "matmul": _Lane(cp, matmul)}
        name = cp.cuda.runtime.getDeviceProperties(args.device)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        print(f"gpu_load: device {args.device} ({name}) for {args.seconds:g} s: {copy_bytes / 2**20:.0f} MiB "
              f"pinned host-to-device and device-to-host copies on two streams, {n}x{n} float32 matmuls on a "
              f"third; {sizes['device_bytes'] / 2**30:.2f} GiB of device memory", flush=True)
        start = time.monotonic()
        deadline = start + args.seconds
        stopped = ""
        try:
            while time.monotonic() < deadline:
                for lane in lanes.values():
                    lane.top_up()
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            stopped = " (interrupted)"
        for lane in lanes.values():
            lane.stream.synchronize()
        elapsed = time.monotonic() - start
    gb = 1e9
    print(f"gpu_load: done after {elapsed:.1f} s{stopped}: {lanes['h2d'].issued * copy_bytes / gb:.1f} GB "
          f"host-to-device, {lanes['d2h'].issued * copy_bytes / gb:.1f} GB device-to-host, "
          f"{lanes['matmul'].issued} matmuls ({lanes['matmul'].issued * 2 * n**3 / 1e12:.1f} TFLOP)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
