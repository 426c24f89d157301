"""Admission as one captured graph per prompt width (graphburst/engine/admission/graphs.py) against
the eager admission it replaces: the same device state after any sequence of admissions."""

from __future__ import annotations

import numpy as np
import pytest

from graphburst import BurstGraph, SpecDecoder, stub_pair
from graphburst.engine.admission.graphs import MIN_WIDTH, width_bucket, widths_up_to
from graphburst.models.ngram import NgramDraft
from graphburst.models.stubs import StubTarget
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop

VOCAB = 997


@pytest.mark.parametrize("p_max, capacity, want", [(1, 4096, MIN_WIDTH), (16, 4096, 16), (17, 4096, 32),
                                                   (257, 4096, 512), (90, 100, 100), (7, 8, 8)])
def test_width_bucket(p_max, capacity, want):
    assert width_bucket(p_max, capacity) == want


@pytest.mark.parametrize("p_max, capacity, want", [(1, 4096, [16]), (16, 4096, [16]), (17, 4096, [16, 32]),
                                                   (100, 100, [16, 32, 64, 100]), (5, 8, [8]), (300, 256, [16, 32, 64,
                                                                                                            128, 256])])
def test_widths_up_to(p_max, capacity, want):
    assert widths_up_to(p_max, capacity) == want
    assert all(width_bucket(p, capacity) in want for p in range(1, p_max + 1))


def _models(backend, kind, batch, capacity):
    if kind == "stubs":
        return stub_pair(batch, VOCAB, [True, False, True], [True], capacity, accept_prob=0.6, backend=backend)
    return StubTarget(batch, VOCAB, 2, capacity, backend=backend), NgramDraft(batch, VOCAB, capacity, n_min=1, n_max=3,
                                                                               backend=backend)


def _state(dec) -> dict:
    be = dec.backend
    bufs = dec.bufs
    out = {n: be.to_host(getattr(bufs, n), dec.stream) for n in ("budget", "eos", "acc", "pos_ctr", "pend")}
    for role in ("target", "draft"):
        for i, layer in enumerate(getattr(dec, role).cache.layers):
            if layer is not None:
                out[f"{role}{i}"] = be.to_host(layer.storage, dec.stream)
                out[f"{role}{i}.len"] = be.to_host(layer.length, dec.stream)
    for i, col in enumerate(dec.option_columns.columns if dec.option_columns else ()):
        out[f"option{i}"] = be.to_host(col, dec.stream)
    return out | {"host_pos": dec.host_pos.copy(), "host_left": dec.host_left.copy(),
                  "host_eos": dec.host_eos.copy(), "gen": dec.slot_gen.copy()}


def _script(rng, batch, capacity):
    """A random sequence of admissions (fresh and continued chunks, options or not) and bursts."""
    steps, pos = [], {}
    for _ in range(6):
        if rng.random() < 0.3:
            steps.append(("burst",))
            continue
        slots = sorted(rng.choice(batch, int(rng.integers(1, batch + 1)), replace=False).tolist())
        final = bool(rng.random() < 0.7)
        continued = bool(rng.random() < 0.4)
        rows, starts = {}, {}
        for b in slots:
            start = pos.get(b, 0) if continued else 0
            n = int(rng.choice([1, 7, 19, 40]))
            if start + n + 64 > capacity:
                start = 0
            rows[b], starts[b] = rng.integers(0, VOCAB, n).astype(np.int32), start
            pos[b] = 0 if final else start + n
        opts = {b: {"seed": int(rng.integers(0, 2**32))} if rng.random() < 0.5 else {} for b in slots} \
            if rng.random() < 0.6 else None
        limits = {b: int(rng.integers(1, 30)) for b in slots if rng.random() < 0.5}
        steps.append(("admit", rows, starts, final, opts, limits))
    return steps + [("burst",)]


