"""Admission while bursts are in flight: slot generations, scatters, the loop's boundary.

On the cupy backend the bursts really are in flight when the prefill is enqueued (the
GPU runs of these tests prove the stream order); on numpy a recorded burst runs at
launch, so these tests hold the host bookkeeping: the generation masks, the mirrors and
the capacity counts.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest

from graphburst import BurstGraph, SpecDecoder, greedy_reference, stub_pair
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop

VOCAB = 5003


def _pair(backend, batch, capacity=512, accept=0.7):
    return stub_pair(batch, VOCAB, [True, False, True], [True], capacity, accept_prob=accept, backend=backend)


def _collect(out: dict, tokens) -> None:
    for b in range(len(tokens)):
        out.setdefault(b, []).extend(tokens[b].tolist())


def test_prefill_behind_bursts_in_flight_drops_the_old_sequences_tokens(backend):
    target, draft = _pair(backend, batch=3)
    dec = SpecDecoder(target, draft, k=4, m_rounds=2)
    graph = BurstGraph(dec, gapless=True)
    dec.prefill([[1, 2, 3], [7, 8], [9]], max_new_tokens=[200, 200, 200])
    got: dict = {}
    graph.replay()
    graph.replay()  # two bursts in flight
    assert dec.outstanding == 2
    dec.prefill([None, [40, 41, 42, 43], None], max_new_tokens=[None, 25, None])  # slot 1 gets a new sequence
    first = graph.drain()
    second = graph.drain()
    assert first.counts[1] == 0 and second.counts[1] == 0  # launched before the prefill: the old sequence's
    assert first.counts[0] > 0 and second.counts[0] > 0  # the other slots lose nothing
    for t in (first, second):
        _collect(got, t)
    got[1] = []
    while dec.host_left[1] > 0:
        _collect(got, graph.run())
    assert got[1] == greedy_reference([40, 41, 42, 43], 25, VOCAB)
    assert got[0][: len(got[0])] == greedy_reference([1, 2, 3], len(got[0]), VOCAB)
    assert dec.host_pos[1] == 4 + 25
    assert (dec.positions() == dec.host_pos).all()


def test_release_in_flight_drops_tokens_and_keeps_mirrors_exact(backend):
    target, draft = _pair(backend, batch=2)
    dec = SpecDecoder(target, draft, k=3, m_rounds=2)
    graph = BurstGraph(dec, gapless=True)
    dec.prefill([[5, 6], [8]], max_new_tokens=[100, 30])
    graph.replay()
    dec.release([0])  # a cancel: slot 0's tokens in the burst above belong to nobody now
    tokens = graph.drain()
    assert tokens.counts[0] == 0 and dec.host_left[0] == 0
    assert tokens.counts[1] > 0
    graph.replay()
    assert graph.drain().counts[0] == 0  # idle from here on
    assert dec.host_pos[1] == dec.positions()[1]


def test_capacity_counts_only_the_bursts_launched_for_a_sequence(backend):
    """A prompt that leaves room for exactly one burst may be admitted behind a burst in flight."""
    target, draft = _pair(backend, batch=2, capacity=64)
    dec = SpecDecoder(target, draft, k=3, m_rounds=2)
    ring = dec.bufs.ring_capacity
    graph = BurstGraph(dec, gapless=True)
    dec.prefill([[1], None], max_new_tokens=[2, None])
    graph.replay()
    prompt = list(range(1, 64 - ring + 1))  # prompt + one ring fills the cache
    dec.prefill([None, prompt], max_new_tokens=[None, 10 * ring])
    graph.replay()  # would be refused if the burst in flight counted against slot 1
    graph.drain()
    with pytest.raises(ValueError, match="KV capacity"):
        graph.replay()  # the second burst for slot 1 would pass the capacity
    graph.drain()


def test_the_launch_bound_stays_a_lower_bound_when_admission_does_not_recount_it():
    """Admission recounts the launch bound only for a budget that overruns the cache (the
    decoder allows it: a prompt plus one burst must fit). Over random admissions, releases and
    bursts with gapless graphs, the bound never exceeds the exact count, and a launch is refused
    exactly when the exact count is below one."""
    from graphburst.engine.admission.checks import CapacityError

    rng = np.random.default_rng(7)
    target, draft = _pair("numpy", batch=3, capacity=64)
    dec = SpecDecoder(target, draft, k=3, m_rounds=2)
    graph = BurstGraph(dec, gapless=True, depth=3)
    ring, refused, launched = dec.bufs.ring_capacity, 0, 0

    def exact() -> int:
        return int(dec.ledger.bursts_that_fit().min(initial=np.iinfo(np.int64).max))

    for _ in range(400):
        op = rng.choice(4, p=[0.15, 0.05, 0.45, 0.35])  # admit, release, launch, drain
        if op == 0 and not dec.outstanding:
            b = int(rng.integers(3))
            n = int(rng.integers(1, 64 - ring + 1))
            whole = rng.integers(2) == 0  # a budget that fits whole, or one that overruns the cache
            limit = int(rng.integers(1, 64 - n + 1)) if whole else int(rng.integers(64 - n + 1, 200))
            dec.prefill([[5] * n if i == b else None for i in range(3)],
                        max_new_tokens=[limit if i == b else None for i in range(3)])
        elif op == 1:
            dec.release([int(rng.integers(3))])
        elif op == 2 and dec.outstanding < graph.n_graphs:
            if exact() < 1:
                with pytest.raises(CapacityError):
                    graph.replay()
                refused += 1
            else:
                graph.replay()
                launched += 1
        elif op == 3 and dec.outstanding:
            graph.drain()
        assert dec.ledger.launchable <= exact()
    assert refused and launched  # both sides were exercised


def recording_loop(*a, **kw) -> ServeLoop:
    """A loop that records how many bursts were in flight at each boundary that admitted a request
    (its boundary's ``take_waiting``, wrapped on this loop only)."""
    loop = ServeLoop(*a, **kw)
    seen = loop.in_flight_at_admission = []
    pipeline = loop.pipeline
    take = weakref.WeakMethod(loop.boundary.take_waiting)  # held strongly, it would tie the loop in a cycle

    def recording_take():
        seen.append(len(pipeline))
        take()()

    loop.boundary.take_waiting = recording_take
    return loop


def test_loop_refills_slots_without_draining_the_pipeline(backend, rng):
    target, draft = _pair(backend, batch=4, capacity=256)
    loop = recording_loop(target, draft, k=4, m_rounds=2, pipelined=True)
    reqs = []
    for _ in range(24):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 9))).tolist()
        reqs.append(Request(prompt, int(rng.integers(1, 30)), options=dict(accept_prob=0.8, seed=3)))
    states = [loop.submit(r) for r in reqs]
    loop.run_until_idle()
    for s in states:
        assert s.tokens == greedy_reference(s.request.prompt, s.request.max_new_tokens, VOCAB)
    assert max(loop.in_flight_at_admission) >= 1  # refills happened behind bursts in flight
    assert loop.stats()["errors"] == 0


