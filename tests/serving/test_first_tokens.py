"""First tokens handed out after the prefill, before the first burst is drained
(``graphburst.serving.first_tokens``). Expected tokens come from the CPU greedy oracle."""

from __future__ import annotations

import numpy as np
import pytest

from graphburst import greedy_reference, stub_pair
from graphburst.serving.events import Tokens
from graphburst.serving.slot_table import NO_COPY
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop

VOCAB = 997
SURE = {"accept_prob": 1.0}  # every draft accepted: a slot commits exactly m * (k + 1) tokens a burst


def make_loop(batch, *, backend="numpy", engine="graph", pipelined=True, cost_ns=0, m=2, k=3, depth=2):
    target, draft = stub_pair(batch, VOCAB, 2, 1, 256, backend=backend, cost_ns=cost_ns)
    return ServeLoop(target, draft, k=k, m_rounds=m, engine=engine, pipelined=pipelined, depth=depth)


@pytest.mark.parametrize("engine,pipelined", [("graph", True), ("graph", False), ("per_round_sync", False)])
def test_the_first_token_comes_alone_before_any_burst_is_drained(engine, pipelined):
    loop = make_loop(3, engine=engine, pipelined=pipelined)
    loop.log = []
    states = [loop.submit(Request([4 + i, 1], 20, options=SURE)) for i in range(3)]
    loop.step()
    eager = engine == "per_round_sync"  # its step hands the first tokens out, then runs (and syncs) a burst
    assert loop.bursts == (1 if eager else 0)
    for s in states:
        ref = greedy_reference(s.request.prompt, 20, VOCAB)
        assert s.tokens == ref[: 8 if eager else 1]
    event = [e for e in loop.log if isinstance(e, Tokens)][0]
    assert event.ring.shape == (3, 2) and event.counts.tolist() == [1, 1, 1]
    assert [event.tokens_of(i) for i in range(3)] == [s.tokens[:1] for s in states]
    loop.run_until_idle()
    for s in states:
        assert s.tokens == greedy_reference(s.request.prompt, 20, VOCAB)
        # 1 alone, then the first burst's other m * (k + 1) - 1 = 7: the ring's leading copy is dropped
        assert [n for _, n in s.deliveries] == [1, 7, 8, 4]
        assert s.first_token == s.deliveries[0][0] < s.deliveries[1][0]
    assert loop.tokens_out == 3 * 20


def test_a_one_token_request_and_a_first_token_stop_end_on_that_token():
    loop = make_loop(2)
    ref = greedy_reference([6, 1], 10, VOCAB)
    one = loop.submit(Request([3, 3], 1))
    stop = loop.submit(Request([6, 1], 10, eos=ref[0]))  # its first token is its stop token
    loop.run_until_idle()
    assert one.tokens == greedy_reference([3, 3], 1, VOCAB) and one.finish_reason == "length"
    assert stop.tokens == ref[:1] and stop.finish_reason == "eos"
    assert [n for _, n in one.deliveries] == [n for _, n in stop.deliveries] == [1]
    assert loop.tokens_out == 2 and loop.active == 0


def test_a_slot_refilled_before_its_last_copy_is_handed_out_gets_its_own_first_token():
    loop = make_loop(1, depth=3)
    # a long first request keeps bursts in flight; a second waits for its slot
    first = loop.submit(Request([2], 60, options=SURE))
    loop.step()  # its first token
    second = loop.submit(Request([7], 30))
    third = loop.submit(Request([9, 9], 12))
    loop.cancel(first)  # the boundary frees the slot and admits the second behind 3 bursts in flight
    while loop.table.slots[0] is not second:
        loop.step()
    assert len(loop.first_tokens) == 1 and second.n_tokens == 0  # its copy is pending behind the bursts
    loop.cancel(second)  # cancelled before its copy is handed out: the third takes the slot
    while loop.table.slots[0] is not third:
        loop.step()
    assert len(loop.first_tokens) == 2  # the second's copy, for nobody now, is still pending
    loop.run_until_idle()
    assert second.tokens == [] and second.finish_reason == "cancelled"
    assert third.tokens == greedy_reference([9, 9], 12, VOCAB) and third.finish_reason == "length"
    assert first.tokens == greedy_reference([2], 60, VOCAB)[: first.n_tokens]


