"""Thin cupy wrappers, one per kernel in ``kernels.cu``, and the memoized module they launch from.

The generic and stub wrappers live here; the sampling ones in
:mod:`graphburst.cuda_sampling_ops`, re-exported at the end so ``backend.ops`` (this
module) names every kernel op. Each wrapper owns its launch configuration and has the
same signature as its numpy twin in ``reference.py``. Wrappers never allocate and never sync, so they can run
inside a stream capture. Scalars are wrapped as fixed-width numpy types because a bare
Python int would be passed as int64.
"""

from __future__ import annotations

import functools
from pathlib import Path

import cupy
import numpy as np

from .constants import MAX_LAYER_THREADS, THREADS_PER_BLOCK

KERNEL_SOURCE = Path(__file__).with_name("kernels.cu")
KERNEL_NAMES = (
    "spec_seed_gather",
    "spec_assemble_verify",
    "spec_accept_greedy_dc",
    "spec_ring_commit",
    "spec_rollback_stream",
    "spec_epilogue",
    "gb_empty_node",
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
)
_i32 = np.int32
_i64 = np.int64


@functools.cache
def _module(device_id: int) -> cupy.RawModule:
    # CuPy appends -ftz=true to every NVRTC compile of a RawModule: float subnormals flush
    # to zero on the device, and sampling_ref.py models that bit for bit (see its ftz).
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=KERNEL_SOURCE.read_text(), options=("-std=c++17",))


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


def _launch(name, grid, block, args, stream, shared_mem=0) -> None:
    with stream:
        kernel(name)(grid, block, args, shared_mem=shared_mem)


def _step_arg(step, n_rows):
    """(kernel step argument, rows launched on grid y) for ``step`` None (all) or one row."""
    return (_i32(-1), n_rows) if step is None else (_i32(step), 1)


def _or_null(arr):
    return np.uint64(0) if arr is None else arr


# ----------------------------------------------------------------------------- generic


