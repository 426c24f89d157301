"""Correctness suite for graph capture, on both backends (numpy records, cupy captures)."""

from __future__ import annotations

import numpy as np
import pytest
from device_memory import own_device_bytes

from graphburst import CapacityError, SpecDecoder, greedy_reference, stub_pair
from graphburst.backend import Backend
from graphburst.capture import BurstGraph, CaptureError
from graphburst.guard import StaleGraphError

VOCAB = 32003


def make(backend, batch, k, m, layers=(True, False, True), draft_layers=(True,), accept=0.7, p_min=0.05, seed=1,
         capacity=None, bursts=8):
    capacity = capacity or 40 + bursts * m * (k + 1)
    target, draft = stub_pair(batch, VOCAB, list(layers), list(draft_layers), capacity, accept_prob=accept,
                              p_min=p_min, seed=seed, backend=backend)
    return SpecDecoder(target, draft, k=k, m_rounds=m)


def prompts_for(batch, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(1, 30))).tolist() for _ in range(batch)]


def layout(n, seed=3):
    lay = [bool(x) for x in np.random.default_rng(seed).random(n) < 0.75]
    lay[0] = True
    return lay


EQUIV_CONFIGS = [
    # batch, k, m, target layers, accept
    (1, 1, 1, 3, 0.0),
    (3, 4, 3, 5, 0.5),
    (19, 7, 8, 7, 1.0),
    (64, 8, 32, 128, 0.7),
    (7, 2, 16, 128, 0.95),
]


@pytest.mark.parametrize("batch, k, m, n_layers, accept", EQUIV_CONFIGS)
def test_replay_equals_eager_and_reference(backend, batch, k, m, n_layers, accept):
    """graph replay == eager pre-issued == eager per-round sync == numpy == greedy."""
    gpu = backend.is_gpu
    # The numpy backend runs every kernel on the host: the largest config (64 x 32 rounds x 128
    # layers) replays 2 bursts there, not 4; the second burst still starts from the first's
    # rolled-back state, which is what the later bursts add.
    bursts = 4 if gpu or m * n_layers < 1024 else 2
    lay = layout(n_layers)
    prompts = prompts_for(batch, seed=n_layers)
    decs = {
        "graph": make(backend, batch, k, m, lay, (True, False), accept, bursts=bursts),
        "pre_issued": make(backend, batch, k, m, lay, (True, False), accept, bursts=bursts),
        "per_round_sync": make(backend, batch, k, m, lay, (True, False), accept, bursts=bursts),
        "graph_separate": make(backend, batch, k, m, lay, (True, False), accept, bursts=bursts),
    }
    if gpu:  # on the numpy backend "graph" is this one already
        decs["numpy_graph"] = make(Backend("numpy"), batch, k, m, lay, (True, False), accept, bursts=bursts)
    decs["graph_separate"].fused = False
    decs["graph_separate"].assemble = True  # the draft's own vtok writes and assemble_verify must agree
    decs["per_round_sync"].fused = False
    for d in decs.values():
        d.prefill(prompts)
    graphs = {name: BurstGraph(decs[name]) for name in ("graph", "graph_separate", "numpy_graph") if name in decs}
    out = {name: [[] for _ in range(batch)] for name in decs}
    for _ in range(bursts):
        runs = {
            **{name: g.run() for name, g in graphs.items()},
            "pre_issued": decs["pre_issued"].run_burst(mode="pre_issued"),
            "per_round_sync": decs["per_round_sync"].run_burst(mode="per_round_sync"),
        }
        for name, toks in runs.items():
            for b, t in enumerate(toks):
                out[name][b] += t.tolist()
    for b in range(batch):
        ref = greedy_reference(prompts[b], len(out["graph"][b]), VOCAB)
        for name in decs:
            assert out[name][b] == ref, f"{name} sequence {b}"
    acc = {name: d.accept_counters() for name, d in decs.items()}
    np.testing.assert_array_equal(graphs["graph"].last_acc, acc["graph"])
    for name in decs:
        np.testing.assert_array_equal(acc[name], acc["graph"], err_msg=name)
    assert decs["graph"].host_syncs == bursts  # exactly one per burst
    assert decs["per_round_sync"].host_syncs == bursts * (m + 1)


