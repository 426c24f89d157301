"""host_ops.c against its numpy twins: the drain (BurstTokens + SpecDecoder.finish_burst) and the
append (SlotTokens.append + Delivery.deliver's masks), bit for bit, at awkward batch sizes, with
poisoned counts, moved generations, finished and idle slots; and a serving loop's whole output the
same with the C path and without it."""

from __future__ import annotations

import subprocess
import warnings

import numpy as np
import pytest

from graphburst import greedy_reference, stub_pair
from graphburst.engine import host_ops
from graphburst.burst_tokens import BurstTokens
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop
from graphburst.serving.slot_tokens import SlotTokens

VOCAB = 997
LIB = host_ops.library()


def test_the_c_path_is_built_here():
    assert LIB is not None, "no C compiler on this machine: the tests below would not run the C path"


def _pinned(rng, batch, row):
    """An output block [B*R1 ring | 2B acc | B pos | B budget] int32 with poisoned counts."""
    ring = rng.integers(-5, 1000, (batch, row)).astype(np.int32)
    ring[:, 0] = rng.integers(-3, row + 4, batch)  # below 0 and past R: clamped
    acc = rng.integers(0, 50, (batch, 2)).astype(np.int32)
    pos = rng.integers(0, 300, batch).astype(np.int32)
    budget = rng.integers(0, 40, batch).astype(np.int32)
    return np.concatenate([ring.ravel(), acc.ravel(), pos, budget])


@pytest.mark.parametrize("batch", [1, 7, 19, 257])
@pytest.mark.parametrize("moved", [False, True])
def test_drain_equals_burst_tokens_and_finish_burst(batch, moved):
    rng = np.random.default_rng(batch + moved)
    row = 9  # R1 = 1 + M(k+1) with M=2, k=3
    pinned = _pinned(rng, batch, row)
    mirrors = [{n: rng.integers(-9, 99, batch).astype(np.int64) for n in ("gen", "inflight", "pos", "left")}]
    mirrors.append({n: a.copy() for n, a in mirrors[0].items()})
    launch = mirrors[0]["gen"].copy()
    if moved:
        launch[rng.random(batch) < 0.4] -= 1  # slots prefilled or released since the launch
    # numpy: what capture.py's drain and finish_burst do
    want = mirrors[0]
    ring = pinned[: batch * row].reshape(batch, row)
    acc = pinned[batch * row: batch * row + 2 * batch].reshape(batch, 2)
    pos, budget = pinned[batch * (row + 2): batch * (row + 3)], pinned[batch * (row + 3):]
    tokens = BurstTokens(ring.copy())
    current = launch == want["gen"]
    tokens.drop(~current)
    want["inflight"] -= current
    np.copyto(want["pos"], pos, where=current)
    np.copyto(want["left"], budget, where=current)
    # C
    got = mirrors[1]
    mirror = host_ops.Mirror(LIB, row=row, slot_gen=got["gen"], inflight=got["inflight"], host_pos=got["pos"],
                             host_left=got["left"])
    block = np.full(mirror.block_size, -77, np.int32)  # poisoned: every element must be written
    n = mirror.drain(pinned.ctypes.data, block.ctypes.data, launch if moved else None)
    out = BurstTokens.of_block(block, block.ctypes.data, batch)
    assert n == np.count_nonzero(current)
    np.testing.assert_array_equal(out.data, tokens.data)
    np.testing.assert_array_equal(out.counts, tokens.counts)
    np.testing.assert_array_equal(out.acc, acc)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert out.total == tokens.total and [t.tolist() for t in out] == [t.tolist() for t in tokens]


def test_new_blocks_are_distinct_and_their_addresses_theirs():
    """Mirror.new_block carves blocks out of larger allocations: across an allocation's end every
    block is fresh, its address is its own, and a drain into it lands in it."""
    batch, row = 7, 9
    z = np.zeros(batch, np.int64)
    mirror = host_ops.Mirror(LIB, row=row, slot_gen=z, inflight=z.copy(), host_pos=z.copy(), host_left=z.copy())
    pinned = _pinned(np.random.default_rng(0), batch, row)
    taken = [mirror.new_block() for _ in range(host_ops.BLOCKS_PER_ALLOCATION + 3)]
    addrs = [addr for _, addr in taken]
    assert len(set(addrs)) == len(addrs)
    for block, addr in taken:
        assert block.shape == (mirror.block_size,) and block.dtype == np.int32 and block.flags.c_contiguous
        assert block.ctypes.data == addr
    block, addr = taken[-1]
    block[:] = -77
    mirror.drain(pinned.ctypes.data, addr, None)
    np.testing.assert_array_equal(block[: batch * row], pinned[: batch * row])
    assert not np.shares_memory(taken[0][0], taken[1][0])


def _store_case(rng, batch, row, max_tokens):
    store = SlotTokens(batch, max_tokens, row - 1)
    store.n[:] = rng.integers(0, max_tokens + 1, batch)
    store.nd[:] = rng.integers(0, max_tokens + 1, batch)
    store.acc[:] = rng.integers(0, 9, (batch, 2))
    store.tokens[:] = rng.integers(0, 99, store.tokens.shape)
    return store


