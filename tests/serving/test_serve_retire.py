"""Requests finishing together in one delivery (``Delivery.retire_finished``): each keeps its
own tokens, deliveries and accept counters, gets one Retired event, frees its slot and its id.
Expected tokens come from the CPU greedy oracle; expected deliveries and counters are rebuilt
from the loop's Tokens events, independently of the request's own copy-out."""

from __future__ import annotations

import numpy as np

from graphburst import greedy_reference, stub_pair
from graphburst.serving.events import Admitted, Retired, Tokens
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop

VOCAB = 997
SURE = {"accept_prob": 1.0}  # every draft accepted: a slot commits exactly m * (k + 1) tokens a burst


def make_loop(batch, *, m=2, k=3):
    target, draft = stub_pair(batch, VOCAB, 2, 1, 256, backend="numpy")
    loop = ServeLoop(target, draft, k=k, m_rounds=m)
    loop.log = []
    return loop


def run_logged(loop, on_step=None):
    """Step until idle; per request: [(time, tokens)] from Tokens events, the last acc row seen,
    and the step and log position of its Retired event."""
    seen, last_acc, retired, steps = {}, {}, {}, 0
    while not loop.idle:
        loop.step()
        steps += 1
        for at, event in enumerate(loop.log):
            match event:
                case Tokens(when, states, rows, _, _, acc):
                    for i, (s, b) in enumerate(zip(states, rows)):
                        seen.setdefault(id(s), []).append((when, event.tokens_of(i)))
                        last_acc[id(s)] = tuple(acc[i].tolist())
                case Retired(state):
                    assert id(state) not in retired, "a second Retired event"
                    retired[id(state)] = (steps, at)
                case Admitted():
                    pass
        loop.log.clear()
        if on_step is not None:
            on_step(steps)
    return seen, last_acc, retired


def check_finished(state, seen, last_acc):
    """The request's own record equals what the log handed out for it."""
    got = seen.get(id(state), [])
    assert state.tokens == [t for _, part in got for t in part]
    assert state.deliveries == [(when, len(part)) for when, part in got]
    assert (state.accepted, state.rounds) == last_acc.get(id(state), (0, 0))
    assert state.n_tokens == len(state.tokens)
    if got:
        assert state.first_token == got[0][0] and state.last_delivery == got[-1][0] <= state.finished


def test_every_slot_finishing_in_one_burst_keeps_its_own_record():
    loop = make_loop(64)
    # 20 tokens at exactly 8 a burst: all 64 finish in the third burst, with 8, 8 and 4 tokens
    states = [loop.submit(Request([5 + i, 2], 20, id=f"r{i}", options=SURE)) for i in range(64)]
    seen, last_acc, retired = run_logged(loop)
    assert len({step for step, _ in retired.values()}) == 1  # one delivery finished them all
    order = sorted(states, key=lambda s: retired[id(s)][1])
    assert [s.slot for s in order] == list(range(64))  # events in slot order, as before batching
    finished = {s.finished for s in states}
    assert len(finished) == 1  # the burst's time, set once for the batch
    for s in states:
        assert s.tokens == greedy_reference(s.request.prompt, 20, VOCAB)
        # the first token is handed out after the prefill, then the first burst brings the other 7
        assert [n for _, n in s.deliveries] == [1, 7, 8, 4] and s.finish_reason == "length"
        check_finished(s, seen, last_acc)
        assert s.rounds >= 1 and s.accepted > 0
    assert loop.active == 0 and not loop.intake.live and loop.table.slot_state.tolist() == [None] * 64
    again = loop.submit(Request([1], 3, id="r0"))  # its id is free again
    loop.run_until_idle()
    assert again.tokens == greedy_reference([1], 3, VOCAB)


def test_a_cancel_and_stops_by_length_and_by_eos_in_the_same_delivery():
    loop = make_loop(4)
    ref = greedy_reference([6, 1], 40, VOCAB)
    eos = ref[11]
    cut = ref[: ref.index(eos) + 1]  # 12 tokens at most: it stops in the second burst
    long = loop.submit(Request([9], 40, options=SURE))
    by_length = loop.submit(Request([3, 3], 13, options=SURE))  # 8 + 5: the second burst too
    by_eos = loop.submit(Request([6, 1], 40, eos=eos, options=SURE))
    early = loop.submit(Request([4], 30, options=SURE))
    fresh = []

    def on_step(step):
        if step == 2:  # (step 1 handed out first tokens, step 2 the first burst) bursts in flight hold
            # tokens for both: they must never reach them
            loop.cancel(long)
            fresh.append(loop.submit(Request([8], 30)))  # then refills the first freed slot
            loop.cancel(fresh[0])  # cancelled while waiting: never admitted
            loop.cancel(early)

    seen, last_acc, retired = run_logged(loop, on_step)
    assert long.finish_reason == early.finish_reason == "cancelled" and fresh[0].slot is None
    assert long.tokens == greedy_reference([9], 40, VOCAB)[: len(long.tokens)] and len(long.tokens) == 8
    assert by_length.tokens == greedy_reference([3, 3], 13, VOCAB) and by_length.finish_reason == "length"
    assert by_eos.tokens == cut and by_eos.finish_reason == "eos"
    assert retired[id(by_length)][0] == retired[id(by_eos)][0]  # finished by one delivery
    for s in (long, by_length, by_eos, early):
        check_finished(s, seen, last_acc)
    assert loop.active == 0 and not loop.intake.live


def test_a_request_cancelled_before_its_first_token_has_empty_records():
    loop = make_loop(2)
    other = loop.submit(Request([2], 30))
    loop.step()
    first = loop.submit(Request([7], 30))
    loop.step()  # admitted at this step's boundary, behind bursts in flight: running, no token yet
    assert loop.table.slots[first.slot] is first and loop.table.running[first.slot] and first.n_tokens == 0
    loop.cancel(first)
    loop.run_until_idle()
    assert first.tokens == [] and first.deliveries == [] and first.first_token is None
    assert first.last_delivery is None and first.finish_reason == "cancelled"
    assert first.stats()["ttft_ms"] is None and (first.accepted, first.rounds) == (0, 0)
    assert other.tokens == greedy_reference([2], 30, VOCAB) and np.count_nonzero(loop.table.running) == 0


def test_take_waiting_pops_the_oldest_live_requests_and_skips_cancelled_ones():
    from graphburst.serving.intake import RequestIntake

    intake = RequestIntake(vocab=VOCAB, capacity=64, sampling=False, slot_options=lambda options: None)
    states = [intake.submit(Request([1 + i], 4)) for i in range(6)]
    states[1].finished = states[3].finished = 1.0  # cancelled while waiting (done before admission)
    assert intake.take_waiting(2) == [states[0], states[2]]  # the cancelled one between them is dropped
    assert intake.take_waiting(0) == []
    assert list(intake.queue) == states[3:]
    assert intake.take_waiting(9) == [states[4], states[5]]
    assert not intake.queue and intake.take_waiting(1) == []