@pytest.mark.parametrize("depth", [3, 4])
def test_a_deeper_pipeline_admits_behind_more_bursts_with_the_same_tokens(backend, rng, depth):
    target, draft = _pair(backend, batch=4, capacity=256)
    # late: the step refills the pipeline before it admits, whatever the GPU's timings (auto admits
    # early once bursts measure long, as they do on a GPU shared with other processes)
    loop = recording_loop(target, draft, k=4, m_rounds=2, pipelined=True, depth=depth, admission="late")
    assert loop.pipeline.depth == depth and loop.graph.n_graphs == depth
    reqs = [Request(rng.integers(0, VOCAB, int(rng.integers(1, 9))).tolist(), int(rng.integers(1, 60)),
                    options=dict(accept_prob=0.8, seed=3)) for _ in range(24)]
    states = [loop.submit(r) for r in reqs]
    loop.run_until_idle()
    for s in states:
        assert s.tokens == greedy_reference(s.request.prompt, s.request.max_new_tokens, VOCAB)
    assert max(loop.in_flight_at_admission) == depth  # refills queued behind every burst the graph can hold
    assert loop.stats()["errors"] == 0


def test_prefill_behind_three_bursts_in_flight(backend):
    target, draft = _pair(backend, batch=2)
    dec = SpecDecoder(target, draft, k=3, m_rounds=2)
    graph = BurstGraph(dec, gapless=True, depth=3)
    dec.prefill([[1, 2], [3]], max_new_tokens=[300, 300])
    for _ in range(3):
        graph.replay()
    with pytest.raises(RuntimeError, match="not drained"):
        graph.replay()  # a fourth would overwrite the first's pinned output block
    dec.prefill([None, [50, 51]], max_new_tokens=[None, 20])
    drained = [graph.drain() for _ in range(3)]
    assert all(t.counts[1] == 0 for t in drained) and all(t.counts[0] > 0 for t in drained)
    got = []
    while dec.host_left[1] > 0:
        got += graph.run()[1].tolist()
    assert got == greedy_reference([50, 51], 20, VOCAB)