def _run(dec, steps) -> list:
    counts = []
    for step in steps:
        if step[0] == "burst":
            if dec.host_left.any():
                counts.append(dec.run_burst().counts.tolist())
            continue
        _, rows, starts, final, opts, limits = step
        options = None
        if opts is not None:
            options = {b: dec.slot_options({k: v for k, v in o.items() if k in _keys(dec)}) for b, o in opts.items()}
        dec.prefill_checked(rows, starts, final=final, limits=limits if final else None, options=options)
    return counts


def _keys(dec) -> set:
    return set(dec.draft.option_keys)


@pytest.mark.parametrize("kind", ["stubs", "ngram"])
@pytest.mark.parametrize("batch", [1, 7, 19])
def test_graph_admission_writes_what_the_eager_one_writes(backend, rng, kind, batch):
    capacity = 256
    steps = _script(rng, batch, capacity)
    decs = []
    for graphs in (True, False):
        target, draft = _models(backend, kind, batch, capacity)
        decs.append(SpecDecoder(target, draft, k=3, m_rounds=2, admission_graphs=graphs))
    graph, eager = decs
    assert graph.admission_graphs is not None and eager.admission_graphs is None
    assert _run(graph, steps) == _run(eager, steps)
    want, got = _state(eager), _state(graph)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    admissions = sum(step[0] == "admit" for step in steps)
    assert graph.admission_graphs.launches == admissions
    assert graph.admission_graphs.captures <= admissions


def test_one_graph_per_key_and_a_refresh_drops_them(backend):
    target, draft = _models(backend, "stubs", 4, 256)
    dec = SpecDecoder(target, draft, k=2, m_rounds=1)
    graphs = dec.admission_graphs
    dec.prefill_checked({0: np.arange(3, dtype=np.int32)}, {0: 0})
    dec.prefill_checked({1: np.arange(16, dtype=np.int32), 2: np.arange(5, dtype=np.int32)}, {1: 0, 2: 0})
    assert graphs.captures == 1  # both within the narrowest width, no options: one graph
    dec.prefill_checked({3: np.arange(17, dtype=np.int32)}, {3: 0})
    assert graphs.captures == 2  # width 32
    dec.refresh_tables()  # rebinds the decoder's table (a recapture's first step): every graph dropped
    dec.prefill_checked({0: np.arange(3, dtype=np.int32)}, {0: 0})
    assert graphs.captures == 3 and graphs.launches == 4


@pytest.mark.parametrize("graphs", [True, False])
def test_the_phases_are_looked_up_on_the_admission(backend, graphs):
    """A profiler times admission's phases by wrapping them on the instance: every admission,
    through the decoder's entry points, goes through the wrapped methods (a graph admission
    launches one graph instead of the models' prefill and admit_slots)."""
    target, draft = _models(backend, "stubs", 3, 64)
    dec = SpecDecoder(target, draft, k=2, m_rounds=1, admission_graphs=graphs)
    adm, called = dec.admission, []
    for phase in ("prefill_slots", "stage", "admit_in_graph", "prefill_models", "admit", "record"):
        def timed(*a, _real=getattr(adm, phase), _phase=phase, **kw):
            called.append(_phase)
            return _real(*a, **kw)
        setattr(adm, phase, timed)
    dec.prefill([[1, 2, 3], None, [4]])
    dec.prefill_checked({1: np.arange(5, dtype=np.int32)}, {1: 0})
    dec.prefill_slots([2], [np.arange(2, dtype=np.int32)], [0], options=[None])
    device = ["admit_in_graph"] if graphs else ["prefill_models", "admit"]
    assert called == 3 * (["prefill_slots", "stage"] + device + ["record"])


def test_decoders_that_stay_eager(backend):
    target, draft = _models(backend, "stubs", 2, 64)
    assert SpecDecoder(target, draft, k=2, m_rounds=1, sampling=True).admission_graphs is None  # first-token sampling

    class Plain(StubTarget):
        prefill_in_graph = False  # a model that sizes its prefill on the host

    assert SpecDecoder(Plain(2, VOCAB, 1, 64, backend=backend), draft, k=2, m_rounds=1).admission_graphs is None