def test_a_prefill_in_chunks_hands_out_its_first_token_after_the_last_chunk():
    target, draft = stub_pair(2, VOCAB, 2, 1, 256, backend="numpy")
    loop = ServeLoop(target, draft, k=3, m_rounds=2, prefill_chunk=4)
    prompt = list(range(3, 13))  # 10 tokens: chunks of 4, 4, 2 over three boundaries
    other = loop.submit(Request([5], 40))
    long = loop.submit(Request(prompt, 9))
    seen = []
    while not loop.idle:
        loop.step()
        seen.append(long.n_tokens)
    assert long.tokens == greedy_reference(prompt, 9, VOCAB) and other.tokens == greedy_reference([5], 40, VOCAB)
    assert 1 in seen  # its first token stood alone for a step
    assert [n for _, n in long.deliveries][0] == 1


@pytest.mark.gpu
def test_gpu_first_token_is_handed_out_while_its_first_burst_still_runs():
    from graphburst.backend import Backend

    # 2 ms per model call: a burst of m=4 rounds runs for well over 10 ms after the prefill
    loop = make_loop(2, backend=Backend("cupy"), cost_ns=2_000_000, m=4)
    loop.log = []
    warm = loop.submit(Request([1], 3))
    loop.run_until_idle()  # compiles and captures
    assert warm.tokens == greedy_reference([1], 3, VOCAB)
    states = [loop.submit(Request([4 + i, 1], 40)) for i in range(2)]
    loop.step()
    assert [s.n_tokens for s in states] == [1, 1]
    graph = loop.pipeline.graph
    oldest = graph._pending[0]
    assert not graph._events[oldest].done  # the burst that commits it has not finished
    loop.run_until_idle()
    for s in states:
        assert s.tokens == greedy_reference(s.request.prompt, 40, VOCAB)
        assert s.deliveries[0][1] == 1
    np.testing.assert_array_equal(loop.table.lead, False)


def _bursts_between_a_finish_and_the_next_first_token(admission, decisions=None, **kw):
    """Drained bursts from the one that finishes A to B's first token, B admitted into A's slot while
    a long request in the other slot keeps the pipeline launching. ``decisions``: a list that gets
    each ``admit_early()`` the schedule answers before B has a slot (its last is B's admission's)."""
    loop = make_loop(2, **kw)
    loop.schedule.mode = admission
    b = None
    if decisions is not None:
        admit_early = loop.schedule.admit_early

        def recording():
            early = admit_early()
            if b is not None and b.slot is None:
                decisions.append(early)
            return early

        loop.schedule.admit_early = recording
    loop.submit(Request([1], 3))
    loop.run_until_idle()  # compiles and captures, so the admission timed below is a plain one
    loop.schedule.forget_admissions()  # nor does auto count the compiles as an admission's host time
    a = loop.submit(Request([2], 5, options=SURE))  # one burst: 1 + 7 > 5
    long = loop.submit(Request([4], 60, options=SURE))
    b = loop.submit(Request([3], 9, options=SURE))
    a_done = b_first = None
    while not loop.idle:
        loop.step()
        if a.done and a_done is None:
            a_done = loop.bursts
        if b.n_tokens and b_first is None:
            b_first = loop.bursts
    assert a.tokens == greedy_reference([2], 5, VOCAB) and b.tokens == greedy_reference([3], 9, VOCAB)
    assert long.tokens == greedy_reference([4], 60, VOCAB)
    return b_first - a_done


def test_early_admission_gives_a_freed_slot_its_next_request_one_burst_sooner():
    # late: B is prefilled behind the burst launched after A's drain, and its copy behind that one too
    assert _bursts_between_a_finish_and_the_next_first_token("late") == 2
    assert _bursts_between_a_finish_and_the_next_first_token("early") == 1
    assert _bursts_between_a_finish_and_the_next_first_token("auto") == 2  # no GPU timing: late


