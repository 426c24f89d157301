"""Token delivery of the serving loop: steady-state idle accounting, the loop's log, and
the engine thread's one hand-off per step. Expected tokens come from the CPU greedy oracle."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from graphburst import greedy_reference, stub_pair
from graphburst.serving.engine_thread import EngineThread, Ticket
from graphburst.serving.events import Admitted, Retired, Tokens
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop
from graphburst.serving.timing import BurstClock

VOCAB = 997


def make_loop(batch, *, pipelined=True, capacity=256, m=2, k=3):
    target, draft = stub_pair(batch, VOCAB, 2, 1, capacity, backend="numpy")
    return ServeLoop(target, draft, k=k, m_rounds=m, pipelined=pipelined)


class _NoGPU:
    is_gpu = False


def test_steady_idle_counts_only_bursts_launched_with_every_slot_running():
    # A known timeline: ramp-up (not steady), three steady bursts, ramp-down (not steady).
    clock = BurstClock(_NoGPU())
    timeline = [(1.0, None, False), (1.0, 3.0, False), (1.0, 0.5, True), (2.0, 0.0, True), (1.0, 0.5, True),
                (1.0, 4.0, False)]
    for busy, gap, steady in timeline:
        clock.record(busy, gap, steady)
    assert clock.overall.bursts == 6 and clock.steady.bursts == 3
    assert clock.overall.idle_fraction == pytest.approx((3 + 0.5 + 0 + 0.5 + 4) / (7 + 8))
    assert clock.steady.idle_fraction == pytest.approx(1.0 / (4 + 1.0))
    assert BurstClock(_NoGPU()).steady.idle_fraction is None  # no burst: no figure, never 0


def test_admission_spans_are_a_part_of_the_idle_time_of_counted_gaps():
    clock = BurstClock(_NoGPU())
    # (busy, gap, steady, admission): a gap not counted drops its span; a span never exceeds its gap
    for busy, gap, steady, admission in [(1.0, None, False, 5.0), (1.0, 2.0, True, 0.5), (1.0, 1.0, True, 1.5),
                                         (1.0, 3.0, False, 0.0)]:
        clock.record(busy, gap, steady, admission)
    assert clock.overall.admission_ms == pytest.approx(0.5 + 1.0)
    assert clock.overall.admission_fraction == pytest.approx(1.5 / (4 + 6))
    assert clock.steady.admission_fraction == pytest.approx(1.5 / (2 + 3))
    assert BurstClock(_NoGPU()).overall.admission_fraction is None
    assert clock.admission_begin(None) is None  # no GPU: no events
    clock.admission_end(None, None)


@pytest.mark.gpu
def test_refills_put_admission_spans_in_the_gaps_and_a_single_wave_none():
    from graphburst.backend import Backend

    def run(n_requests):
        target, draft = stub_pair(8, VOCAB, 2, 1, 256, backend=Backend("cupy"), cost_ns=20_000)
        loop = ServeLoop(target, draft, k=3, m_rounds=2)
        states = [loop.submit(Request([3 + i], 30)) for i in range(n_requests)]
        loop.run_until_idle()
        for s in states:
            assert s.tokens == greedy_reference(s.request.prompt, 30, VOCAB)
        return loop.stats()

    one_wave = run(8)  # every request admitted at once, before any burst: no counted gap holds a span
    assert one_wave["gpu_admission_fraction"] == 0.0
    refills = run(40)  # 5 requests per slot: refills behind bursts in flight
    assert 0.0 < refills["gpu_admission_fraction"] <= refills["gpu_idle_fraction"]


@pytest.mark.parametrize("pipelined", [False, True])
def test_loop_tags_bursts_steady_when_every_slot_runs(pipelined):
    loop = make_loop(2, pipelined=pipelined)
    states = [loop.submit(Request([3 + i], n)) for i, n in enumerate((90, 9, 14, 5))]  # the first outlives the rest: a ramp-down
    loop.run_until_idle()
    for s in states:
        assert s.tokens == greedy_reference(s.request.prompt, s.request.max_new_tokens, VOCAB)
    # Independent count: a burst launched with both slots running delivers to two requests
    # at the same instant (one delivery time per burst). Pipelined, each of the (up to two)
    # bursts launched while a request's last burst is still in flight is steady but may
    # deliver to one request only.
    times = [t for s in states for t, _ in s.deliveries[1:]]  # the first is the prefill's token, not a burst
    shared = sum(1 for t in set(times) if times.count(t) == 2)
    steady = loop.stats()["steady_bursts"]
    if pipelined:
        assert shared <= steady <= shared + loop.pipeline.depth * len(states)
    else:
        assert steady == shared
    assert 0 < steady < loop.stats()["bursts"]


def test_log_carries_every_token_in_order_and_each_admission_and_finish_once():
    loop = make_loop(3)
    loop.log = []
    states = [loop.submit(Request([5 + i, 2], n)) for i, n in enumerate((25, 7, 13, 4, 18))]
    cancelled = loop.submit(Request([1], 40))
    got = {id(s): [] for s in states + [cancelled]}
    admitted, retired = [], []
    steps = 0
    while not loop.idle:
        loop.step()
        steps += 1
        if steps == 3:
            loop.cancel(cancelled)
        for event in loop.log:
            match event:
                case Tokens(when, sts, rows, counts, ring, acc):
                    first = ring.shape[1] == 2  # first tokens handed out after the prefill, before any round
                    assert acc.shape == (len(rows), 2) and np.all(acc[:, 1] >= (0 if first else 1))
                    assert not first or np.all(counts[rows] == 1)
                    assert len(sts) == len(rows) and np.all(counts[rows] > 0)
                    for i, (s, b) in enumerate(zip(sts, rows)):
                        assert id(s) in got and not s.done or s.finished >= when
                        assert event.tokens_of(i) == ring[b, 1 : 1 + counts[b]].tolist()
                        got[id(s)] += event.tokens_of(i)
                case Admitted(state):
                    admitted.append(state)
                case Retired(state):
                    retired.append(state)
                case _:
                    raise AssertionError(f"not a loop event: {event!r}")
        loop.log.clear()
    for s in states:
        assert got[id(s)] == s.tokens == greedy_reference(s.request.prompt, s.request.max_new_tokens, VOCAB)
    assert got[id(cancelled)] == cancelled.tokens  # what it got before the cancel, nothing after
    assert sorted(map(id, retired)) == sorted(map(id, states + [cancelled]))  # each finish exactly once
    assert len(admitted) == len({id(s) for s in admitted}) <= len(states) + 1


def test_engine_hands_off_once_per_step_and_streams_the_reference_in_order():
    loop = make_loop(4)
    prompts = [[7, 1], [2], [9, 9, 9], [4, 4], [11], [3, 5]]
    limits = [20, 33, 8, 15, 27, 12]

    async def main():
        aloop = asyncio.get_running_loop()
        engine = EngineThread(loop, aloop)
        handoffs = []
        real = aloop.call_soon_threadsafe

        def counting(cb, *args):  # the real call; the engine's hand-offs are counted
            if getattr(cb, "__self__", None) is engine:
                handoffs.append(len(args[0]))
            return real(cb, *args)

        aloop.call_soon_threadsafe = counting
        got = {i: [] for i in range(len(prompts))}
        finals, done = {}, asyncio.Event()

        def sink(ticket, up):
            assert ticket.index not in finals, "an update after the final one"
            got[ticket.index] += up.tokens
            if up.reason is not None:
                finals[ticket.index] = up.reason
                if len(finals) == len(prompts):
                    done.set()

        tickets = [Ticket(Request(p, n), i, sink) for i, (p, n) in enumerate(zip(prompts, limits))]
        engine.start()
        engine.submit(tickets)
        try:
            await asyncio.wait_for(done.wait(), 60)
        finally:
            engine.stop()
            await asyncio.to_thread(engine.join, 10)
            del aloop.call_soon_threadsafe
        return got, finals, handoffs, engine.waiting

    got, finals, handoffs, waiting = asyncio.run(main())
    for i, (p, n) in enumerate(zip(prompts, limits)):
        assert got[i] == greedy_reference(p, n, VOCAB)
    assert set(finals.values()) == {"length"} and waiting == 0
    # one per step with something to say (a burst, or first tokens: at most one such step a request)
    assert len(handoffs) <= loop.bursts + len(prompts) + 2
    assert max(handoffs) >= 2  # a hand-off carries several requests' events at once


def test_host_stop_token_ends_the_stream_at_the_stop_on_the_event_loop():
    loop = make_loop(2)
    ref = greedy_reference([6, 1], 30, VOCAB)
    stop = ref[10]
    cut = ref[: ref.index(stop) + 1]

    async def main():
        engine = EngineThread(loop, asyncio.get_running_loop())
        got, finals, done = [], [], asyncio.Event()

        def sink(ticket, up):
            got.extend(up.tokens)
            if up.reason is not None:
                finals.append(up.reason)
                done.set()

        engine.start()
        engine.submit([Ticket(Request([6, 1], 30), 0, sink, frozenset({stop}))])
        await asyncio.wait_for(done.wait(), 60)
        await asyncio.sleep(0.2)  # a later "cancelled" final must not arrive
        engine.stop()
        await asyncio.to_thread(engine.join, 10)
        return got, finals

    got, finals = asyncio.run(main())
    assert got == cut and finals == ["stop"]


@pytest.mark.parametrize("reason, usage", [(None, None), ("eos", (3, 4)), ("length", (1, 0)), ("error", (2, 2))])
def test_stream_chunks_equal_the_completion_body(reason, usage):
    import json

    from graphburst.serving import openai_api as api

    chunks = api.StreamChunks('cmpl-"x"', 1234, "stub\\model")
    text, ids = 'h\u00e9\n"\u2028', [0, 17, 5002]
    use = None if usage is None else api.usage(*usage)
    raw = chunks.chunk(2, text, ids, reason, use)
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n") and raw.count(b"\n") == 2
    want = api.completion('cmpl-"x"', 1234, "stub\\model", [api.choice(2, text, ids, reason)], use)
    assert json.loads(raw[len(b"data: "):]) == want
