"""Device-exit burst graphs on the GPU: the conditional WHILE node built under a CuPy capture.

The probe's findings are printed first (``-s`` shows them); then the condition kernel against
its twin, the graph against the numpy device-exit burst (tokens, rounds, state), a stop
requested from the host while a long burst runs, and many bursts with slot churn.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from device_exit_cases import CASES, assert_same_state, build, check_held_stops, prefill, state
from marks import gpu

from graphburst import SpecDecoder, stub_pair
from graphburst.backend import Backend
from graphburst.capture import BurstGraph
from graphburst.constants import EXIT_WORDS
from graphburst.kernels.digest import greedy_reference

pytestmark = gpu

M_MAX = 8
VOCAB = 32003


def drained(tokens):
    return [t.tolist() for t in tokens]


@pytest.fixture(scope="module")
def cupy_backend():
    return Backend("cupy")


def test_probe_reports_what_it_found(cupy_backend):
    """Diagnostic: what the probe found (versions, the trial WHILE graph), and that it passed."""
    from graphburst.engine import conditional

    try:
        found = conditional.versions()
    except conditional.ConditionalUnavailable as exc:
        found = str(exc)
    ok, why = conditional.probe(cupy_backend.device_id)
    print(f"\nconditional WHILE probe: ok={ok}; {why}; versions {found}")
    assert ok, why


def test_round_exit_kernel_matches_its_twin(cupy_backend):
    """The condition kernel (launched eagerly, no handle) equals round_exit_ref, bit for bit."""
    from graphburst.engine.round_exit import StopFlag
    from graphburst.kernels import round_exit_cuda, round_exit_ref

    rng = np.random.default_rng(7)
    stream = cupy_backend.new_stream()
    flag = StopFlag(cupy_backend)
    for case in range(300):
        batch = int(rng.choice([1, 3, 255, 256, 257, 1000, 70_000]))
        budget = np.where(rng.random(batch) < 0.95, 0, rng.integers(-3, 50, batch)).astype(np.int32)
        if case % 3 == 0:
            budget[:] = 0
        state0 = rng.integers(0, 10, EXIT_WORDS).astype(np.int32)
        count = int(state0[2]) if rng.random() < 0.6 else int(rng.integers(0, 10))
        m_max, begin = int(rng.integers(1, 12)), bool(rng.random() < 0.3)
        flag.word[0] = count
        want = state0.copy()
        round_exit_ref.round_exit(budget, want, np.array([count], np.int32), m_max=m_max, begin=begin)
        with cupy_backend.device():
            dev_budget = cupy_backend.to_device(budget, stream)
            dev_state = cupy_backend.to_device(state0, stream)
            round_exit_cuda.round_exit(dev_budget, dev_state, flag.device_address, m_max=m_max, begin=begin,
                                       stream=stream)
        got = cupy_backend.to_host(dev_state, stream)
        np.testing.assert_array_equal(got, want, err_msg=f"case {case}: batch {batch}, m_max {m_max}, begin {begin}")


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("gapless", [False, True])
def test_device_exit_graph_equals_the_numpy_device_exit_burst(cupy_backend, name, gapless):
    """Tokens, rounds, why each burst ended and the state it left equal the numpy backend's
    device-exit burst (itself held to chained one-round bursts), over four bursts."""
    case = CASES[name]
    dev = build(cupy_backend, case, M_MAX)
    ref = build("numpy", case, M_MAX)
    graph = BurstGraph(dev, device_exit=True, gapless=gapless)
    assert graph.device_exit and graph.info()["device_exit"]
    ref_graph = BurstGraph(ref, device_exit=True)
    for n in range(4):
        got, want = graph.run(), ref_graph.run()
        assert drained(got) == drained(want), f"{name} burst {n}"
        assert (graph.last_rounds, graph.last_exit_reason) == (ref_graph.last_rounds, ref_graph.last_exit_reason)
        assert got.rounds == graph.last_rounds
        assert_same_state(state(dev), state(ref), f"{name} burst {n}")
        np.testing.assert_array_equal(dev.host_pos, ref.host_pos)
        np.testing.assert_array_equal(dev.host_left, ref.host_left)
        np.testing.assert_array_equal(graph.last_acc, ref_graph.last_acc)
    # eager device-exit bursts on the GPU run the same kernel: same tokens and rounds
    eager, eager_ref = build(cupy_backend, case, M_MAX), build("numpy", case, M_MAX)
    for mode in ("pre_issued", "per_round_sync"):
        assert drained(eager.run_burst(mode=mode, device_exit=True)) == drained(
            eager_ref.run_burst(mode=mode, device_exit=True)), mode
        assert eager.last_rounds == eager_ref.last_rounds, mode


def test_graph_info_counts_the_while_node(cupy_backend):
    dec = build(cupy_backend, CASES["ragged_budgets"], M_MAX)
    graph = BurstGraph(dec, device_exit=True)
    info = graph.info()
    # head seed + first condition, the WHILE node, two copies to the host
    assert info["nodes_total"] == 5 and info["graph_nodes_confirmed"] == 5, info
    assert info["nodes_per_round"] == dec.k + 3  # k drafts, verify, epilogue, the condition


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_a_stop_before_launch_gives_a_zero_round_burst_on_the_gpu(cupy_backend, mode):
    case = CASES["ragged_budgets"]
    dec = build(cupy_backend, case, M_MAX)
    graph = BurstGraph(dec, device_exit=True, capture_mode=mode)
    before = state(dec)
    graph.request_stop()
    assert graph.run().total == 0 and graph.last_rounds == 0 and graph.last_exit_reason == "flag"
    assert_same_state(state(dec), before, "zero-round burst")
    graph.run()
    assert graph.last_rounds > 0 and graph.last_exit_reason != "flag"


def test_a_stop_set_from_the_host_while_a_long_burst_runs_ends_it_early(cupy_backend):
    """A 64-round burst of slow stubs (~200 µs a model call, ~50 ms a burst) is stopped a third of
    the way in: it ends after r rounds with 0 < r < 64, its tokens are the greedy ones, and the next
    burst carries on from its state."""
    batch, k, m_max = 2, 3, 64
    target, draft = stub_pair(batch, VOCAB, [True, True], [True], 8192, accept_prob=0.7, seed=2,
                              cost_ns=200_000, backend=cupy_backend)
    dec = SpecDecoder(target, draft, k=k, m_rounds=m_max)
    prompts = [[1, 2, 3], [9, 8]]
    dec.prefill(prompts)
    graph = BurstGraph(dec, device_exit=True)
    out = [[] for _ in prompts]
    t0 = time.perf_counter()
    for b, t in enumerate(graph.run()):  # a whole burst first: how long 64 rounds take
        out[b] += t.tolist()
    whole = time.perf_counter() - t0
    assert graph.last_rounds == m_max
    t0 = time.perf_counter()
    graph.replay()  # returns at once: the burst runs on the GPU while the host sleeps
    time.sleep(whole / 3)
    graph.request_stop()
    tokens = graph.drain()
    elapsed = time.perf_counter() - t0
    r = graph.last_rounds
    print(f"\nstopped after {r} of {m_max} rounds, {elapsed * 1e3:.1f} ms (a whole burst: {whole * 1e3:.1f} ms)")
    assert 0 < r < m_max and graph.last_exit_reason == "flag"
    assert int(dec.accept_counters()[:, 1].max()) == m_max + r  # rounds that committed, since admission
    for b, t in enumerate(tokens):
        out[b] += t.tolist()
    for b, t in enumerate(graph.run()):
        out[b] += t.tolist()
    assert graph.last_rounds == m_max
    for b, p in enumerate(prompts):
        assert out[b] == greedy_reference(p, len(out[b]), VOCAB), b
    np.testing.assert_array_equal(dec.host_pos, dec.positions())


def test_a_thousand_bursts_with_slot_churn_stay_exact(cupy_backend):
    """1000 device-exit bursts; a slot that finishes gets a new prompt and budget at once; every
    finished sequence is the greedy reference, and the first 150 bursts match the numpy twin."""
    case = {"batch": 6, "k": 3, "budgets": [7, 19, 3, 30, 1, 12], "seed": 4}
    dec = build(cupy_backend, case, M_MAX)
    ref = build("numpy", case, M_MAX)
    graph, ref_graph = BurstGraph(dec, device_exit=True), BurstGraph(ref, device_exit=True)
    rng = np.random.default_rng(0)
    prompts = prefill(dec, case)
    prefill(ref, case)
    out = [[] for _ in prompts]
    rounds = []
    finished = 0
    for n in range(1000):
        tokens = graph.run()
        rounds.append(graph.last_rounds)
        if n < 150:
            assert drained(tokens) == drained(ref_graph.run()), f"burst {n}"
            assert graph.last_rounds == ref_graph.last_rounds, f"burst {n}"
        for b, t in enumerate(tokens):
            out[b] += t.tolist()
        done = [b for b in range(case["batch"]) if dec.host_left[b] == 0]
        for b in done:
            assert out[b] == greedy_reference(prompts[b], len(out[b]), VOCAB), f"slot {b} at burst {n}"
            finished += 1
        if done:
            shift = int(rng.integers(1, 1 << 20))
            new = prefill(dec, case, slots=set(done), seed_shift=shift)
            if n < 150:
                prefill(ref, case, slots=set(done), seed_shift=shift)
            for b in done:
                prompts[b], out[b] = new[b], []
    print(f"\n{finished} sequences finished; rounds per burst: mean {np.mean(rounds):.2f}, "
          f"min {min(rounds)}, max {max(rounds)}")
    assert max(rounds) <= M_MAX and min(rounds) < M_MAX  # the short budgets end bursts early


def test_held_stops_end_every_queued_burst_until_answered_on_the_gpu(cupy_backend):
    check_held_stops(cupy_backend, M_MAX)


class _SyncingTarget:
    """A target whose verify allocates or syncs on its n-th call: the WHILE body's capture must fail."""

    def __init__(self, inner, action):
        self.inner, self.cache, self.vocab, self.action = inner, inner.cache, inner.vocab, action

    def prefill(self, *a):
        self.inner.prefill(*a)

    def verify(self, bufs, stream):
        self.inner.verify(bufs, stream)
        self.action(bufs)