def test_gapless_enqueues_ahead_and_matches(backend):
    dec = make(backend, 5, 4, 4, bursts=10)
    prompts = prompts_for(5)
    dec.prefill(prompts)
    g = BurstGraph(dec, gapless=True)
    out = [[] for _ in prompts]
    g.replay()
    for _ in range(9):
        g.replay()  # burst n+1 is enqueued before burst n is read
        for b, t in enumerate(g.drain()):
            out[b] += t.tolist()
    with pytest.raises(RuntimeError, match="not drained"):
        g.replay()
        g.replay()
    while g._pending:
        for b, t in enumerate(g.drain()):
            out[b] += t.tolist()
    for b in range(5):
        assert out[b] == greedy_reference(prompts[b], len(out[b]), VOCAB)


def test_two_graphs_on_two_streams_stay_independent(backend):
    d1 = make(backend, 3, 4, 3, layers=(True, True), seed=1)
    d2 = make(backend, 9, 2, 5, layers=(False, True, True, False), seed=2, accept=0.3)
    p1, p2 = prompts_for(3, 1), prompts_for(9, 2)
    d1.prefill(p1)
    d2.prefill(p2)
    g1, g2 = BurstGraph(d1), BurstGraph(d2, gapless=True)
    o1, o2 = [[] for _ in p1], [[] for _ in p2]
    for _ in range(6):
        g1.replay()
        g2.replay()
        for b, t in enumerate(g2.drain()):
            o2[b] += t.tolist()
        for b, t in enumerate(g1.drain()):
            o1[b] += t.tolist()
    for prompts, out in ((p1, o1), (p2, o2)):
        for b, p in enumerate(prompts):
            assert out[b] == greedy_reference(p, len(out[b]), VOCAB)


def test_address_guard_fires_on_rebind_and_recapture_works(backend):
    dec = make(backend, 2, 3, 2)
    prompts = prompts_for(2)
    dec.prefill(prompts)
    g = BurstGraph(dec)
    out = [t.tolist() for t in g.run()]
    dec.bufs.out_block = backend.zeros(dec.bufs.out_block.shape, np.int32)  # moves ring and acc
    with pytest.raises(StaleGraphError, match=r"StreamBufs\.out_block"):
        g.replay()
    with pytest.raises(AttributeError, match="ring"):
        dec.bufs.ring = backend.zeros(dec.bufs.ring.shape, np.int32)  # a view of out_block, not rebindable
    g.recapture()
    for b, t in enumerate(g.run()):
        out[b] += t.tolist()
    # Swap one target layer for a copy at a new address: guard fires, recapture follows it.
    layer = dec.target.cache.layers[0]
    layer.length = layer.length.copy()
    with pytest.raises(StaleGraphError, match=r"KVLayer\.length"):
        g.replay()
    g.recapture()
    for _ in range(2):
        for b, t in enumerate(g.run()):
            out[b] += t.tolist()
    for b in range(2):
        assert out[b] == greedy_reference(prompts[b], len(out[b]), VOCAB)
    g.guard.verify()


def test_a_rebound_rollback_table_makes_the_graph_stale_and_the_rest_is_fixed(backend):
    """The decoder tells its guards when its rollback table is rebound (refresh_tables does it);
    the models, buffers and stream it baked cannot be rebound at all."""
    from graphburst.buffers import kv_len_ptr_table

    dec = make(backend, 2, 2, 2)
    prompts = prompts_for(2)
    dec.prefill(prompts)
    g = BurstGraph(dec)
    out = [t.tolist() for t in g.run()]
    with dec.stream:
        dec.table = kv_len_ptr_table([dec.target.cache, dec.draft.cache], pos_ctr=dec.bufs.pos_ctr)
    with pytest.raises(StaleGraphError, match=r"SpecDecoder\.table"):
        g.replay()
    for name in ("bufs", "stream", "target", "draft"):
        with pytest.raises(AttributeError):
            setattr(dec, name, getattr(dec, name))
    g.capture()
    for b, t in enumerate(g.run()):
        out[b] += t.tolist()
    for b in range(2):
        assert out[b] == greedy_reference(prompts[b], len(out[b]), VOCAB)


def test_guard_verify_sees_in_place_moves_of_unwatched_holders(backend):
    dec = make(backend, 2, 2, 2)
    dec.prefill(prompts_for(2))
    g = BurstGraph(dec)
    # A plain dict is not Watched: only the full verify() can see this move.
    object.__setattr__(dec.bufs, "pend", backend.zeros((2,), np.int32))
    g.guard.check()
    with pytest.raises(StaleGraphError, match="bufs.pend moved"):
        g.guard.verify()


def test_capacity_is_checked_before_replay(backend):
    dec = make(backend, 1, 4, 4, capacity=60)
    dec.prefill([[1] * 10])
    g = BurstGraph(dec)
    with pytest.raises(CapacityError, match="slot 0"):
        for _ in range(10):
            g.run()
    # Nothing was lost: the caches still hold exactly what was drained.
    assert int(dec.positions()[0]) == dec.host_pos[0]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("assemble", [True, False])