def seed_gather(pend, pos_ctr, vtok, pos_start, brk, ring, *, reset_ring, stream):
    batch, k1 = vtok.shape
    grid = (_blocks(batch, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)
    args = (_i32(batch), _i32(k1 - 1), _i32(bool(reset_ring)), pend, pos_ctr, vtok, pos_start, brk, ring,
            _i32(ring.shape[1]))
    _launch("spec_seed_gather", grid, block, args, stream)


def assemble_verify(pend, draft_tok, brk, vtok, *, stream):
    batch, k1 = vtok.shape
    grid = (_blocks(batch * k1, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)
    _launch("spec_assemble_verify", grid, block, (_i32(batch), _i32(k1 - 1), pend, draft_tok, brk, vtok), stream)


def accept_greedy(vtok, tgt_pred, brk, n_acc, last_pred, *, stream):
    batch, k1 = vtok.shape
    grid = (_blocks(batch, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)
    args = (_i32(batch), _i32(k1 - 1), vtok, tgt_pred, brk, n_acc, last_pred)
    _launch("spec_accept_greedy_dc", grid, block, args, stream)


def ring_commit(vtok, n_acc, last_pred, eos, budget, ring, pend, acc, n_commit, *, stream):
    batch, k1 = vtok.shape
    grid = (_blocks(batch, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)
    args = (_i32(batch), _i32(k1 - 1), _i32(ring.shape[1] - 1), vtok, n_acc, last_pred, eos, budget, ring,
            _i32(ring.shape[1]), pend, acc, n_commit)
    _launch("spec_ring_commit", grid, block, args, stream)


def rollback_stream(table, pos_start, n_commit, *, stream):
    batch = pos_start.shape[0]
    if len(table) == 0:
        return
    grid = (_blocks(batch, THREADS_PER_BLOCK), len(table))
    block = (THREADS_PER_BLOCK,)
    args = (_i32(batch), _i32(len(table)), table.ptrs, pos_start, n_commit)
    _launch("spec_rollback_stream", grid, block, args, stream)


def epilogue(tgt_pred, eos, vtok, brk, n_acc, last_pred, budget, ring, pend, acc, n_commit, pos_start, pos_ctr,
             table, *, stream):
    batch, k1 = vtok.shape
    grid = (batch,)
    block = (_layer_threads(len(table)),)
    args = (_i32(k1 - 1), _i32(ring.shape[1] - 1), tgt_pred, eos, vtok, brk, n_acc, last_pred, budget, ring,
            _i32(ring.shape[1]), pend, acc, n_commit, pos_start, pos_ctr, table.ptrs, _i32(len(table)))
    _launch("spec_epilogue", grid, block, args, stream)


def empty_node(*, stream):
    """One launch of an empty kernel: the unit of the benchmark floor."""
    grid = (1,)
    block = (1,)
    _launch("gb_empty_node", grid, block, (), stream)


# ----------------------------------------------------------------------------- stubs


def stub_prefill(prompt, prompt_len, kv_table, len_table, capacity, vocab, pos_ctr, pend, *, stream):
    batch, p_max = prompt.shape
    grid = (batch,)
    block = (_layer_threads(len(kv_table)),)
    args = (prompt, prompt_len, _i32(p_max), kv_table.ptrs, len_table.ptrs, _i32(len(kv_table)), _i32(capacity),
            _i32(vocab), _or_null(pos_ctr), _or_null(pend))
    _launch("stub_prefill", grid, block, args, stream)


def stub_draft_step(step, vtok, pos_ctr, kv_table, len_table, capacity, vocab, seed, agree24, pmin24, cost_ns,
                    draft_tok, draft_conf, brk, *, extend_last=True, stream):
    batch, k = draft_tok.shape
    grid = (batch,)
    block = (_layer_threads(len(kv_table)),)
    args = (_i32(step), _i32(k), vtok, pos_ctr, kv_table.ptrs, len_table.ptrs, _i32(len(kv_table)), _i32(capacity),
            _i32(vocab), seed, agree24, _i32(pmin24), _i64(cost_ns), draft_tok, draft_conf, brk,
            _i32(bool(extend_last)))
    _launch("stub_draft_step", grid, block, args, stream)


def stub_verify(vtok, pos_ctr, kv_table, len_table, capacity, vocab, cost_ns, tgt_pred, *, stream):
    batch, k1 = vtok.shape
    grid = (batch,)
    block = (_layer_threads(len(kv_table)),)
    shared = 2 * k1 * np.dtype(np.uint32).itemsize
    args = (_i32(k1 - 1), vtok, pos_ctr, kv_table.ptrs, len_table.ptrs, _i32(len(kv_table)), _i32(capacity),
            _i32(vocab), _i64(cost_ns), tgt_pred)
    _launch("stub_verify", grid, block, args, stream, shared_mem=shared)


def stub_draft_append(draft_tok, pos_ctr, brk, kv_table, len_table, capacity, *, stream):
    batch, k = draft_tok.shape
    grid = (batch,)
    block = (_layer_threads(len(kv_table)),)
    args = (_i32(k), draft_tok, pos_ctr, brk, kv_table.ptrs, len_table.ptrs, _i32(len(kv_table)), _i32(capacity))
    _launch("stub_draft_append", grid, block, args, stream)


def stub_logits(pred, pos, logits, *, pos_offset, salt, spread, peak, step=None, stream):
    batch, n_rows, vocab = logits.shape
    step_arg, grid_y = _step_arg(step, n_rows)
    grid = (batch, grid_y)
    block = (THREADS_PER_BLOCK,)
    args = (_i32(n_rows), _i32(vocab), step_arg, pred, _i32(pred.shape[1]), pos, _i32(pos_offset),
            np.uint32(salt), np.float32(spread), np.float32(peak), logits)
    _launch("stub_logits", grid, block, args, stream)


# ----------------------------------------------------------------------------- sampling
# The sampling wrappers and ops (cuda_sampling_ops.py), re-exported: the backend's ``ops``
# is this module. Imported last because that module shares _launch and _step_arg above.
from .cuda_sampling_ops import (  # noqa: E402, F401 (re-exported)
    accept_pick,
    accept_sample,
    accept_tiles,
    draft_probs_sample,
    probs_from_logits,
    probs_normalize,
    probs_select,
    probs_tiles,
    race_pick,
    race_tiles,
    sample_draft,
)
