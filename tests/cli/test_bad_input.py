"""No valid request may crash the serving loop, cancel is final, the Python API names bad arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from graphburst import greedy_reference, stub_pair
from graphburst.engine.admission.checks import CapacityError
from graphburst.engine.decoder import SpecDecoder
from graphburst.capture import BurstGraph
from graphburst.models.stubs import StubTarget
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop

VOCAB = 5003
ROOT = Path(__file__).resolve().parents[2]
ENGINES = [("graph", True), ("graph", False), ("per_round_sync", False)]


def make_loop(backend="numpy", batch=4, k=4, m=3, capacity=256, accept=0.7, engine="graph", pipelined=True):
    target, draft = stub_pair(batch, VOCAB, [True, False, True], [True], capacity, accept_prob=accept,
                              backend=backend)
    return ServeLoop(target, draft, k=k, m_rounds=m, engine=engine, pipelined=pipelined)


def prompt_of(p: int) -> list:
    return [(p * 7 + i) % VOCAB for i in range(p)]


# ---------------------------------------------------------------- item 1: capacity


@pytest.mark.parametrize("accept", [0.4, 1.0])
@pytest.mark.parametrize("engine, pipelined", ENGINES)
def test_every_request_validate_accepts_runs_to_completion_near_capacity(engine, pipelined, accept):
    """A sweep: capacity 96, k=4, M=8, every (prompt length, max_new_tokens) pair that fits."""
    cap = 96
    loop = make_loop(batch=64, k=4, m=8, capacity=cap, accept=accept, engine=engine, pipelined=pipelined)
    refs = {p: greedy_reference(prompt_of(p), cap - p, VOCAB) for p in range(1, cap)}
    states = [(p, n, loop.submit(Request(prompt_of(p), n))) for p in range(1, cap) for n in range(1, cap - p + 1)]
    loop.run_until_idle()
    bad = [(p, n, s.error) for p, n, s in states if s.tokens != refs[p][:n] or s.finish_reason != "length"]
    assert not bad, f"{len(bad)} of {len(states)} failed, e.g. {bad[:3]}"
    assert loop.stats()["errors"] == 0


@pytest.mark.parametrize("gapless", [True, False])
def test_burst_graph_replays_up_to_the_last_kv_entry(gapless):
    target, draft = stub_pair(1, VOCAB, 2, 1, 100, accept_prob=1.0, backend="numpy")
    dec = SpecDecoder(target, draft, k=4, m_rounds=8)
    dec.prefill([[1] * 90], max_new_tokens=10)
    graph = BurstGraph(dec, gapless=gapless)
    out = []
    for _ in range(2):  # with gapless, both are in flight at once
        graph.replay()
        if not gapless:
            out += graph.drain()[0].tolist()
    if gapless:
        out += graph.drain()[0].tolist() + graph.drain()[0].tolist()
    assert out == greedy_reference([1] * 90, 10, VOCAB)


@pytest.mark.parametrize("mode", ["per_round_sync", "pre_issued"])
def test_eager_bursts_run_to_the_last_kv_entry(mode):
    target, draft = stub_pair(2, VOCAB, 2, 1, 100, accept_prob=1.0, backend="numpy")
    dec = SpecDecoder(target, draft, k=4, m_rounds=8)
    dec.prefill([[1] * 90, [2] * 3], max_new_tokens=[10, 97])
    out = [[], []]
    for _ in range(4):
        for b, t in enumerate(dec.run_burst(mode=mode)):
            out[b] += t.tolist()
    assert out == [greedy_reference([1] * 90, 10, VOCAB), greedy_reference([2] * 3, 97, VOCAB)]


def test_capacity_rule_still_refuses_a_burst_that_would_overflow():
    target, draft = stub_pair(1, VOCAB, 1, 1, 64, backend="numpy")
    dec = SpecDecoder(target, draft, k=4, m_rounds=2)  # ring of 10
    dec.prefill([[1] * 50])  # unbounded: 14 entries left, one burst of up to 10 fits, two do not
    dec.run_burst()
    dec.host_pos[0] = 60  # as if the burst had committed 10
    with pytest.raises(CapacityError, match="slot 0") as info:
        dec.run_burst()
    assert info.value.slots == (0,)


def _cli(*args, stdin=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "graphburst.cli", *args], input=stdin, capture_output=True,
                          env=env, timeout=timeout)


def test_cli_serves_a_request_that_fills_the_cache_exactly():
    line = b'{"id":"r1","prompt":[12,7,99],"max_new_tokens":4093}\n'
    out = _cli("serve", "--backend", "numpy", "--batch", "2", stdin=line)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    (rec,) = [json.loads(x) for x in out.stdout.splitlines()]
    assert rec["id"] == "r1" and rec["line"] == 1 and rec["finish_reason"] == "length"
    assert rec["tokens"] == greedy_reference([12, 7, 99], 4093, 32000)


class FailingTarget(StubTarget):
    """A real stub target whose verify raises on chosen calls: a model failing mid-burst."""

    fail_on: set = set()
    calls = 0

    def verify(self, bufs, stream) -> None:
        FailingTarget.calls += 1
        if FailingTarget.calls in self.fail_on:
            raise RuntimeError("model blew up")
        super().verify(bufs, stream)


@pytest.mark.parametrize("engine, pipelined", ENGINES)
def test_a_request_changed_after_submit_runs_as_submitted(engine, pipelined):
    # The loop admits from the values validated at submit(), never from the Request object.
    loop = make_loop(batch=3, m=2, capacity=64, engine=engine, pipelined=pipelined)
    good = [loop.submit(Request([5, 6], 40)), loop.submit(Request([8], 30))]
    longer = loop.submit(Request([1, 2, 3], 20))
    bad_prompt = loop.submit(Request([4], 5))
    after = loop.submit(Request([9, 9], 25))
    longer.request.max_new_tokens = 10**6
    bad_prompt.request.prompt = [-1]
    loop.run_until_idle()
    assert longer.error is None and longer.tokens == greedy_reference([1, 2, 3], 20, VOCAB)
    assert bad_prompt.error is None and bad_prompt.tokens == greedy_reference([4], 5, VOCAB)
    for s in good + [after]:
        assert s.error is None and s.tokens == greedy_reference(s.request.prompt, s.request.max_new_tokens, VOCAB)
    assert loop.stats()["errors"] == 0


@pytest.mark.parametrize("engine, pipelined", ENGINES)
def test_a_model_failure_mid_burst_fails_the_running_requests_and_the_loop_goes_on(engine, pipelined):
    target, draft = stub_pair(2, VOCAB, 2, 1, 128, backend="numpy")
    target = FailingTarget(2, VOCAB, 2, 128, backend="numpy")
    FailingTarget.calls = 0
    FailingTarget.fail_on = {5}
    loop = ServeLoop(target, draft, k=3, m_rounds=2, engine=engine, pipelined=pipelined)
    running = [loop.submit(Request([3], 60)), loop.submit(Request([4], 60))]
    later = loop.submit(Request([7, 7], 20))
    loop.run_until_idle()
    for s in running:
        assert s.finish_reason == "error" and "model blew up" in s.error
        assert s.tokens == greedy_reference(s.request.prompt, len(s.tokens), VOCAB)
    assert later.error is None and later.tokens == greedy_reference([7, 7], 20, VOCAB)


# ---------------------------------------------------------------- item 6: cancel


@pytest.mark.parametrize("engine, pipelined", ENGINES)
def test_no_token_reaches_a_request_after_cancel(engine, pipelined):
    loop = make_loop(batch=2, m=2, engine=engine, pipelined=pipelined)
    a = loop.submit(Request([4], 200))
    b = loop.submit(Request([5], 50))
    for _ in range(3):
        loop.step()
    at_cancel = list(a.tokens)
    assert len(at_cancel) > 0 and not a.done
    loop.cancel(a)
    assert a.done and a.finish_reason == "cancelled"
    loop.run_until_idle()
    assert a.tokens == at_cancel and list(loop.stream(a)) == at_cancel
    assert b.tokens == greedy_reference([5], 50, VOCAB) and b.finish_reason == "length"


@pytest.mark.parametrize("engine, pipelined", ENGINES)
def test_cancelling_a_finished_request_changes_nothing(engine, pipelined):
    loop = make_loop(engine=engine, pipelined=pipelined)
    ref = greedy_reference([3, 1], 12, VOCAB)
    s = loop.submit(Request([3, 1], 12, eos=ref[5]))
    loop.run_until_idle()
    finished = s.finished
    loop.cancel(s)
    assert s.finish_reason == "eos" and not s.cancelled and s.finished == finished and s.tokens == ref[:6]


# ---------------------------------------------------------------- item 4 (loop side): ids


def test_duplicate_ids_in_flight_are_refused_and_made_up_ids_never_collide():
    loop = make_loop()
    a = loop.submit(Request([1], 5, id="req-0"))
    with pytest.raises(ValueError, match="'req-0' is already in flight"):
        loop.submit(Request([2], 5, id="req-0"))
    auto = loop.submit(Request([3], 5))
    assert auto.request.id != "req-0"
    with pytest.raises(ValueError, match="form of the ids made up"):  # a form callers cannot use
        loop.submit(Request([2], 5, id=auto.request.id))
    loop.run_until_idle()
    again = loop.submit(Request([2], 5, id="req-0"))  # the first one is done: its id is free again
    loop.run_until_idle()
    assert a.tokens == greedy_reference([1], 5, VOCAB) and again.tokens == greedy_reference([2], 5, VOCAB)


# ---------------------------------------------------------------- item 8: Python API


def test_loop_accepts_what_prefill_accepts():
    loop = make_loop()
    states = [loop.submit(Request(np.array([7, 8, 9]), 6)), loop.submit(Request([np.int64(7), np.int32(8)], 6)),
              loop.submit(Request((5, 6), np.int64(4), eos=np.int64(3)))]
    loop.run_until_idle()
    assert states[0].tokens == greedy_reference([7, 8, 9], 6, VOCAB)
    assert states[1].tokens == greedy_reference([7, 8], 6, VOCAB)
    assert states[2].tokens == greedy_reference([5, 6], 4, VOCAB)[:4]


@pytest.mark.parametrize("prompt, exc, match", [
    (None, TypeError, "prompt must be a list"),
    ((t for t in [1, 2]), TypeError, "prompt must be a list .* got generator"),
    ([1, [2, 3]], TypeError, r"prompt\[1\] must be an int token, got list"),
    ("abc", TypeError, "prompt must be a list"),
    ([True], TypeError, r"prompt\[0\] must be an int token, got bool"),
    ([10**30], ValueError, r"prompt\[0\] = 1000000000000000000000000000000 is outside"),
    (np.array([[1, 2]]), ValueError, "1-D"),
    (np.array([1.0]), TypeError, "integer tokens"),
])
def test_loop_and_prefill_reject_the_same_prompts_with_one_message(prompt, exc, match):
    loop = make_loop(batch=1)
    if prompt is not None and not isinstance(prompt, type(t for t in [])):  # None: prefill leaves the slot
        with pytest.raises(exc, match=match.replace("prompt", r"prompts\[0\]", 1)):
            loop.dec.prefill([prompt])
    with pytest.raises(exc, match=match):
        loop.submit(Request(prompt, 3))


@pytest.mark.parametrize("kwargs, match", [
    (dict(target_layers=True), "target_layers must be an int .* got bool True"),
    (dict(target_layers="abc"), "target_layers must be an int .* got str 'abc'"),
    (dict(draft_layers=None), "draft_layers must be an int .* got NoneType"),
    (dict(target_layers=[True, "x"]), r"target_layers\[1\] must be a bool"),
])
def test_stub_pair_names_a_bad_layer_argument(kwargs, match):
    args = dict(batch=1, vocab=10, target_layers=2, draft_layers=1, capacity=8, backend="numpy") | kwargs
    with pytest.raises(TypeError, match=match):
        stub_pair(**args)


@pytest.mark.parametrize("prompts, kwargs, exc, match", [
    ([[1]], dict(max_new_tokens=1.0), TypeError, r"max_new_tokens\[0\] must be an int, got float 1.0"),
    ([[1]], dict(max_new_tokens="3"), TypeError, r"max_new_tokens\[0\] must be an int, got str '3'"),
    ([[1]], dict(eos=[1.5]), TypeError, r"eos\[0\] must be an int"),
    ([[1, [2]]], {}, TypeError, r"prompts\[0\]\[1\] must be an int token"),
    (None, {}, TypeError, "prompts must be a list with one entry .* got NoneType"),
    ((p for p in [[1]]), {}, TypeError, "prompts must be a list .* got generator"),
])
def test_prefill_names_a_bad_argument(prompts, kwargs, exc, match):
    target, draft = stub_pair(1, 10, 1, 1, 32, backend="numpy")
    dec = SpecDecoder(target, draft, k=2, m_rounds=2)
    with pytest.raises(exc, match=match):
        dec.prefill(prompts, **kwargs)
    dec.prefill(np.array([[1, 2]]), max_new_tokens=np.int64(3))  # a 2-D array and numpy scalars are fine
    assert sum(len(t) for t in dec.run_burst()) >= 1