@pytest.mark.parametrize("admission", ["early", "late"])
def test_either_admission_order_serves_a_refill_workload_greedily(admission):
    loop = make_loop(3, depth=3)
    loop.schedule.mode = admission
    loop.log = []
    states = [loop.submit(Request([5 + i, 2], n)) for i, n in enumerate((25, 7, 13, 4, 18, 1, 30, 9))]
    seen = {id(s): [] for s in states}
    while not loop.idle:
        loop.step()
        for e in loop.log:
            if isinstance(e, Tokens):
                for i, s in enumerate(e.states):
                    seen[id(s)] += e.tokens_of(i)
        loop.log.clear()
    for s in states:
        assert seen[id(s)] == s.tokens == greedy_reference(s.request.prompt, s.request.max_new_tokens, VOCAB)
        assert s.deliveries[0][1] == 1 and s.finish_reason == "length"


def test_admission_is_validated_by_the_loop_and_the_config():
    from graphburst.serving.factory import ConfigError, ServeConfig

    target, draft = stub_pair(2, VOCAB, 2, 1, 64, backend="numpy")
    with pytest.raises(ValueError, match="admission must be one of auto, early, late, got 'soon'"):
        ServeLoop(target, draft, k=3, m_rounds=2, admission="soon")
    with pytest.raises(ConfigError, match="admission"):
        ServeConfig(admission="soon")
    with pytest.raises(ConfigError, match="tensor-parallel"):
        ServeConfig(admission="early", tp=2)
    with pytest.raises(ConfigError, match="pipelined graph engine"):
        ServeConfig(admission="early", pipelined=False)
    with pytest.raises(ConfigError, match="pipelined graph engine"):
        ServeConfig(admission="late", engine="per_round_sync")
    assert ServeConfig(admission="late").admission == "late"


@pytest.mark.gpu
def test_gpu_auto_admission_turns_early_when_bursts_outlast_admissions():
    """auto follows the GPU's events: 16 ms bursts always outlast an admission; a zero-cost stub's
    (~0.02 ms) does not on a GPU of its own, but may on a GPU shared with other processes (a burst's
    events can then span another process's time slice), so that case is held to what the schedule
    measured when it admitted B."""
    from graphburst.backend import Backend

    # 2 ms per model call: a burst takes 16 ms, an admission of stubs well under one
    decisions = []
    assert _bursts_between_a_finish_and_the_next_first_token("auto", decisions, backend=Backend("cupy"),
                                                            cost_ns=2_000_000) == 1
    assert decisions and decisions[-1]
    # zero-cost stubs: a burst shorter than the host's admission refills the queue first
    decisions = []
    waited = _bursts_between_a_finish_and_the_next_first_token("auto", decisions, backend=Backend("cupy"))
    assert decisions and waited == (1 if decisions[-1] else 2), decisions


def test_auto_admission_is_early_only_when_the_queued_bursts_outlast_typical_admissions():
    from graphburst.serving.admit import ADMISSION_WINDOW, EARLY_ADMISSION_MARGIN

    loop = make_loop(2)  # depth 2: one burst still queued when an early step admits
    assert not loop.schedule.admit_early()  # nothing measured (and no GPU timing here)
    loop.pipeline.burst_ms = 35.0  # a 1b burst
    assert not loop.schedule.admit_early()  # no admission measured yet
    for ms in (2.0, 1.5, 20.0):  # small admissions, and one of a burst of prompts
        loop.schedule.note_admission(ms)
    assert loop.schedule.admit_early()  # the median (2 ms), not the big one, is typical
    for ms in (0.3, 0.1, 0.3, 0.4, 0.1, 0.2):  # zero-cost stubs' admissions
        loop.schedule.note_admission(ms)
    loop.pipeline.burst_ms = 0.11
    assert not loop.schedule.admit_early()
    loop.schedule.forget_admissions()
    loop.schedule.note_admission(0.1)  # a one-slot admission alone: the margin still says late
    assert not loop.schedule.admit_early()
    loop.pipeline.burst_ms = 0.1 * EARLY_ADMISSION_MARGIN  # exactly at the margin: late
    assert not loop.schedule.admit_early()
    for _ in range(ADMISSION_WINDOW):  # the window forgets older admissions
        loop.schedule.note_admission(100.0)
    assert list(loop.schedule.admission_ms) == [100.0] * ADMISSION_WINDOW
    assert loop.schedule.typical_admission_ms == 100.0
    loop.schedule.mode = "early"
    assert loop.schedule.admit_early()
    loop.schedule.mode = "late"
    loop.pipeline.burst_ms = 1e9
    assert not loop.schedule.admit_early()