@pytest.mark.parametrize("mode", ["global", "thread_local"])
@pytest.mark.parametrize("what", ["allocate", "host_sync"])
def test_a_failed_body_capture_names_the_node_and_leaves_both_streams_usable(cupy_backend, mode, what):
    import cupy

    from graphburst.capture import CaptureError

    case = CASES["ragged_budgets"]
    good = build(cupy_backend, case, M_MAX)
    calls = {"n": 0}

    def action(bufs):
        calls["n"] += 1
        if what == "allocate":
            cupy.empty(1 << 28 + calls["n"], np.uint8)  # a new size: forces pool growth
        else:
            bufs.n_acc.get()

    bad = SpecDecoder(_SyncingTarget(good.target, action), good.draft, k=good.k, m_rounds=M_MAX, stream=good.stream)
    with pytest.raises(CaptureError, match="verify"):
        BurstGraph(bad, device_exit=True, capture_mode=mode)
    assert cupy.cuda.runtime.streamIsCapturing(good.stream.ptr) == 0
    ref = build("numpy", case, M_MAX)
    graph, ref_graph = BurstGraph(good, device_exit=True, capture_mode=mode), BurstGraph(ref, device_exit=True)
    assert cupy.cuda.runtime.streamIsCapturing(graph._body_stream.ptr) == 0
    for _ in range(2):
        assert drained(graph.run()) == drained(ref_graph.run())
        assert graph.last_rounds == ref_graph.last_rounds


