"""Every CUDA kernel against its numpy reference, bit-exactly, on fresh random inputs.

Inputs use awkward batch sizes, everything past a valid length is poisoned with
PLACEHOLDER_TOKEN (-1), and lengths/markers include out-of-range values so the clamps
are exercised too.

Each kernel runs on a fresh non-blocking stream, and everything it reads is uploaded on
that stream (``Backend.to_device``, pointer tables built with ``stream=``) and read back
on it (``Backend.to_host``): on a GPU shared with other processes a copy issued on the
legacy default stream landed after the kernel, which then read the pool block's old
contents (outputs equal to the inputs; a pointer table of garbage).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from graphburst.kernels import reference
from graphburst.backend import Backend
from graphburst.buffers import KVCache, KVLayer, PtrTable, kv_len_ptr_table_range
from graphburst.constants import NO_EOS, NO_PREFILL, PLACEHOLDER_TOKEN, UNBOUNDED_BUDGET
from graphburst.kernels.digest import fixed24
from graphburst.models.stubs import storage_ptr_table

pytestmark = pytest.mark.gpu  # skipped without CUDA by conftest's collection hook
cp = pytest.importorskip("cupy")

SIZES = [1, 7, 19, 257]
KS = [1, 4, 7]
P = PLACEHOLDER_TOKEN


@pytest.fixture(scope="module")
def gpu_backend():
    return Backend("cupy")


@pytest.fixture(scope="module")
def ops(gpu_backend):
    return gpu_backend.ops


@functools.cache
def _gpu() -> Backend:
    return Backend("cupy")


def launch_stream():
    """A fresh non-blocking stream for one kernel under test: its inputs are uploaded on it and its
    outputs read back on it, so nothing else the GPU runs can come between."""
    return cp.cuda.Stream(non_blocking=True)


def upload(host: dict, stream) -> dict:
    """Device copies of ``host``'s arrays, copied on ``stream`` (the kernel's)."""
    return {n: _gpu().to_device(a, stream) for n, a in host.items()}


def run_pair(name, host: dict, scalars: dict, ops):
    """Run reference and CUDA kernel ``name`` on copies of ``host``; assert equal outputs."""
    stream = launch_stream()
    dev = upload(host, stream)
    want = {n: a.copy() for n, a in host.items()}
    getattr(reference, name)(**want, **scalars)
    getattr(ops, name)(**dev, **scalars, stream=stream)
    for n in host:
        got = _gpu().to_host(dev[n], stream)
        if got.dtype == np.float32:
            got, exp = got.view(np.int32), want[n].view(np.int32)
        else:
            exp = want[n]
        np.testing.assert_array_equal(got, exp, err_msg=f"{name}: {n}")
    return want


def poison_past(arr, valid):
    """Set ``arr[b, valid[b]:]`` to PLACEHOLDER_TOKEN."""
    cols = np.arange(arr.shape[1])[None, :]
    arr[cols >= np.asarray(valid)[:, None]] = P
    return arr


@pytest.mark.parametrize("batch", SIZES)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("reset", [False, True])
def test_seed_gather(rng, ops, batch, k, reset):
    m = 3
    host = dict(
        pend=rng.integers(0, 1000, batch, dtype=np.int32),
        pos_ctr=rng.integers(0, 5000, batch, dtype=np.int32),
        vtok=np.full((batch, k + 1), P, np.int32),
        pos_start=np.full(batch, P, np.int32),
        brk=rng.integers(-3, 9, (batch, 2), dtype=np.int32),
        ring=rng.integers(-1, 50, (batch, m * (k + 1) + 1), dtype=np.int32),
    )
    run_pair("seed_gather", host, dict(reset_ring=reset), ops)


@pytest.mark.parametrize("batch", SIZES)
@pytest.mark.parametrize("k", KS)
def test_assemble_verify(rng, ops, batch, k):
    host = dict(
        pend=rng.integers(0, 1000, batch, dtype=np.int32),
        draft_tok=rng.integers(0, 1000, (batch, k), dtype=np.int32),
        brk=rng.integers(-2, k + 3, (batch, 2), dtype=np.int32),
        vtok=np.full((batch, k + 1), 77, np.int32),
    )
    out = run_pair("assemble_verify", host, {}, ops)
    n_valid = np.clip(host["brk"][:, 0], 0, k)
    assert (out["vtok"][np.arange(k + 1)[None, :] > n_valid[:, None]] == P).all()


@pytest.mark.parametrize("batch", SIZES)
@pytest.mark.parametrize("k", KS)
def test_accept_greedy(rng, ops, batch, k):
    tgt = rng.integers(0, 3, (batch, k + 1), dtype=np.int32)
    vtok = np.concatenate([rng.integers(0, 3, (batch, 1)), tgt[:, :k]], axis=1).astype(np.int32)
    flip = rng.random((batch, k)) < 0.25
    vtok[:, 1:][flip] = (vtok[:, 1:][flip] + 1) % 3
    brk = np.stack([rng.integers(-1, k + 2, batch), rng.integers(0, 2, batch)], axis=1).astype(np.int32)
    poison_past(vtok[:, 1:], np.clip(brk[:, 0], 0, k))
    host = dict(vtok=vtok, tgt_pred=tgt, brk=brk, n_acc=np.full(batch, P, np.int32),
                last_pred=np.full(batch, P - 1, np.int32))
    run_pair("accept_greedy", host, {}, ops)


@pytest.mark.parametrize(
    "drafts, preds, n_valid, expect",
    [
        ([5, 6, 7], [5, 2, 7, 8], 3, (1, 2)),  # early mismatch
        ([5, 6, 7], [5, 6, 7, 8], 3, (3, 8)),  # all accepted
        ([5, 6, 7], [1, 6, 7, 8], 3, (0, 1)),  # nothing accepted
        ([5, 6, 7], [5, 6, 7, 8], 0, (0, 5)),  # break at position 0
    ],
)
def test_accept_hand_cases_gpu(ops, drafts, preds, n_valid, expect):
    host = dict(vtok=np.array([[9] + drafts], np.int32), tgt_pred=np.array([preds], np.int32),
                brk=np.array([[n_valid, int(n_valid < 3)]], np.int32), n_acc=np.full(1, P, np.int32),
                last_pred=np.full(1, P, np.int32))
    out = run_pair("accept_greedy", host, {}, ops)
    assert (int(out["n_acc"][0]), int(out["last_pred"][0])) == expect


@pytest.mark.parametrize("batch", SIZES)
@pytest.mark.parametrize("k", KS)
def test_ring_commit(rng, ops, batch, k):
    m = 2
    cap = m * (k + 1)
    vtok = rng.integers(0, 6, (batch, k + 1), dtype=np.int32)
    n_acc = rng.integers(-1, k + 2, batch, dtype=np.int32)
    eos = np.where(rng.random(batch) < 0.5, NO_EOS, rng.integers(0, 6, batch)).astype(np.int32)
    budget = np.where(rng.random(batch) < 0.4, UNBOUNDED_BUDGET, rng.integers(-1, k + 3, batch)).astype(np.int32)
    count = rng.integers(-1, cap + 2, batch)
    ring = poison_past(rng.integers(0, 6, (batch, cap + 1)).astype(np.int32), np.clip(count, 0, cap) + 1)
    ring[:, 0] = count
    host = dict(vtok=vtok, n_acc=n_acc, last_pred=rng.integers(0, 6, batch, dtype=np.int32), eos=eos, budget=budget,
                ring=ring, pend=rng.integers(0, 6, batch, dtype=np.int32),
                acc=rng.integers(0, 100, (batch, 2), dtype=np.int32), n_commit=np.full(batch, P, np.int32))
    run_pair("ring_commit", host, {}, ops)


@pytest.mark.parametrize("batch", SIZES)
def test_admit_slots(rng, ops, batch):
    n = int(rng.integers(1, batch + 1))
    slots = rng.permutation(batch)[:n]
    outside = np.array([-1, batch, batch + 5])  # skipped by both
    table = np.stack([np.concatenate([slots, outside]),
                      np.where(rng.random(n + 3) < 0.3, UNBOUNDED_BUDGET, rng.integers(0, 300, n + 3)),
                      np.where(rng.random(n + 3) < 0.5, NO_EOS, rng.integers(0, 1000, n + 3))]).astype(np.int32)
    host = dict(table=np.ascontiguousarray(table[:, rng.permutation(n + 3)]),
                budget=np.full(batch, P, np.int32), eos=np.full(batch, P, np.int32),
                acc=rng.integers(1, 100, (batch, 2), dtype=np.int32))
    want = run_pair("admit_slots", host, {}, ops)
    assert (want["acc"][slots] == 0).all() and (want["budget"][slots] != P).all()


@pytest.mark.parametrize("batch", SIZES)
@pytest.mark.parametrize("n_cols", [1, 3])
def test_admit_slots_writes_option_columns(rng, ops, batch, n_cols):
    """The option columns (a PtrTable of [B] int32 arrays, one a uint32 view): each admitted slot's
    values land in its column entry; slots outside the batch and the other slots keep theirs."""
    n = int(rng.integers(1, batch + 1))
    slots = rng.permutation(batch)[:n]
    outside = np.array([-1, batch, batch + 5])
    table = np.concatenate([np.stack([np.concatenate([slots, outside]), rng.integers(0, 300, n + 3),
                                      rng.integers(0, 1000, n + 3)]),
                            rng.integers(-2**31, 2**31, (n_cols, n + 3))]).astype(np.int32)
    table = np.ascontiguousarray(table[:, rng.permutation(n + 3)])
    start = [rng.integers(-2**31, 2**31, batch).astype(np.int32) for _ in range(n_cols)]
    outs = []
    acc = rng.integers(1, 100, (batch, 2), dtype=np.int32)
    for be in (Backend("numpy"), _gpu()):
        stream = launch_stream() if be.is_gpu else None  # every array below is copied on it
        cols = [be.to_device(c, stream) for c in start]
        cols[0] = be.to_device(start[0].view(np.uint32), stream).view(np.int32)  # the stub seed's kind of column
        bufs = dict(budget=be.to_device(np.full(batch, P, np.int32), stream),
                    eos=be.to_device(np.full(batch, P, np.int32), stream), acc=be.to_device(acc, stream))
        table_x, columns = be.to_device(table, stream), PtrTable(cols, be, stream=stream)
        (ops if be.is_gpu else reference).admit_slots(table_x, **bufs, columns=columns, stream=stream)
        outs.append([be.to_host(c, stream) for c in cols] + [be.to_host(bufs["budget"], stream)])
    for want, got in zip(*outs):
        np.testing.assert_array_equal(got, want)
    want_cols = [c.copy() for c in start]
    for c in range(n_cols):
        want_cols[c][table[0][(table[0] >= 0) & (table[0] < batch)]] = table[3 + c][(table[0] >= 0) &
                                                                                    (table[0] < batch)]
        np.testing.assert_array_equal(outs[1][c], want_cols[c])  # against the table, written out


class _Tables:
    """A stub cache's layer arrays on one backend, with its two pointer tables, all copied on
    ``stream`` (the kernel's; None on numpy)."""

    def __init__(self, backend, layout, storage, lengths, capacity, stream=None):
        self.backend, self.stream = backend, stream
        layers = [KVLayer(backend.to_device(storage[i], stream), backend.to_device(lengths[i], stream)) if has
                  else None for i, has in enumerate(layout)]
        self.cache = KVCache(layers, storage[0].shape[0], capacity, backend)
        self.kv = storage_ptr_table(self.cache, stream)
        self.len = kv_len_ptr_table_range(self.cache, range(len(layout)), stream=stream)

    def dump(self):
        """Every layer's storage and length, read back on the tables' stream."""
        out = []
        for layer in self.cache.layers:
            if layer is not None:
                out += [self.backend.to_host(layer.storage, self.stream),
                        self.backend.to_host(layer.length, self.stream)]
        return out


def stub_state(rng, batch, layout, capacity, poison_lengths=False):
    """Random consistent-ish stub KV contents: rows past each length poisoned."""
    storage, lengths = [], []
    for _ in layout:
        ln = rng.integers(0, capacity // 2, batch).astype(np.int32)
        if poison_lengths:
            bad = rng.random(batch) < 0.2
            ln[bad] = rng.choice([-1, capacity + 3], bad.sum())
        st = rng.integers(-(2**31), 2**31 - 1, (batch, capacity), dtype=np.int64).astype(np.int32)
        storage.append(poison_past(st, np.clip(ln, 0, capacity)))
        lengths.append(ln)
    return storage, lengths


def run_stub_pair(name, rng, layout, storage, lengths, capacity, host, scalars, gpu_backend):
    np_be = Backend("numpy")
    t_np = _Tables(np_be, layout, [s.copy() for s in storage], [x.copy() for x in lengths], capacity)
    stream = launch_stream()
    t_cp = _Tables(gpu_backend, layout, storage, lengths, capacity, stream)
    want = {n: a.copy() for n, a in host.items()}
    dev = upload(host, stream)
    getattr(reference, name)(**want, kv_table=t_np.kv, len_table=t_np.len, **scalars)
    getattr(gpu_backend.ops, name)(**dev, kv_table=t_cp.kv, len_table=t_cp.len, **scalars, stream=stream)
    for n in host:
        got, exp = gpu_backend.to_host(dev[n], stream), want[n]
        if got.dtype == np.float32:
            got, exp = got.view(np.int32), exp.view(np.int32)
        np.testing.assert_array_equal(got, exp, err_msg=f"{name}: {n}")
    for i, (g, e) in enumerate(zip(t_cp.dump(), t_np.dump())):
        np.testing.assert_array_equal(g, e, err_msg=f"{name}: layer array {i}")
    return want


LAYOUTS = [[True], [False, True, True, False, True], [True] * 3 + [False] + [True] * 40]


@pytest.mark.parametrize("batch", SIZES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"L{len(x)}")
def test_stub_prefill(rng, gpu_backend, batch, layout):
    capacity, p_max, vocab = 64, 23, 1009
    plen = rng.integers(1, p_max + 1, batch).astype(np.int32)
    plen[rng.random(batch) < 0.2] = NO_PREFILL
    prompt = poison_past(rng.integers(0, vocab, (batch, p_max)).astype(np.int32), np.maximum(plen, 0))
    storage, lengths = stub_state(rng, batch, layout, capacity)
    host = dict(prompt=prompt, prompt_len=plen, pos_ctr=np.full(batch, P, np.int32),
                pend=np.full(batch, P, np.int32))
    run_stub_pair("stub_prefill", rng, layout, storage, lengths, capacity, host,
                  dict(capacity=capacity, vocab=vocab), gpu_backend)


@pytest.mark.parametrize("batch", SIZES)
@pytest.mark.parametrize("p_max", SIZES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"L{len(x)}")
@pytest.mark.parametrize("final", [True, False], ids=["final", "nonfinal"])
def test_stub_prefill_chunk(rng, gpu_backend, batch, p_max, layout, final):
    """A chunk at ``start``: the digest continues from entry start - 1; out-of-range starts and
    chunks running past the capacity are clamped; a non-final chunk gets no pos_ctr/pend (the draft's call)."""
    capacity, vocab = 300, 1009
    plen = rng.integers(0, p_max + 1, batch).astype(np.int32)
    plen[rng.random(batch) < 0.2] = NO_PREFILL
    start = rng.integers(0, capacity + 1, batch).astype(np.int32)
    start[rng.random(batch) < 0.1] = rng.choice([-3, capacity + 5])
    start[0], plen[0] = capacity - 1, p_max  # a chunk that runs past the capacity
    prompt = poison_past(rng.integers(0, vocab, (batch, p_max)).astype(np.int32), np.maximum(plen, 0))
    storage, lengths = stub_state(rng, batch, layout, capacity, poison_lengths=True)
    host = dict(prompt=prompt, prompt_len=plen, start=start)
    scalars = dict(capacity=capacity, vocab=vocab)
    if final:
        host.update(pos_ctr=np.full(batch, P, np.int32), pend=np.full(batch, P, np.int32))
    else:
        scalars.update(pos_ctr=None, pend=None)
    run_stub_pair("stub_prefill", rng, layout, storage, lengths, capacity, host, scalars, gpu_backend)


@pytest.mark.parametrize("batch", SIZES)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"L{len(x)}")
def test_stub_draft_step(rng, gpu_backend, batch, k, layout):
    capacity, vocab = 48, int(rng.choice([2, 7, 50000]))
    step = int(rng.integers(0, k))
    storage, lengths = stub_state(rng, batch, layout, capacity, poison_lengths=True)
    brk = np.stack([rng.integers(0, k + 1, batch), (rng.random(batch) < 0.3)], axis=1).astype(np.int32)
    host = dict(vtok=rng.integers(0, vocab, (batch, k + 1)).astype(np.int32),
                pos_ctr=rng.integers(0, 30, batch).astype(np.int32),
                seed=rng.integers(0, 2**32, batch, dtype=np.uint64).astype(np.uint32),
                agree24=rng.choice([0, fixed24(0.5), fixed24(1.0)], batch).astype(np.int32),
                draft_tok=poison_past(rng.integers(0, vocab, (batch, k)).astype(np.int32), np.full(batch, step)),
                draft_conf=np.full((batch, k), -1.0, np.float32), brk=brk)
    scalars = dict(step=step, capacity=capacity, vocab=vocab, pmin24=fixed24(float(rng.random()) * 0.3), cost_ns=0)
    run_stub_pair("stub_draft_step", rng, layout, storage, lengths, capacity, host, scalars, gpu_backend)


@pytest.mark.parametrize("batch", SIZES)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"L{len(x)}")
def test_stub_verify(rng, gpu_backend, batch, k, layout):
    capacity, vocab = 40, int(rng.choice([2, 7, 50000]))
    storage, lengths = stub_state(rng, batch, layout, capacity, poison_lengths=True)
    vtok = rng.integers(0, vocab, (batch, k + 1)).astype(np.int32)
    poison_past(vtok, rng.integers(1, k + 2, batch))
    host = dict(vtok=vtok, pos_ctr=rng.integers(0, 30, batch).astype(np.int32),
                tgt_pred=np.full((batch, k + 1), P, np.int32))
    run_stub_pair("stub_verify", rng, layout, storage, lengths, capacity, host,
                  dict(capacity=capacity, vocab=vocab, cost_ns=0), gpu_backend)