def test_a_host_bound_loop_hands_first_tokens_out_with_their_first_burst():
    """While bursts are shorter than a typical admission (the host bounds the loop), a final
    prefill makes no first-token copy: the first burst carries the token, and the tokens are the
    oracle's either way. Otherwise the copy is made and the token comes alone first."""
    for host_bound in (True, False):
        loop = make_loop(2)
        for ms in (0.3, 0.3, 0.3):
            loop.schedule.note_admission(ms)
        loop.pipeline.burst_ms = 0.1 if host_bound else 35.0  # numpy: no GPU timing of its own
        assert loop.schedule.host_bound() is host_bound and loop.schedule.copy_first_tokens() is not host_bound
        states = [loop.submit(Request([4 + i, 1], 20, options=SURE)) for i in range(2)]
        loop.boundary.run()
        assert len(loop.first_tokens) == (0 if host_bound else 1)
        assert (loop.table.first_copy[:2] == NO_COPY).all() == host_bound
        while not loop.idle:
            loop.pipeline.burst_ms = 0.1 if host_bound else 35.0
            loop.step()
        for s in states:
            assert s.tokens == greedy_reference(s.request.prompt, 20, VOCAB)
            # with a copy: 1 alone, then the first burst's other 7; without: the first burst's 8
            assert [n for _, n in s.deliveries] == ([8, 8, 4] if host_bound else [1, 7, 8, 4])
        np.testing.assert_array_equal(loop.table.lead, False)


def test_a_first_token_event_carries_zero_counters_not_the_slots_last_requests():
    loop = make_loop(1, depth=3)
    loop.log = []
    first = loop.submit(Request([2], 100, options=SURE))
    for _ in range(4):
        loop.step()
    second = loop.submit(Request([7], 30))
    loop.cancel(first)  # bursts in flight still carry its counters into the slot's row
    while second.n_tokens == 0:
        loop.step()
    assert first.accepted > 0
    (event,) = [e for e in loop.log if isinstance(e, Tokens) and any(s is second for s in e.states)]
    assert event.ring.shape[1] == 2 and event.acc.tolist() == [[0, 0]]
    loop.run_until_idle()
    assert second.tokens == greedy_reference([7], 30, VOCAB) and second.rounds > 0


def test_the_eager_engine_runs_its_burst_in_the_step_that_hands_out_first_tokens():
    loop = make_loop(2, engine="per_round_sync", pipelined=False)
    long = loop.submit(Request([3], 60))
    loop.step()
    got = long.n_tokens
    for i in range(20):  # a client submits and cancels a request every step
        loop.cancel(loop.submit(Request([5 + i], 10)))
        loop.step()
    assert long.n_tokens >= got + 20  # each step still ran a burst for it
    loop.run_until_idle()
    assert long.tokens == greedy_reference([3], 60, VOCAB)


def test_burst_tokens_drop_first_moves_the_rest_of_each_named_row_up_one():
    from graphburst.burst_tokens import BurstTokens

    ring = np.array([[2, 5, 6, 0], [1, 9, 0, 0], [3, 1, 2, 3]], np.int32)  # column 0: the count
    tokens = BurstTokens(ring.copy())
    tokens.drop_first(np.array([0, 2]))
    assert tokens.counts.tolist() == [1, 1, 2]
    assert [tokens[b].tolist() for b in range(3)] == [[6], [9], [2, 3]]
    assert tokens.data[:, 0].tolist() == [1, 1, 2] and tokens.total == 4
