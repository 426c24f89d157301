"""A serving loop whose bursts end on the device (``ServeLoop(..., device_exit=...)``): a request that
arrives while bursts run is admitted at the next round; tokens are the CPU greedy oracle's.

On numpy a burst runs when it is launched, so "the next round" shows as "before any other burst is
launched"; on the GPU (marked tests) the time from submission to the first token is measured against
the fixed-M loop's.
"""

from __future__ import annotations

import math
import time
import types

import numpy as np
import pytest
from marks import requires_gpu

from graphburst import greedy_reference, stub_pair
from graphburst.serving.loop import ServeLoop
from graphburst.serving.request import Request

VOCAB = 997


def make_loop(batch, *, backend="numpy", m=8, k=3, depth=2, device_exit=True, cost_ns=0, capacity=512, **kw):
    target, draft = stub_pair(batch, VOCAB, 2, 1, capacity, backend=backend, cost_ns=cost_ns, accept_prob=0.7, seed=3)
    return ServeLoop(target, draft, k=k, m_rounds=m, depth=depth, device_exit=device_exit, **kw)


def check_oracle(states):
    for s in states:
        assert s.tokens == greedy_reference(s.request.prompt, s.request.max_new_tokens, VOCAB)


def serve_with_churn(loop, seed, per_wave):
    """Four waves of ``per_wave`` random requests arriving between steps while earlier ones decode, served
    to the end and held to the oracle."""
    rng = np.random.default_rng(seed)
    states = []
    for wave in range(4):
        states += [loop.submit(Request(rng.integers(0, VOCAB, int(rng.integers(1, 9))).tolist(),
                                       int(rng.integers(1, 60)))) for _ in range(per_wave)]
        for _ in range(3):
            loop.step()
    loop.run_until_idle()
    check_oracle(states)


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("chunk", [None, 3])
def test_device_exit_loop_tokens_equal_the_oracle_with_churn(backend, depth, chunk):
    loop = make_loop(4, backend=backend, depth=depth, prefill_chunk=chunk)
    assert loop.device_exit
    serve_with_churn(loop, depth, 5)
    stats = loop.stats()
    assert stats["device_exit"] is True and stats["rounds_per_burst"] < 8  # bursts ended early
    assert not loop.dec.stop_pending  # every stop the loop asked for was answered
    # each drained burst ended for one reason (here no burst runs when a request arrives: the numpy
    # backend runs a burst as it is launched, so no stop ends one)
    exits = stats["burst_exits"]
    assert sum(exits.values()) == stats["bursts"] and exits["m_max"] > 0 and exits["idle"] > 0


def test_a_request_arriving_mid_stream_is_admitted_before_another_burst_is_launched():
    loops = {dx: make_loop(2, device_exit=dx, admission="late") for dx in (True, False)}
    launched_at_admission = {}
    for dx, loop in loops.items():
        long = loop.submit(Request([5, 6, 7], 300))
        for _ in range(4):
            loop.step()
        launched = loop.pipeline.launched
        take = loop.boundary.take_waiting

        def recorded(take=take, loop=loop, dx=dx):
            if loop.intake.queue:
                launched_at_admission[dx] = loop.pipeline.launched
            take()

        loop.boundary.take_waiting = recorded
        new = loop.submit(Request([9, 9], 5))
        if dx:
            assert loop.dec.stop_pending  # the bursts in flight end at their next round
        loop.run_until_idle()
        check_oracle([long, new])
        launched_at_admission[dx] -= launched
    assert launched_at_admission[True] == 0  # admitted behind the bursts in flight, before any other
    assert launched_at_admission[False] >= 1  # the fixed loop (late order) refills first