def test_graph_admission_behind_bursts_in_flight(backend):
    """Admissions (and a first-use capture) while gapless bursts are queued: the same tokens as
    the eager decoder running the same schedule."""
    outs = []
    for graphs in (True, False):
        target, draft = _models(backend, "stubs", 5, 512)
        dec = SpecDecoder(target, draft, k=3, m_rounds=2, admission_graphs=graphs)
        dec.prefill([[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11]], max_new_tokens=[40] * 5)
        graph = BurstGraph(dec, gapless=True, depth=3)
        got = []
        graph.replay()
        graph.replay()
        dec.prefill_checked({1: np.arange(30, dtype=np.int32), 3: np.arange(2, dtype=np.int32)}, {1: 0, 3: 0},
                            limits={1: 20, 3: 25}, options={1: dec.slot_options({"seed": 7}), 3: None})
        graph.replay()
        for _ in range(3):
            got.append([row.tolist() for row in graph.drain()])
        outs.append(got)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("graphs", [True, False])
def test_a_decoder_is_freed_by_reference_counting(backend, graphs):
    """No reference cycle through the admission graphs: a dead decoder's graphs and capture stream
    are freed at once, never by the cyclic collector, which may run during another capture (where
    destroying a graph or a stream invalidates that capture)."""
    import gc
    import weakref

    target, draft = _models(backend, "stubs", 3, 64)
    gc.disable()
    try:
        dec = SpecDecoder(target, draft, k=2, m_rounds=1, admission_graphs=graphs)
        dec.prefill_checked({0: np.arange(3, dtype=np.int32)}, {0: 0}, options={0: None})
        dec.run_burst()
        alive = weakref.ref(dec)
        del dec
        assert alive() is None
    finally:
        gc.enable()


def test_a_capture_that_fails_falls_back_to_eager_admission(backend):
    """A model that declares prefill_in_graph but cannot be captured costs a warning, not requests:
    that admission and every later one run eagerly and write what an eager decoder writes."""
    from graphburst.engine.admission.graphs import AdmissionCaptureError

    decs = []
    for graphs in (True, False):
        target, draft = _models(backend, "stubs", 4, 128)
        decs.append(SpecDecoder(target, draft, k=2, m_rounds=2, admission_graphs=graphs))
    failing, eager = decs

    def cannot_capture(width, rows, final, continued):
        raise AdmissionCaptureError(f"admission graph capture failed (width {width}): planted")

    failing.admission_graphs._capture = cannot_capture
    for dec in decs:
        opts = {1: dec.slot_options({"seed": 5}), 3: None}
        if dec is failing:
            with pytest.warns(RuntimeWarning, match="planted; admitting eagerly from now on"):
                dec.prefill_checked({1: np.arange(20, dtype=np.int32), 3: np.arange(2, dtype=np.int32)}, {1: 0, 3: 0},
                                    limits={1: 12}, options=opts)
        else:
            dec.prefill_checked({1: np.arange(20, dtype=np.int32), 3: np.arange(2, dtype=np.int32)}, {1: 0, 3: 0},
                                limits={1: 12}, options=opts)
        dec.prefill_checked({0: np.arange(5, dtype=np.int32)}, {0: 0})
    assert failing.admission_graphs is None
    assert failing.run_burst().counts.tolist() == eager.run_burst().counts.tolist()
    want, got = _state(eager), _state(failing)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_the_collector_pause_is_counted_across_threads():
    """Two captures overlapping in two threads: the collector stays off until the last ends, and
    comes back only if it ran before."""
    import gc
    import threading

    from graphburst.engine.collector import CollectorPause

    pause = CollectorPause()
    assert gc.isenabled()
    first_in, second_done = threading.Event(), threading.Event()

    def second():
        first_in.wait()
        with pause:
            assert not gc.isenabled()
        second_done.set()

    worker = threading.Thread(target=second)
    worker.start()
    try:
        with pause:
            first_in.set()
            second_done.wait(5)
            assert not gc.isenabled()  # the other capture ended; this one still runs
        assert gc.isenabled()
        gc.disable()
        with pause:
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
        worker.join(5)