def test_introspection_counts(backend, fused, assemble):
    dec = make(backend, 2, 4, 3)
    dec.fused, dec.assemble = fused, assemble
    dec.prefill(prompts_for(2))
    g = BurstGraph(dec, gapless=True)
    info = g.info()
    if fused:  # k drafts, [assemble], verify, epilogue; plus one head seed per burst
        assert info["nodes_per_round"] == 4 + assemble + 2
        assert info["nodes_total"] == 1 + 3 * info["nodes_per_round"] + 1  # + one copy of ring and counters
    else:  # seed, k drafts, [assemble], verify, accept, commit, rollback
        assert info["nodes_per_round"] == 1 + 4 + assemble + 4
        assert info["nodes_total"] == 3 * info["nodes_per_round"] + 1
    assert info["host_syncs_per_burst"] == 1
    assert info["buffer_bytes"] >= dec.bufs.nbytes
    if backend.is_gpu:
        assert info["graph_nodes_confirmed"] == info["nodes_total"]


def test_bad_arguments(backend):
    dec = make(backend, 1, 1, 1)
    with pytest.raises(ValueError, match="capture_mode"):
        BurstGraph(dec, capture_mode="relaxed")
    with pytest.raises(TypeError, match="SpecDecoder"):
        BurstGraph(object())
    g = BurstGraph(dec)
    with pytest.raises(RuntimeError, match="no burst to drain"):
        g.drain()


# ------------------------------------------------------------------------------ GPU-only


class _AllocatingTarget:
    """A target whose verify allocates: strict capture must reject it."""

    def __init__(self, inner, action):
        self.inner, self.cache, self.vocab, self.action = inner, inner.cache, inner.vocab, action

    def prefill(self, *a):
        self.inner.prefill(*a)

    def verify(self, bufs, stream):
        self.inner.verify(bufs, stream)
        self.action(bufs)


@pytest.mark.parametrize("mode", ["global", "thread_local"])
@pytest.mark.parametrize("what", ["allocate", "host_sync"])
@pytest.mark.gpu
def test_failed_capture_leaves_stream_usable(mode, what):
    import cupy

    be = Backend("cupy")
    good = make(be, 2, 3, 2)
    prompts = prompts_for(2)
    good.prefill(prompts)
    calls = {"n": 0}

    def action(bufs):
        calls["n"] += 1
        if what == "allocate":
            cupy.empty(1 << 28 + calls["n"], np.uint8)  # a new size: forces pool growth
        else:
            bufs.n_acc.get()

    bad = SpecDecoder(_AllocatingTarget(good.target, action), good.draft, k=3, m_rounds=2, stream=good.stream)
    with pytest.raises(CaptureError, match="verify"):
        BurstGraph(bad, capture_mode=mode)
    assert cupy.cuda.runtime.streamIsCapturing(good.stream.ptr) == 0
    # The same stream still runs eager work and a fresh capture, and no token was lost.
    out = [t.tolist() for t in good.run_burst()]
    g = BurstGraph(good, capture_mode=mode)
    for b, t in enumerate(g.run()):
        out[b] += t.tolist()
    for b in range(2):
        assert out[b] == greedy_reference(prompts[b], len(out[b]), VOCAB)


@pytest.mark.gpu
def test_long_run_10000_bursts_no_memory_growth():
    be = Backend("cupy")
    bursts, k, m = 10_000, 2, 2
    dec = make(be, 2, k, m, layers=(True, False, True), capacity=40 + bursts * m * (k + 1))
    prompts = prompts_for(2, seed=7)
    dec.prefill(prompts)
    g = BurstGraph(dec, gapless=True)
    out = [t.tolist() for t in g.run()]  # the first replay may settle lazily created driver state
    dec.stream.synchronize()
    # this process's own allocators, not the device's free memory, which other processes change
    before = own_device_bytes()
    g.replay()
    for _ in range(bursts - 2):
        g.replay()
        for b, t in enumerate(g.drain()):
            out[b] += t.tolist()
    for b, t in enumerate(g.drain()):
        out[b] += t.tolist()
    dec.stream.synchronize()
    after = own_device_bytes()
    assert all(after[key] <= before[key] for key in before), (before, after)
    assert dec.bursts == bursts
    for b in range(2):
        assert out[b] == greedy_reference(prompts[b], len(out[b]), VOCAB)