def test_a_stop_whose_request_is_not_in_the_intake_yet_stays_pending():
    # The HTTP engine's order: a handler queues its request in the engine's inbox, then asks for a
    # round exit; the engine thread marks the intake, takes the inbox, then steps. A stop asked for
    # after the mark belongs to a request the next admission cannot take: answering it there would
    # let the bursts after that admission run whole while the request waits.
    loop = make_loop(2)
    long = loop.submit(Request([5, 6, 7], 300))
    for _ in range(3):
        loop.step()
    loop.mark_intake()  # the engine thread takes the inbox (empty) ...
    loop.request_round_exit()  # ... as a handler's request arrives after it
    loop.step()
    assert loop.dec.stop_pending  # held for the request still on its way, not answered by this step
    loop.mark_intake()  # the next iteration takes the request (its stop asked for already), then steps
    late = loop.submit(Request([9, 9], 5), round_exit=False)
    launched, take = loop.pipeline.launched, loop.boundary.take_waiting
    admitted_at = []

    def recorded():
        if loop.intake.queue:
            admitted_at.append(loop.pipeline.launched)
        take()

    loop.boundary.take_waiting = recorded
    loop.step()
    assert admitted_at == [launched] and not loop.dec.stop_pending  # admitted at once, and its stop answered
    loop.run_until_idle()
    check_oracle([long, late])


def test_the_engine_thread_marks_the_intake_before_it_takes_arrivals(monkeypatch):
    import asyncio

    from graphburst.serving.engine_thread import EngineThread, Ticket

    loop = make_loop(2)
    engine = EngineThread(loop, asyncio.new_event_loop())
    order = []
    monkeypatch.setattr(loop, "mark_intake", lambda: order.append("mark"))
    submit = loop.submit
    monkeypatch.setattr(loop, "submit", lambda req, **kw: (order.append(("submit", kw)), submit(req, **kw))[1])
    count = loop.dec.stop_requests
    engine.submit([Ticket(Request([1, 2], 3), 0, sink=None)])  # a handler's call: queue, then ask for the exit
    assert loop.dec.stop_requests == count + 1
    engine.stop()  # one pass of the serve loop: it applies the inbox, then returns
    engine._serve()
    # marked before the request was taken; the loop asks for no second exit for it
    assert order[:2] == ["mark", ("submit", {"round_exit": False})] and loop.dec.stop_requests == count + 1


def test_no_stop_is_asked_when_every_slot_is_taken():
    loop = make_loop(1)
    first = loop.submit(Request([1, 2], 40))
    loop.step()
    count = loop.dec.round_exit.flag.count
    waiting = loop.submit(Request([3, 4], 4))  # no free slot: the bursts run whole
    assert loop.dec.round_exit.flag.count == count and not loop.dec.stop_pending
    loop.run_until_idle()
    check_oracle([first, waiting])


def test_device_exit_auto_without_while_graphs_runs_a_ladder(monkeypatch):
    from graphburst import capture

    monkeypatch.setattr(capture, "device_exit_refusal", lambda dec: ("no conditional nodes here", "none"))
    loop = make_loop(2, device_exit="auto")
    assert not loop.device_exit and loop.ladder and loop.stats()["rounds_per_burst"] is None
    states = [loop.submit(Request([1, 2, 3], 17)), loop.submit(Request([4], 9))]
    loop.run_until_idle()
    check_oracle(states)
    stats = loop.stats()
    assert stats["burst_exits"] == {"m_max": 0, "idle": 0, "flag": 0}  # fixed-length bursts: no exit counted
    assert stats["ladder"] and sum(stats["ladder_bursts"].values()) == stats["bursts"]
    assert stats["burst_rounds"] == sum(int(r) * n for r, n in stats["ladder_bursts"].items())
    with pytest.raises(ValueError, match="device_exit=True is not available here: no conditional nodes here"):
        make_loop(2, device_exit=True)


@pytest.mark.parametrize("depth", [2, 3])
def test_ladder_loop_tokens_equal_the_oracle_with_churn(backend, depth):
    loop = make_loop(3, backend=backend, depth=depth, device_exit="ladder")
    assert loop.ladder and not loop.device_exit and loop.graph.rungs == (1, 2, 4, 8)
    serve_with_churn(loop, depth, 4)
    stats = loop.stats()
    rungs = stats["ladder_bursts"]
    assert sum(rungs.values()) == stats["bursts"]
    if not loop.dec.backend.is_gpu:  # on the GPU which rungs run follows the timings (the schedule's deferrals)
        assert rungs["1"] > 0  # requests waited for a slot: their admission came a round later
        assert rungs["8"] > 0  # a full batch with nobody waiting runs whole bursts