@pytest.mark.parametrize("batch", SIZES)
@pytest.mark.parametrize("n_layers", [1, 19, 300])
def test_rollback_stream(rng, gpu_backend, batch, n_layers):
    layout = [bool(x) for x in rng.random(n_layers) < 0.7]
    layout[0] = True
    storage, lengths = stub_state(rng, batch, layout, 8)
    np_be = Backend("numpy")
    stream = launch_stream()
    pos_np = rng.integers(0, 100, batch).astype(np.int32)
    pos_cp = gpu_backend.to_device(pos_np, stream)
    t_np = _Tables(np_be, layout, storage, [x.copy() for x in lengths], 8)
    t_cp = _Tables(gpu_backend, layout, storage, lengths, 8, stream)
    tab_np = kv_len_ptr_table_range(t_np.cache, range(n_layers), pos_ctr=pos_np)
    tab_cp = kv_len_ptr_table_range(t_cp.cache, range(n_layers), pos_ctr=pos_cp, stream=stream)
    pos_start = rng.integers(0, 1000, batch).astype(np.int32)
    n_commit = rng.integers(0, 9, batch).astype(np.int32)
    reference.rollback_stream(tab_np, pos_start, n_commit)
    start_cp, commit_cp = gpu_backend.to_device(pos_start, stream), gpu_backend.to_device(n_commit, stream)
    gpu_backend.ops.rollback_stream(tab_cp, start_cp, commit_cp, stream=stream)
    for g, e in zip(t_cp.dump(), t_np.dump()):
        np.testing.assert_array_equal(g, e)
    np.testing.assert_array_equal(gpu_backend.to_host(pos_cp, stream), pos_np)
    np.testing.assert_array_equal(pos_np, pos_start + n_commit)