@pytest.mark.parametrize("kw, err, match", [
    (dict(gapless=True, depth=1), ValueError, "depth must be >= 2"),
    (dict(gapless=True, depth=9), ValueError, "depth must be <= 8"),
    (dict(gapless=True, depth="3"), TypeError, "depth must be an int"),
    (dict(gapless=False, depth=3), ValueError, "needs gapless=True"),
])
def test_graph_depth_is_checked_at_construction(kw, err, match):
    target, draft = _pair("numpy", batch=1)
    with pytest.raises(err, match=match):
        BurstGraph(SpecDecoder(target, draft, k=2, m_rounds=1), **kw)


@pytest.mark.parametrize("depth, err", [(1, ValueError), (9, ValueError), (2.5, TypeError), (True, TypeError)])
def test_loop_depth_is_checked_before_anything_is_built(depth, err):
    target, draft = _pair("numpy", batch=1)
    with pytest.raises(err, match="depth"):
        ServeLoop(target, draft, k=2, m_rounds=1, depth=depth)


@pytest.mark.parametrize("in_c", [True, False], ids=["c", "numpy"])
def test_the_drained_mirror_equals_the_hosts_own_advance(backend, rng, in_c, monkeypatch):
    """The graph hands finish_burst (or its C twin, finish_block) the device's pos_ctr and budget;
    they must be what the host computes from the tokens (stops on EOS mid-burst, budgets, refills
    and cancels in flight)."""
    from graphburst.engine import host_ops

    if not in_c:
        monkeypatch.setattr(host_ops, "library", lambda: None)
    assert host_ops.library() is not None or not in_c, "no C compiler: the C host path is untested"
    target, draft = _pair(backend, batch=4, capacity=256)
    loop = ServeLoop(target, draft, k=4, m_rounds=2, depth=3)
    dec, seen = loop.dec, []
    assert (dec.host_mirror is not None) == in_c

    def checked(real):
        def finish(*args, **kw):
            pos, left = dec.host_pos.copy(), dec.host_left.copy()
            tokens = real(*args, **kw)
            tokens = args[0] if tokens is None else tokens  # finish_burst(tokens, mirror) returns None
            got = dec.host_pos.copy(), dec.host_left.copy()
            dec.host_pos[:], dec.host_left[:] = pos, left
            dec._advance_mirror(tokens)  # dropped rows count 0 there, so they keep their values
            assert (dec.host_pos == got[0]).all() and (dec.host_left == got[1]).all(), (got, dec.host_left)
            seen.append(tokens.total)
            return tokens if in_c else None
        return finish

    if in_c:
        dec.finish_block = checked(dec.finish_block)
    else:
        real = dec.finish_burst

        def finish_burst(tokens, mirror=None):
            assert mirror is not None  # the graph path reads them from the output block
            return checked(real)(tokens, mirror)
        dec.finish_burst = finish_burst
    states = []
    for i in range(20):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 9))).tolist()
        n = int(rng.integers(5, 40))
        eos = greedy_reference(prompt, n, VOCAB)[n // 2] if i % 2 else None  # a stop mid-way
        states.append(loop.submit(Request(prompt, n, eos=eos, options=dict(accept_prob=0.8, seed=3))))
    loop.step()
    loop.cancel(states[1])
    loop.run_until_idle()
    stopped = [s for s in states[2:] if s.request.eos is not None]
    assert any(len(s.tokens) < s.request.max_new_tokens for s in stopped)  # EOS ended some early
    for s in states[2:]:
        ref = greedy_reference(s.request.prompt, s.request.max_new_tokens, VOCAB)
        if s.request.eos is not None:
            ref = ref[: ref.index(s.request.eos) + 1]
        assert s.tokens == ref
    assert len(seen) == loop.bursts and sum(seen) > 0


def test_cancel_and_refill_in_flight(backend):
    target, draft = _pair(backend, batch=1, capacity=256)
    loop = ServeLoop(target, draft, k=3, m_rounds=2, pipelined=True)
    a = loop.submit(Request([4, 4], 150))
    b = loop.submit(Request([9], 12))
    loop.step()
    got = len(a.tokens)
    loop.cancel(a)
    loop.run_until_idle()
    assert len(a.tokens) == got  # nothing after the cancel
    assert b.tokens == greedy_reference([9], 12, VOCAB)


def test_prefill_chunk_is_checked_at_construction(backend):
    target, draft = _pair(backend, batch=1)
    with pytest.raises(ValueError, match="prefill_chunk"):
        ServeLoop(target, draft, k=2, m_rounds=1, prefill_chunk=0)
    draft.chunked_prefill = False  # a model that cannot continue a cached prompt
    with pytest.raises(ValueError, match="the draft .* cannot"):
        ServeLoop(target, draft, k=2, m_rounds=1, prefill_chunk=5)
    assert ServeLoop(target, draft, k=2, m_rounds=1).prefill_chunk is None


# ---------------------------------------------------------------------- chunked prefill in the loop


def chunk_logging_loop(*a, **kw) -> ServeLoop:
    """A loop that records, per prefill call, the prompt tokens prefilled and the bursts drained so
    far (its boundary's ``prefill_group``, wrapped on this loop only)."""
    loop = ServeLoop(*a, **kw)
    prefilled = loop.prefilled = []  # (bursts drained before it, tokens prefilled, final?) per prefill call
    record = loop.record  # the loop's counters (bursts)
    group_call = weakref.WeakMethod(loop.boundary.prefill_group)  # held strongly, it would tie the loop in a cycle

    def logged(group, final):
        prefilled.append((record.bursts, sum(e - s for _, _, s, e in group), final))
        group_call()(group, final)

    loop.boundary.prefill_group = logged
    return loop


def _requests(rng, n, long_every=3):
    reqs = []
    for i in range(n):
        size = int(rng.integers(60, 200)) if i % long_every == 0 else int(rng.integers(1, 9))
        prompt = rng.integers(0, VOCAB, size).tolist()
        reqs.append(Request(prompt, int(rng.integers(1, 25)), options=dict(accept_prob=0.8, seed=5)))
    return reqs


@pytest.mark.parametrize("chunk", [1, 7, 19, 257])
def test_chunked_loop_gives_the_tokens_of_whole_prefills(backend, rng, chunk):
    target, draft = _pair(backend, batch=3, capacity=512)
    loop = chunk_logging_loop(target, draft, k=3, m_rounds=2, prefill_chunk=chunk)
    states = [loop.submit(r) for r in _requests(rng, 10)]
    loop.run_until_idle()
    for s in states:
        assert s.error is None and s.tokens == greedy_reference(s.request.prompt, s.request.max_new_tokens, VOCAB)
    assert max(n for _, n, _ in loop.prefilled) <= chunk  # never more than a chunk per boundary
    if chunk < 60:
        assert any(not final for _, _, final in loop.prefilled)  # long prompts did go in pieces


def test_decoding_streams_keep_going_while_a_long_prompt_prefills(backend):
    target, draft = _pair(backend, batch=2, capacity=512)
    loop = chunk_logging_loop(target, draft, k=3, m_rounds=1, prefill_chunk=16)
    short = loop.submit(Request([3, 1, 4], 200, options=dict(accept_prob=0.5, seed=1)))
    loop.step()
    loop.step()
    long_prompt = list(range(10, 330))  # 320 tokens: 20 chunks
    long = loop.submit(Request(long_prompt, 5))
    before = len(short.tokens)
    while not long.tokens:
        loop.step()
    chunks = [(bursts, n) for bursts, n, _ in loop.prefilled if n and bursts > 0]
    assert len(chunks) >= 20
    # between the long prompt's first and last chunk, bursts kept running for the short stream
    assert chunks[-1][0] - chunks[0][0] >= len(chunks) - 1
    assert len(short.tokens) - before >= len(chunks) - 1
    loop.run_until_idle()
    assert long.tokens == greedy_reference(long_prompt, 5, VOCAB)
    assert short.tokens == greedy_reference([3, 1, 4], 200, VOCAB)


def test_cancel_during_chunked_prefill_frees_the_slot(backend):
    target, draft = _pair(backend, batch=1, capacity=512)
    loop = ServeLoop(target, draft, k=3, m_rounds=1, prefill_chunk=8)
    long = loop.submit(Request(list(range(1, 200)), 5))
    nxt = loop.submit(Request([7, 7], 9))
    loop.step()
    loop.step()
    assert loop.table.prefilling  # still prefilling
    loop.cancel(long)
    loop.run_until_idle()
    assert long.done and long.tokens == []
    assert nxt.tokens == greedy_reference([7, 7], 9, VOCAB)


def test_chunked_loop_with_a_torch_pair_matches_whole_prefills(backend):
    pytest.importorskip("torch")
    from graphburst.models.checkpoint import tiny_random_pair

    rng = np.random.default_rng(7)
    reqs = [(rng.integers(0, 512, n).tolist(), 6) for n in (40, 3, 23, 1)]
    out = {}
    for chunk in (None, 9):
        target, draft = tiny_random_pair(batch=2, capacity=128, backend=backend, vocab=512)
        loop = ServeLoop(target, draft, k=3, m_rounds=2, prefill_chunk=chunk)
        states = [loop.submit(Request(p, n)) for p, n in reqs]
        loop.run_until_idle()
        out[chunk] = [s.tokens for s in states]
        assert all(s.error is None for s in states)
    assert out[9] == out[None]
    assert out[None][0] == target.module.greedy(reqs[0][0], 6)


def test_sampled_tokens_do_not_depend_on_chunking_or_refills(backend, rng):
    """Sampling draws are keyed by (seed, position): chunked prefill and in-flight refills change nothing."""
    reqs = [(rng.integers(0, 64, int(n)).tolist(), int(m), float(t), int(seed))
            for n, m, t, seed in zip(rng.integers(1, 40, 9), rng.integers(3, 20, 9), [0.0, 0.7, 1.3] * 3,
                                     rng.integers(0, 2**32, 9))]
    out = {}
    for batch, chunk in ((9, None), (2, None), (2, 5)):
        target, draft = stub_pair(batch, 64, [True, False], [True, True], 128, accept_prob=0.7, p_min=0.1, seed=3,
                                  backend=backend)
        loop = ServeLoop(target, draft, k=3, m_rounds=2, sampling=True, prefill_chunk=chunk)
        states = [loop.submit(Request(p, m, temperature=t, seed=s)) for p, m, t, s in reqs]
        loop.run_until_idle()
        out[batch, chunk] = [st.tokens for st in states]
    assert out[2, None] == out[9, None]  # refilled slots behind bursts in flight: the same draws
    assert out[2, 5] == out[9, None]


def test_serve_config_wires_the_chunk_and_refuses_it_with_tp():
    from graphburst.serving.factory import ConfigError, ServeConfig, build_loop

    loop = build_loop(ServeConfig(backend="numpy", batch=2, capacity=256, prefill_chunk=8))
    assert loop.prefill_chunk == 8
    s = loop.submit(Request(list(range(1, 40)), 6))
    loop.run_until_idle()
    assert s.tokens == greedy_reference(list(range(1, 40)), 6, loop.vocab)
    with pytest.raises(ConfigError, match="prefill_chunk"):
        ServeConfig(backend="numpy", prefill_chunk=8, tp=2)


def test_serve_config_wires_the_pipeline_depth_and_caps_it_with_tp():
    from graphburst.serving.factory import ConfigError, ServeConfig, build_loop

    loop = build_loop(ServeConfig(backend="numpy", batch=2, capacity=256, pipeline_depth=3))
    assert loop.pipeline.depth == 3
    assert build_loop(ServeConfig(backend="numpy", batch=2, capacity=256, pipelined=False)).pipeline.depth == 1
    with pytest.raises(ConfigError, match="pipeline_depth.*at most 2"):
        ServeConfig(backend="numpy", pipeline_depth=3, tp=2)
    with pytest.raises(ConfigError, match="pipeline_depth"):
        ServeConfig(backend="numpy", pipeline_depth=9)


def test_admit_slots_hand_case():
    from graphburst.constants import NO_EOS, UNBOUNDED_BUDGET
    from graphburst.kernels import reference

    budget = np.array([3, 4, 5, 6], np.int32)
    eos = np.array([9, 9, 9, 9], np.int32)
    acc = np.arange(8, dtype=np.int32).reshape(4, 2) + 1
    # slots 2 and 0 admitted; -1 and 4 lie outside the batch and are skipped
    table = np.array([[2, 0, -1, 4], [7, UNBOUNDED_BUDGET, 1, 1], [NO_EOS, 11, 1, 1]], np.int32)
    reference.admit_slots(table, budget, eos, acc)
    assert budget.tolist() == [UNBOUNDED_BUDGET, 4, 7, 6]
    assert eos.tolist() == [11, 9, NO_EOS, 9]
    assert acc.tolist() == [[0, 0], [3, 4], [0, 0], [7, 8]]


def _device_state(dec) -> dict:
    be, bufs = dec.backend, dec.bufs
    out = {n: be.to_host(getattr(bufs, n), dec.stream) for n in ("budget", "eos", "acc", "pos_ctr", "pend")}
    out |= {f"cache{i}": be.to_host(layer.storage, dec.stream) for i, layer in enumerate(dec.target.cache.layers)
            if layer is not None}
    return out | {"host_pos": dec.host_pos.copy(), "host_left": dec.host_left.copy(), "host_eos": dec.host_eos.copy(),
                  "gen": dec.slot_gen.copy()}


def test_prefill_checked_writes_what_prefill_writes(backend):
    from graphburst.constants import NO_EOS, UNBOUNDED_BUDGET

    decs = []
    for _ in range(2):
        target, draft = _pair(backend, batch=5)
        dec = SpecDecoder(target, draft, k=3, m_rounds=2)
        dec.prefill([[1, 2], [3], [4, 5, 6], [7], [8, 9]], max_new_tokens=[50] * 5)
        dec.run_burst()  # accept counters and positions move: admission must reset them
        decs.append(dec)
    checked, plain = decs
    # slots 1 and 3 get new prompts (3 in two chunks), the others are left alone
    plain.prefill([None, None, None, [20, 21, 22], None], final=False)
    checked.prefill_checked({3: np.array([20, 21, 22], np.int32)}, {3: 0}, final=False)
    plain.prefill([None, [30, 31], None, [23], None], start=[None, 0, None, 3, None], max_new_tokens=[None, 9, None,
                  None, None], eos=[None, None, None, 4, None])
    checked.prefill_checked({1: np.array([30, 31], np.int32), 3: np.array([23], np.int32)}, {1: 0, 3: 3},
                            limits={1: 9}, stops={3: 4})
    want, got = _device_state(plain), _device_state(checked)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert got["host_left"][3] == UNBOUNDED_BUDGET and got["host_eos"][1] == NO_EOS
    np.testing.assert_array_equal(checked.run_burst().counts, plain.run_burst().counts)


@pytest.mark.parametrize("lengths", [[4], [3, 3, 3], [1, 7, 2], [19, 1, 257, 5]])
@pytest.mark.parametrize("final", [True, False])
@pytest.mark.parametrize("with_options", [True, False])
def test_staging_block_matches_a_slot_by_slot_build(backend, lengths, final, with_options):
    """The staging block against a build written out position by position, and the device
    copy of it after the one upload (on cupy: the runtime copy from pageable memory)."""
    from graphburst.engine.admission.slots import STAGE_HEAD
    from graphburst.constants import NO_EOS, NO_PREFILL

    batch = 8
    target, draft = _pair(backend, batch=batch)
    dec = SpecDecoder(target, draft, k=2, m_rounds=1)
    head = dec.admission.staging.head
    assert head == STAGE_HEAD + 2  # the stub draft's two option columns (seed, agree24)
    rng = np.random.default_rng(len(lengths))
    slots = sorted(rng.choice(batch, len(lengths), replace=False).tolist())
    rows = {b: rng.integers(0, VOCAB, n).astype(np.int32) for b, n in zip(slots, lengths)}
    starts = {b: int(rng.integers(0, 9)) for b in slots}
    limits = {b: int(rng.integers(1, 99)) for b in slots}
    stops = {b: int(rng.integers(0, VOCAB)) for b in slots}
    options = {b: (int(rng.integers(-2**31, 2**31)), int(rng.integers(0, 2**24))) for b in slots}
    host, _ = dec.admission.stage(slots, np.asarray(slots, np.int64), [rows[b] for b in slots],
                                  [len(rows[b]) for b in slots], [starts[b] for b in slots],
                                  [limits[b] for b in slots] if final else None,
                                  [stops[b] for b in slots] if final else None,
                                  [[options[b][c] for b in slots] for c in range(2)] if with_options else None)
    p_max = max(lengths)
    want = np.zeros(head * batch + batch * p_max, np.int32)
    want[:batch] = NO_PREFILL
    for i, b in enumerate(slots):
        want[b], want[batch + b] = len(rows[b]), starts[b]
        want[head * batch + b * p_max: head * batch + b * p_max + len(rows[b])] = rows[b]
        col = (b, limits[b], stops[b]) if final else (b, 0, NO_EOS)
        col += options[b] if with_options else ()
        for r in range(len(col)):
            want[2 * batch + r * len(slots) + i] = col[r]
    np.testing.assert_array_equal(host, want)
    host[:] = -7  # the upload is stream-ordered from a staged copy: the host block may be reused at once
    np.testing.assert_array_equal(dec.backend.to_host(dec.admission.staging.block[: want.size], dec.stream), want)


def test_an_int32_start_with_no_limit_still_recounts_the_launch_bound():
    """prefill_checked of a numpy int32 start (as ``positions()`` gives it) and an unbounded budget:
    end + UNBOUNDED_BUDGET would wrap in int32, so the recount test must not add them; the burst that
    would pass the cache is refused, not run."""
    from graphburst.engine.admission.checks import CapacityError

    target, draft = stub_pair(2, 512, 2, 1, 64, seed=0, backend="numpy")
    dec = SpecDecoder(target, draft, k=2, m_rounds=2)
    dec.prefill_checked({0: np.arange(4, dtype=np.int32)}, {0: 0}, limits={0: 3})  # fits whole: no bound
    dec.run_burst()
    dec.prefill_checked({1: np.arange(8, dtype=np.int32)}, {1: 0}, final=False)
    start = dec.positions()[1]
    assert isinstance(start, np.int32)
    dec.prefill_checked({1: np.arange(8, dtype=np.int32)}, {1: start})  # no limit: unbounded
    with pytest.raises(CapacityError):
        for _ in range(40):
            dec.run_burst()
    assert dec.host_pos[1] <= dec.capacity


def test_a_group_keeps_admission_order_in_the_loop_events():
    """A final group of a prompt carried over in chunks (slot 1) and one admitted after it (slot 0):
    the decoder gets them in slot order, the loop's first-token event lists them as admitted."""
    target, draft = stub_pair(2, 512, 2, 1, 256, seed=0, backend="numpy")
    loop = ServeLoop(target, draft, k=1, m_rounds=1, prefill_chunk=6, admission="late")
    loop.log = []
    loop.submit(Request([1, 2], 1, id="a"))  # slot 0, done after its first token
    loop.submit(Request(list(range(3, 12)), 4, id="b"))  # slot 1: chunks of 4, then 5
    seen = []
    for i in range(8):
        if i == 1:
            loop.submit(Request([7], 2, id="c"))  # takes slot 0 once "a" is gone
        loop.step()
        seen += [([s.request.id for s in e.states], e.rows.tolist()) for e in loop.log if type(e).__name__ == "Tokens"]
        loop.log.clear()
    assert (["b", "c"], [1, 0]) in seen