def test_ladder_rounds_follow_the_queue_and_the_budgets():
    from graphburst.serving.loop import LADDER_FREE_SLOT_MS

    loop = make_loop(2, device_exit="ladder", depth=2)
    pipeline = loop.pipeline
    a = loop.submit(Request([1, 2], 400))
    loop.step()
    # a slot free, nobody waiting, no GPU timing yet (numpy): M rounds, the budget allowing
    assert pipeline.rounds_in_flight == 16 and loop.pipeline.rounds_for(pipeline) == 8
    # with a burst's time known, a free slot gets bursts of about LADDER_FREE_SLOT_MS
    for burst_ms, want in ((16.0, 2), (80.0, 1), (1.0, 8)):  # 2, 10 and 0.125 ms a round at M = 8
        pipeline.burst_ms = burst_ms
        assert loop.pipeline.rounds_for(pipeline) == want == max(1, min(8, math.ceil(LADDER_FREE_SLOT_MS / (burst_ms / 8))))
    b = loop.submit(Request([3], 400))
    c = loop.submit(Request([4], 3))
    loop.step()  # b takes the free slot and c waits: no slot free, so bursts run whole
    assert loop.table.n_occupied == 2 and loop.intake.queue and loop.pipeline.rounds_for(pipeline) == 8
    loop.cancel(a)
    loop.step()  # a's slot freed, and c admitted in it
    loop.cancel(b)
    loop.step()
    # c alone, 3 tokens left, bursts in flight covering them: the shortest burst
    assert loop.dec.host_left.max() <= pipeline.rounds_in_flight and loop.pipeline.rounds_for(pipeline) == 1
    loop.run_until_idle()
    check_oracle([c])


def test_device_exit_is_validated():
    with pytest.raises(ValueError, match="device_exit must be one of"):
        make_loop(2, device_exit="yes")
    with pytest.raises(ValueError, match="per_round_sync engine runs eager bursts"):
        make_loop(2, engine="per_round_sync", pipelined=False)
    from graphburst.serving.policy import LocalPolicy

    lockstep_like = types.SimpleNamespace(**{n: getattr(LocalPolicy(), n) for n in (
        "heartbeat_s", "replays_ids", "early_first_tokens", "make_decoder", "make_graph", "costs_only_its_requests")},
        local_timing=False)
    with pytest.raises(ValueError, match="local_timing is False"):
        make_loop(2, policy=lockstep_like)


@pytest.mark.gpu
@requires_gpu
def test_gpu_a_request_arriving_during_a_long_burst_gets_its_first_token_within_a_few_rounds():
    """Stubs of ~200 µs a model call, M = 32 (a burst ~25 ms), two bursts in flight: a request
    submitted while one long request decodes gets its first token after a few rounds with device
    exit, against bursts in flight with fixed-M bursts; every token is the oracle's."""
    from graphburst.backend import Backend

    backend = Backend("cupy")
    ttft, per_round = {}, {}
    for dx in (True, False, "ladder"):
        loop = make_loop(2, backend=backend, m=32, cost_ns=200_000, capacity=8192, device_exit=dx)
        assert loop.device_exit is (dx is True) and loop.ladder is (dx == "ladder")
        long = loop.submit(Request([5, 6, 7], 4000))
        for _ in range(6):
            loop.step()
        t0 = time.perf_counter()
        new = loop.submit(Request([9, 9], 4))
        while not new.tokens:
            loop.step()
        ttft[dx] = (time.perf_counter() - t0) * 1e3
        loop.cancel(long)
        loop.run_until_idle()
        check_oracle([new])
        assert long.tokens == greedy_reference(long.request.prompt, len(long.tokens), VOCAB)
        stats = loop.stats()
        per_round[dx] = stats["rounds_per_burst"]
    print(f"\nfirst token after submission: device exit {ttft[True]:.1f} ms, ladder {ttft['ladder']:.1f} ms, "
          f"fixed M=32 {ttft[False]:.1f} ms; rounds per burst {per_round[True]:.1f} / {per_round['ladder']:.1f} / "
          f"{per_round[False]:.1f}")
    assert ttft[True] * 4 < ttft[False], ttft
    assert ttft["ladder"] * 2 < ttft[False], ttft  # short bursts while a slot is free