@pytest.mark.parametrize("batch", [1, 7, 19, 257])
def test_append_equals_slot_tokens_append_and_the_delivery_masks(batch):
    rng = np.random.default_rng(batch)
    row, max_tokens = 9, 40
    stores = [_store_case(np.random.default_rng(batch), batch, row, max_tokens) for _ in range(2)]
    block = np.empty(batch * (row + 3), np.int32)
    ring = rng.integers(0, 999, (batch, row)).astype(np.int32)
    counts = rng.integers(0, row, batch).astype(np.int32)  # 0 for some
    acc = rng.integers(0, 50, (batch, 2)).astype(np.int32)
    block[: batch * row], block[batch * row: batch * (row + 1)], block[batch * (row + 1):] = ring.ravel(), counts, \
        acc.ravel()
    running = rng.random(batch) < 0.7
    left = np.where(rng.random(batch) < 0.3, 0, rng.integers(1, 9, batch)).astype(np.int64)
    now = 12.5
    # numpy: Delivery.deliver's masks and SlotTokens.append
    want = stores[0]
    receiving = running & (counts > 0)
    want.append(ring, counts, receiving.nonzero()[0], acc, now)
    finished = (left == 0) & running
    # C
    got = stores[1]
    recv, fin = np.zeros(batch, bool), np.ones(batch, bool)
    c = got.in_c(LIB, running=running, left=left, receiving=recv, finished=fin)
    assert c.append(block.ctypes.data, now) == np.count_nonzero(receiving)
    np.testing.assert_array_equal(recv, receiving)
    np.testing.assert_array_equal(fin, finished)
    assert c.n_finished == np.count_nonzero(finished) and c.total == counts.sum()
    for name in ("tokens", "when", "count", "_counters"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


def test_append_refuses_a_full_row_before_changing_any():
    store = SlotTokens(2, 4, 3)
    store.n[:] = [0, 5]  # slot 1 past T = 4: the numpy twin's window index would be out of range
    before = store._counters.copy(), store.tokens.copy()
    block = np.zeros(2 * 7, np.int32)
    block[8:10] = [2, 2]  # counts
    c = store.in_c(LIB, running=np.ones(2, bool), left=np.ones(2, np.int64), receiving=np.zeros(2, bool),
                   finished=np.zeros(2, bool))
    receiving = c._keep[6]
    with pytest.raises(IndexError, match="full"):
        c.append(block.ctypes.data, 1.0)
    assert not receiving.any()  # nothing written, not even the masks
    np.testing.assert_array_equal(store._counters, before[0])
    np.testing.assert_array_equal(store.tokens, before[1])
    with pytest.raises(IndexError):
        store.append(block[:8].reshape(2, 4), block[8:10], np.array([0, 1]), np.zeros((2, 2), np.int32), 1.0)


def test_structs_refuse_arrays_of_another_type():
    with pytest.raises(TypeError, match="int64"):
        host_ops.Mirror(LIB, row=3, slot_gen=np.zeros(2, np.int32), inflight=np.zeros(2, np.int64),
                        host_pos=np.zeros(2, np.int64), host_left=np.zeros(2, np.int64))
    with pytest.raises(TypeError, match="contiguous"):
        host_ops.Mirror(LIB, row=3, slot_gen=np.zeros(4, np.int64)[::2], inflight=np.zeros(2, np.int64),
                        host_pos=np.zeros(2, np.int64), host_left=np.zeros(2, np.int64))


def _serve(monkeypatch, in_c: bool) -> list:
    if not in_c:
        monkeypatch.setattr(host_ops, "library", lambda: None)
    target, draft = stub_pair(3, VOCAB, 2, 1, 256, backend="numpy")
    loop = ServeLoop(target, draft, k=3, m_rounds=2, depth=3)
    assert (loop.delivery.c_store is not None) == in_c
    loop.log = []
    rng = np.random.default_rng(5)
    states = []
    for i in range(14):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 9))).tolist()
        n = int(rng.integers(1, 40))
        eos = greedy_reference(prompt, n, VOCAB)[n // 2] if i % 3 == 0 else None
        states.append(loop.submit(Request(prompt, n, eos=eos, options={"accept_prob": 0.6, "seed": i})))
    loop.step()
    loop.cancel(states[2])
    loop.run_until_idle()
    monkeypatch.undo()
    events = [(type(e).__name__, getattr(e, "rows", None) is not None and e.rows.tolist(),
               getattr(e, "counts", None) is not None and e.counts.tolist()) for e in loop.log]
    return [(s.tokens, [n for _, n in s.deliveries], s.finish_reason, s.accepted) for s in states] + [
        events, loop.tokens_out, loop.bursts]


def test_a_loop_serves_the_same_with_the_c_path_and_without(monkeypatch):
    assert _serve(monkeypatch, True) == _serve(monkeypatch, False)


def test_no_compiler_means_numpy_and_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHBURST_CACHE", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(host_ops.shutil, "which", lambda name: None)
    host_ops.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="numpy"):
            assert host_ops.library() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert host_ops.library() is None  # memoized: warned once
    finally:
        host_ops.library.cache_clear()


def test_a_compile_error_is_reported_not_raised(monkeypatch, tmp_path):
    bad = tmp_path / "host_ops.c"
    bad.write_text("this is not C\n")
    monkeypatch.setenv("GRAPHBURST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(host_ops, "SOURCE", bad)
    with pytest.raises(subprocess.CalledProcessError):
        host_ops._build()
    host_ops.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="unavailable"):
            assert host_ops.library() is None
    finally:
        host_ops.library.cache_clear()
    assert not list((tmp_path / "cache").glob("*.so"))  # no half-built object is left to load
