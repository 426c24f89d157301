"""Auto admission coalesces consecutive boundaries while the host is the bottleneck
(``AdmissionSchedule.defer_boundary``). Expected tokens come from the CPU greedy oracle.

On numpy there is no GPU timing, so the CPU tests set the last burst's device time by hand;
the GPU test lets zero-cost and costly stubs set it.
"""

from __future__ import annotations

import pytest

from graphburst import greedy_reference, stub_pair
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop

VOCAB = 997
SURE = {"accept_prob": 1.0}  # every draft accepted: a slot commits exactly m * (k + 1) tokens a burst
# Budgets that finish slots on consecutive bursts (m=2, k=3: 8 tokens a burst), so boundaries fall
# one burst apart, the case coalescing is for.
BUDGETS = (9, 17, 25, 8, 16, 24, 10, 18, 26, 7, 15, 23)


def make_loop(*, backend="numpy", cost_ns=0, batch=3, depth=3):
    target, draft = stub_pair(batch, VOCAB, 2, 1, 256, backend=backend, cost_ns=cost_ns)
    return ServeLoop(target, draft, k=3, m_rounds=2, depth=depth)


def _serve(loop, busy_ms=None):
    """Serve BUDGETS; returns, per request after the first wave, the bursts drained between the
    finish that freed its slot and its first token."""
    loop.submit(Request([1], 3))
    loop.run_until_idle()  # compiles and captures (on a GPU), so the admissions timed are plain ones
    loop.schedule.forget_admissions()
    states = [loop.submit(Request([5 + i, 2], n, options=SURE)) for i, n in enumerate(BUDGETS)]
    freed_at, waits, first_seen = {}, [], set()
    while not loop.idle:
        if busy_ms is not None:
            loop.pipeline.burst_ms = busy_ms  # numpy: no GPU timing of its own
        held = {s.slot: s for s in states if s.slot is not None and not s.done}
        loop.step()
        # first tokens before finishes: a host-bound loop hands a request's first token out with
        # its first burst (no early copy), and a short request may finish in that same burst
        for s in states:
            if s.n_tokens and id(s) not in first_seen:
                first_seen.add(id(s))
                if s.slot in freed_at:
                    waits.append(loop.bursts - freed_at.pop(s.slot))
        for slot, s in held.items():
            if s.done and slot not in freed_at:
                freed_at[slot] = loop.bursts
    for s in states:
        assert s.tokens == greedy_reference(s.request.prompt, s.request.max_new_tokens, VOCAB)
    return waits


def test_auto_coalesces_boundaries_when_bursts_are_shorter_than_admissions():
    late = make_loop()
    late.schedule.mode = "late"
    late_waits = _serve(late, busy_ms=1e-6)
    assert late.schedule.deferred_boundaries == 0

    auto = make_loop()
    waits = _serve(auto, busy_ms=1e-6)  # a burst far shorter than any admission: host-bound
    assert auto.schedule.deferred_boundaries > 0
    assert auto.stats()["deferred_boundaries"] == auto.schedule.deferred_boundaries
    # a freed slot waits at most depth - 1 bursts more than it would have without coalescing
    assert max(waits) <= max(late_waits) + auto.pipeline.depth - 1
    assert len(waits) == len(late_waits) == len(BUDGETS) - 3

    costly = make_loop()
    _serve(costly, busy_ms=1e9)  # bursts far longer than admissions: never
    assert costly.schedule.deferred_boundaries == 0


def test_a_boundary_is_deferred_only_within_the_limit_after_an_admission_nor_mid_prompt():
    from graphburst.serving.admit import COALESCE_AFTER

    loop = make_loop()  # depth 3: at most 2 bursts
    loop.pipeline.burst_ms = 0.1
    loop.schedule.note_admission(0.3)
    assert not loop.schedule.defer_boundary()  # no admission yet in this loop's life
    loop.schedule.admitted_at, loop.schedule.deferrals = loop.pipeline.launched, 0
    assert not loop.schedule.defer_boundary()  # one admission measured: it may have compiled kernels
    for _ in range(COALESCE_AFTER - 1):
        loop.schedule.note_admission(0.3)
    loop.table.prefilling[0] = 4  # a prompt part-way through a chunked prefill goes on at every boundary
    assert not loop.schedule.defer_boundary()
    del loop.table.prefilling[0]
    assert loop.schedule.coalesce_limit() == 2  # an admission covers 3 bursts; depth - 1 caps it
    assert loop.schedule.defer_boundary() and loop.schedule.defer_boundary()
    assert not loop.schedule.defer_boundary()  # the limit's worth, then it runs
    loop.schedule.admitted_at, loop.schedule.deferrals = loop.pipeline.launched - 3, 0  # three bursts launched since
    assert not loop.schedule.defer_boundary()
    loop.schedule.admitted_at = loop.pipeline.launched
    for busy, limit in ((0.25, 1), (0.14, 2), (0.3, 0)):  # 1.2 and 2.1 bursts' worth; not host-bound
        loop.pipeline.burst_ms = busy
        assert loop.schedule.coalesce_limit() == limit, busy
    loop.pipeline.burst_ms = 0.25
    assert loop.schedule.defer_boundary() and not loop.schedule.defer_boundary()
    loop.schedule.deferrals = 0
    loop.pipeline.burst_ms = 0.3  # a burst as long as a typical admission
    assert not loop.schedule.defer_boundary()
    loop.pipeline.burst_ms = 0.1
    for order in ("early", "late"):
        loop.schedule.mode = order
        assert not loop.schedule.defer_boundary()
    assert loop.schedule.deferred_boundaries == 3
    shallow = make_loop(depth=2)  # depth 2: one burst at most, however short the bursts
    shallow.pipeline.burst_ms = 0.01
    for _ in range(COALESCE_AFTER):
        shallow.schedule.note_admission(0.3)
    shallow.schedule.admitted_at, shallow.schedule.deferrals = shallow.pipeline.launched, 0
    schedule = shallow.schedule
    assert schedule.coalesce_limit() == 1 and schedule.defer_boundary() and not schedule.defer_boundary()
    shallow.pipeline.burst_ms = 0.0  # an event pair that read 0 ms: no division by it
    assert shallow.schedule.coalesce_limit() == 1


