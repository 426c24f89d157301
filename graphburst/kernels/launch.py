"""The memoized ``RawModule`` of ``kernels.cu`` and the launch helpers every wrapper shares.

The wrappers (``burst_cuda``, ``stubs_cuda``, ``sampling_cuda``) each own their launch
configuration and have the same signature as their numpy twins (``*_ref``). Wrappers
never allocate and never sync, so they can run inside a stream capture. Scalars are
wrapped as fixed-width numpy types because a bare Python int would be passed as int64.
"""

from __future__ import annotations

import functools

import cupy
import numpy as np

from ..constants import MAX_LAYER_THREADS
from .source import kernel_source

KERNEL_NAMES = (
    "spec_seed_gather",
    "spec_assemble_verify",
    "spec_accept_greedy_dc",
    "spec_ring_commit",
    "spec_rollback_stream",
    "spec_epilogue",
    "gb_empty_node",
    "spec_admit_slots",
    "spec_cap_drafts",
    "stub_prefill",
    "stub_draft_step",
    "stub_verify",
    "stub_draft_append",
    "stub_logits",
    "spec_probs_select",
    "spec_probs_tiles",
    "spec_probs_normalize",
    "spec_race_tiles",
    "spec_race_pick",
    "spec_accept_tiles",
    "spec_accept_pick",
    "ngram_prefill",
    "ngram_search",
    "ngram_onehot_logits",
    "ngram_append",
    "spec_apply_fields",
    "spec_fields_commit",
    "spec_fields_reset",
    "spec_fields_prompt",
    "spec_fields_first",
)
_i32 = np.int32
_i64 = np.int64


@functools.cache
def _module(device_id: int) -> cupy.RawModule:
    # CuPy appends -ftz=true to every NVRTC compile of a RawModule: float subnormals flush
    # to zero on the device, and sampling_ref.py models that bit for bit (see its ftz).
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=kernel_source(), options=("-std=c++17",))


@functools.cache
def _kernel(device_id: int, name: str) -> cupy.RawKernel:
    return _module(device_id).get_function(name)


def kernel(name: str) -> cupy.RawKernel:
    """The compiled kernel ``name`` on the current device (compiled once per device)."""
    return _kernel(cupy.cuda.Device().id, name)


def warm_up(device_id: int) -> None:
    """Compile the module and load every kernel, so capture never triggers either."""
    with cupy.cuda.Device(device_id):
        for name in KERNEL_NAMES:
            _kernel(device_id, name)


def _blocks(n: int, threads: int) -> int:
    return max(1, (n + threads - 1) // threads)


def _layer_threads(n_layers: int) -> int:
    return min(MAX_LAYER_THREADS, max(32, (n_layers + 31) // 32 * 32))


@functools.cache
def _function(device_id: int, name: str) -> cupy.cuda.function.Function:
    """The compiled kernel's launchable function, which takes its stream as an argument."""
    return _kernel(device_id, name).kernel


def _launch(name, grid: tuple, block: tuple, args, stream, shared_mem=0) -> None:
    # The stream goes to the launch itself: ``with stream:`` around a RawKernel call costs
    # the host microseconds per launch, and admission launches while the GPU may be waiting.
    _function(cupy.cuda.runtime.getDevice(), name)(grid, block, args, shared_mem=shared_mem, stream=stream)


def _step_arg(step, n_rows):
    """(kernel step argument, rows launched on grid y) for ``step`` None (all) or one row."""
    return (_i32(-1), n_rows) if step is None else (_i32(step), 1)


def _or_null(arr):
    return np.uint64(0) if arr is None else arr
