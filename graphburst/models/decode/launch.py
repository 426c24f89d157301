"""How the decode kernels launch: Triton's CPU interpreter, and programmatic dependent launch (PDL).

**PDL** (Hopper and later). A kernel launched with ``launch_pdl=True`` may start while the
kernel before it in the stream still runs: as soon as every program of that one has called
``gdc_launch_dependents`` (or exited). Until its own ``gdc_wait`` returns, nothing the
previous kernel wrote is guaranteed visible, and that kernel may still be reading. At B = 1
a decode layer is ~10 kernels of a few µs each, so the launch latency and each kernel's
ramp-up are a large share of the layer; PDL hides them, and lets a GEMV start streaming its
weight while the kernel before it finishes. Each decode kernel takes a ``PDL`` constexpr
and, when it is set, follows one rule (:func:`pdl_wait`):

* before the wait it only loads weights (never written during a forward) and computes
  offsets: no load of activations, residuals, q/k/v, KV, lengths, positions or partial
  sums, and no store at all. A store before the wait could land while the previous kernel
  still reads that memory: torch's allocator hands a buffer freed on the host to the next
  kernel on the assumption that the stream runs kernels one after another;
* every program waits, before any early exit. A kernel then completes only after the one
  before it did, so waiting on the previous kernel covers every earlier one;
* the next kernel is let launch right after the wait: at most two grids are in flight,
  this one computing and the next one loading its weights, rather than a chain of
  programs parked on the SMs waiting for kernels further back.

A kernel without PDL after one with it is ordered as usual (it starts after the previous
one completes); a PDL kernel after a kernel that never calls ``gdc_launch_dependents``
(cuBLAS, a torch op) starts when that one completes, and its wait returns at once. So a
projection that falls back to ``nn.Linear`` breaks the overlap there, not the order.

The interpreter (``TRITON_INTERPRET=1``, how CI runs the kernels on the CPU) cannot run
the ``gdc`` ops, so :func:`pdl_on` is False there: a launch that asks for PDL runs the
same kernel without it, which computes the same bits (the only difference is where the
program waits).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: Triton's CPU interpreter (``TRITON_INTERPRET=1``, how CI runs these kernels); read once, at import, as
#: ``triton.jit`` reads it. It multiplies bf16 ``tl.dot`` operands as raw bits, so the kernels widen them
#: to fp32 there (``DOT_F32``), and it cannot run the ``gdc`` ops, so PDL is off (:func:`pdl_on`).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def pdl_on(pdl: bool) -> bool:
    """Whether a launch that asks for PDL (``pdl``) gets it: never under the interpreter."""
    return bool(pdl) and not INTERPRETED


def launch_options(pdl: bool) -> dict:
    """The launch keywords of a kernel whose ``PDL`` constexpr is ``pdl_on(...)``: ``launch_pdl`` only when on
    (the interpreter takes no such option; off, Triton's default launch is the plain one)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel in the stream completed (its writes visible), then let the
    next one launch (module docstring). Every program calls it before its first load of anything a kernel
    wrote and before its first store; nothing when PDL is off."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