def test_a_packing_model_stays_eager(backend):
    target, draft = _models(backend, "stubs", 2, 64)

    class Packing(StubTarget):
        packed_prefill = True  # its prefill takes the lengths from the host

    assert SpecDecoder(Packing(2, VOCAB, 1, 64, backend=backend), draft, k=2, m_rounds=1).admission_graphs is None


@pytest.mark.parametrize("chunk", [None, 24])
def test_a_serving_loop_captures_its_admission_graphs_at_start(backend, rng, chunk):
    """Every graph a request can take is captured when the loop is built, none while it serves
    prompts of every width bucket (in chunks or whole), and the warmed graphs, launched for the
    first time mid-serving, give each request the tokens an eager admission gives it."""
    capacity, sizes = 100, (1, 7, 16, 17, 19, 33, 64, 65, 99)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in sizes]
    got = []
    for graphs in (True, False):
        target, draft = _models(backend, "stubs", 4, capacity)
        loop = ServeLoop(target, draft, k=3, m_rounds=2, depth=2, prefill_chunk=chunk)
        held = loop.dec.admission_graphs
        widths = [16, 32, 64, 100] if chunk is None else [16, 32]  # chunks of 24 are at most 32 wide
        assert held.captures == len(widths) * (1 if chunk is None else 4) == loop.stats()["admission_graphs"]
        if not graphs:
            loop.dec.admission.graphs = None  # the eager admission, from the same staging
        states = [loop.submit(Request(p, min(12, capacity - len(p)), options={"seed": i}))
                  for i, p in enumerate(prompts)]
        loop.run_until_idle()
        assert not [s.error for s in states if s.error]
        if graphs:
            assert held.captures == len(widths) * (1 if chunk is None else 4), "captured while serving"
            assert held.launches >= 3  # nine requests through four slots: three admissions at least
        got.append([s.tokens for s in states])
    assert got[0] == got[1]


def test_warm_captures_each_key_once(backend):
    target, draft = _models(backend, "stubs", 4, 256)
    dec = SpecDecoder(target, draft, k=2, m_rounds=1)
    dec.prefill_checked({0: np.arange(20, dtype=np.int32)}, {0: 0}, options={0: None})  # first use: width 32
    assert dec.admission_graphs.captures == 1
    assert dec.warm_admission_graphs(longest=100) == 3  # widths 16, 64 and 128; 32 is held
    assert dec.warm_admission_graphs(longest=100) == 0
    assert dec.warm_admission_graphs(longest=100, chunk=20) == 6  # 16 and 32: 2 x (fresh, continued) + 2 partial
    launches = dec.admission_graphs.launches
    dec.prefill_checked({1: np.arange(70, dtype=np.int32)}, {1: 0}, options={1: None})
    assert (dec.admission_graphs.captures, dec.admission_graphs.launches) == (10, launches + 1)
    for bad in ({"longest": 0}, {"chunk": -3}, {"longest": 2.5}):
        with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
            dec.warm_admission_graphs(**bad)
    target, draft = _models(backend, "stubs", 4, 256)
    assert SpecDecoder(target, draft, k=2, m_rounds=1, admission_graphs=False).warm_admission_graphs() == 0


def test_a_warm_capture_that_fails_leaves_admission_eager(backend):
    from graphburst.engine.admission.graphs import AdmissionCaptureError

    target, draft = _models(backend, "stubs", 4, 128)
    dec = SpecDecoder(target, draft, k=2, m_rounds=1)

    def cannot_capture(width, rows, final, continued):
        raise AdmissionCaptureError(f"admission graph capture failed (width {width}): planted")

    dec.admission_graphs._capture = cannot_capture
    with pytest.warns(RuntimeWarning, match="planted; admitting eagerly from now on"):
        assert dec.warm_admission_graphs() == 0
    assert dec.admission_graphs is None
    dec.prefill_checked({0: np.arange(5, dtype=np.int32)}, {0: 0})
    assert dec.run_burst().counts.tolist()[0] > 0