def test_a_device_exit_graph_recaptures_after_a_rebind(cupy_backend):
    from graphburst.guard import StaleGraphError

    case = CASES["eos_mid_round"]
    dec, ref = build(cupy_backend, case, M_MAX), build("numpy", case, M_MAX)
    graph, ref_graph = BurstGraph(dec, device_exit=True), BurstGraph(ref, device_exit=True)
    assert drained(graph.run()) == drained(ref_graph.run())
    layer = dec.target.cache.layers[0]
    layer.length = layer.length.copy()
    with pytest.raises(StaleGraphError, match=r"KVLayer\.length"):
        graph.replay()
    graph.recapture()
    for _ in range(3):
        assert drained(graph.run()) == drained(ref_graph.run())
        assert graph.last_rounds == ref_graph.last_rounds


def test_five_thousand_device_exit_bursts_do_not_grow_device_memory(cupy_backend):
    from device_memory import own_device_bytes

    bursts, k, m = 5000, 2, 2
    target, draft = stub_pair(2, VOCAB, [True, False, True], [True], 40 + bursts * m * (k + 1), accept_prob=0.7,
                              seed=1, backend=cupy_backend)
    dec = SpecDecoder(target, draft, k=k, m_rounds=m)
    prompts = [[1, 2, 3], [4, 5]]
    dec.prefill(prompts)
    graph = BurstGraph(dec, device_exit=True, gapless=True)
    out = [t.tolist() for t in graph.run()]
    dec.stream.synchronize()
    before = own_device_bytes()
    graph.replay()
    for _ in range(bursts - 2):
        graph.replay()
        for b, t in enumerate(graph.drain()):
            out[b] += t.tolist()
        assert graph.last_rounds == m
    for b, t in enumerate(graph.drain()):
        out[b] += t.tolist()
    dec.stream.synchronize()
    after = own_device_bytes()
    assert all(after[key] <= before[key] for key in before), (before, after)
    for b in range(2):
        assert out[b] == greedy_reference(prompts[b], len(out[b]), VOCAB)