def test_no_deferral_where_auto_admits_early():
    """At depth 6 and more a burst can be under one typical admission while the queued bursts
    outlast four: auto then admits early, and deferring would only cost a burst."""
    loop = make_loop(depth=6)
    for _ in range(3):
        loop.schedule.note_admission(1.0)
    loop.pipeline.burst_ms = 0.9  # 0.9 * (6 - 1) > 4 * 1.0: early
    loop.schedule.admitted_at = loop.pipeline.launched
    assert loop.schedule.admit_early()
    assert not loop.schedule.defer_boundary()
    loop.pipeline.burst_ms = 0.5  # 0.5 * 5 < 4: late, and host-bound
    assert not loop.schedule.admit_early()
    assert loop.schedule.defer_boundary()


def _count_host_bound(loop) -> list:
    """Wrap the loop's ``defer_boundary`` to record, at each due boundary, whether the schedule
    found the host the bottleneck (``host_bound``: the last burst's measured GPU time against the
    typical admission). Returns the list it appends to."""
    schedule, seen = loop.schedule, []
    defer = schedule.defer_boundary

    def recording_defer():
        seen.append(schedule.host_bound())
        return defer()

    schedule.defer_boundary = recording_defer
    return seen


@pytest.mark.gpu
def test_gpu_zero_cost_stubs_coalesce_and_costly_ones_do_not():
    """On a GPU of its own a zero-cost stub's burst (~0.02 ms) is far shorter than an admission
    (~0.2 ms), so boundaries coalesce. The GPU's events are what the schedule reads: on a GPU
    shared with other processes a burst's events can span another process's time slice, and
    then the host is no longer the bottleneck and nothing may coalesce. So the test holds the
    schedule to its own measured figures: boundaries found host-bound within the coalescing
    limit were deferred, and none was deferred otherwise."""
    from graphburst.backend import Backend

    cheap = make_loop(backend=Backend("cupy"), batch=4, depth=4)  # 12 requests through 4 slots: many admissions
    seen = _count_host_bound(cheap)
    _serve(cheap)
    if sum(seen) >= len(seen) // 2:  # a GPU mostly to itself: the bursts measured shorter than admissions
        assert cheap.schedule.deferred_boundaries > 0, seen
    else:  # shared and slowed: deferring follows the measured figures, never the stub's nominal cost
        assert cheap.schedule.deferred_boundaries <= sum(seen), seen
    costly = make_loop(backend=Backend("cupy"), cost_ns=2_000_000, depth=2)
    seen = _count_host_bound(costly)
    _serve(costly)
    assert not any(seen) and costly.schedule.deferred_boundaries == 0  # 8 ms bursts: never host-bound


def test_the_schedule_weighs_a_whole_burst_whatever_rounds_the_last_one_ran():
    # A device-exit burst ends after any number of rounds, zero while a stop is held (~20 µs of GPU
    # time on an H200). Taken as a burst's time, such a burst made a real model's loop look bound
    # by the host, so its first tokens waited for their first burst instead of being copied out early.
    loop = make_loop()  # M = 2
    pipeline, schedule = loop.pipeline, loop.schedule
    for _ in range(8):
        schedule.note_admission(1.0)  # typical admission: 1 ms of host time
    pipeline.clock.last_busy_ms = 30.0
    pipeline._burst_time(2)
    assert pipeline.burst_ms == 30.0 and not schedule.host_bound() and schedule.copy_first_tokens()
    pipeline.clock.last_busy_ms = 0.02  # a held burst: no round ran
    pipeline._burst_time(0)
    assert pipeline.burst_ms == 30.0 and schedule.copy_first_tokens()
    pipeline.clock.last_busy_ms = 7.0  # one round of two
    pipeline._burst_time(1)
    assert pipeline.burst_ms == 14.0