@pytest.mark.parametrize("batch", SIZES)
@pytest.mark.parametrize("k", KS + [31, 40])  # 31: the widest warp-parallel case; 40: the serial fallback
@pytest.mark.parametrize("n_layers", [1, 19, 300])
def test_epilogue_equals_accept_commit_rollback_seed(rng, gpu_backend, batch, k, n_layers):
    """The fused epilogue against the composition of the separate references."""
    m = 2
    cap = m * (k + 1)
    layout = [bool(x) for x in rng.random(n_layers) < 0.7]
    layout[0] = True
    storage, lengths = stub_state(rng, batch, layout, 8)
    tgt = rng.integers(0, 3, (batch, k + 1), dtype=np.int32)
    vtok = np.concatenate([rng.integers(0, 3, (batch, 1)), tgt[:, :k]], axis=1).astype(np.int32)
    flip = rng.random((batch, k)) < 0.25
    vtok[:, 1:][flip] = (vtok[:, 1:][flip] + 1) % 3
    brk = np.stack([rng.integers(-1, k + 2, batch), rng.integers(0, 2, batch)], axis=1).astype(np.int32)
    count = rng.integers(0, cap + 1, batch)
    ring = poison_past(rng.integers(0, 3, (batch, cap + 1)).astype(np.int32), count + 1)
    ring[:, 0] = count
    host = dict(
        tgt_pred=tgt, eos=np.where(rng.random(batch) < 0.5, NO_EOS, rng.integers(0, 3, batch)).astype(np.int32),
        vtok=vtok, brk=brk, n_acc=np.full(batch, P, np.int32), last_pred=np.full(batch, P, np.int32),
        budget=np.where(rng.random(batch) < 0.5, UNBOUNDED_BUDGET, rng.integers(0, k + 3, batch)).astype(np.int32),
        ring=ring, pend=rng.integers(0, 3, batch, dtype=np.int32), acc=rng.integers(0, 50, (batch, 2), dtype=np.int32),
        n_commit=np.full(batch, P, np.int32), pos_start=rng.integers(0, 500, batch).astype(np.int32),
        pos_ctr=rng.integers(0, 500, batch).astype(np.int32))
    np_be = Backend("numpy")
    stream = launch_stream()
    want = {n: a.copy() for n, a in host.items()}
    dev = upload(host, stream)
    t_np = _Tables(np_be, layout, storage, [x.copy() for x in lengths], 8)
    t_cp = _Tables(gpu_backend, layout, storage, lengths, 8, stream)
    reference.epilogue(**want, table=kv_len_ptr_table_range(t_np.cache, range(n_layers), pos_ctr=want["pos_ctr"]))
    table = kv_len_ptr_table_range(t_cp.cache, range(n_layers), pos_ctr=dev["pos_ctr"], stream=stream)
    gpu_backend.ops.epilogue(**dev, table=table, stream=stream)
    for n in host:
        np.testing.assert_array_equal(gpu_backend.to_host(dev[n], stream), want[n], err_msg=f"epilogue: {n}")
    for g, e in zip(t_cp.dump(), t_np.dump()):
        np.testing.assert_array_equal(g, e)
