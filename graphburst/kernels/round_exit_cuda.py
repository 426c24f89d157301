"""Thin cupy wrapper of the device-exit condition kernel (``kernels/round_exit.cu``); twin in
``round_exit_ref``.

``round_exit.cu`` is its own ``RawModule``, compiled on first use: it calls the device
runtime's ``cudaGraphSetConditional``, and a toolchain that cannot build that must leave the
fixed-M kernels of ``kernels.cu`` untouched (device exit is then refused, with the reason).
"""

from __future__ import annotations

import functools
from pathlib import Path

import cupy
import numpy as np

from ..constants import EXIT_THREADS
from .launch import _i32
from .source import kernel_source

ROUND_EXIT_SOURCE = Path(__file__).with_name("round_exit.cu")


#: the ways the module is compiled, in order: its own declaration of ``cudaGraphSetConditional``
#: (what ran on the H200), then the toolkit's ``cuda_device_runtime_api.h`` (needs its headers)
VARIANTS = (("declared", ("-std=c++17",)), ("runtime header", ("-std=c++17", "-DGB_EXIT_RUNTIME_HEADER")))
#: device id -> the variant that compiled (for the probe's report)
compiled_with: dict[int, str] = {}


@functools.cache
def _function(device_id: int) -> cupy.cuda.function.Function:
    errors = []
    with cupy.cuda.Device(device_id):
        for name, options in VARIANTS:
            try:
                module = cupy.RawModule(code=kernel_source(ROUND_EXIT_SOURCE), options=options)
                function = module.get_function("spec_round_exit").kernel
            except Exception as exc:  # noqa: BLE001 - a compile or load error: try the next way, report all
                errors.append(f"{name}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc) else ''}")
                continue
            compiled_with[device_id] = name
            return function
    raise RuntimeError("round_exit.cu did not compile or load: " + "; ".join(errors))


def warm_up(device_id: int) -> str:
    """Compile and load the kernel (outside any capture); the variant that compiled. Raises
    RuntimeError naming every variant's error when none does."""
    _function(device_id)
    return compiled_with[device_id]


def round_exit(budget, state, stop_count, *, m_max, begin, hold=False, handle=0, stream):
    """One block of ``EXIT_THREADS`` (see ``round_exit_ref.round_exit``).

    Parameters
    ----------
    budget : [B] int32
    state : [EXIT_WORDS] int32
    stop_count : numpy.uint64
        Device address of the ``[1] int32`` mapped host word.
    hold : bool
        Stop requests stay pending when the loop ends, until the host answers them.
    handle : int
        The WHILE node's ``cudaGraphConditionalHandle``, 0 outside a graph.
    """
    args = (_i32(budget.shape[0]), _i32(m_max), _i32(bool(begin)), _i32(bool(hold)), budget, state,
            np.uint64(stop_count), np.uint64(handle))
    _function(cupy.cuda.runtime.getDevice())((1,), (EXIT_THREADS,), args, shared_mem=0, stream=stream)
