"""Device-exit bursts on the numpy backend: the condition kernel's twin, the rounds a burst runs,
and the state it leaves, held to a chain of one-round fixed bursts (device_exit_cases.py).

The same checks against the CUDA graph are in test_device_exit_gpu.py.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from device_exit_cases import (
    CASES,
    assert_same_state,
    build,
    check_held_stops,
    prefill,
    state,
    stop_during_round,
    truncated_oracle,
)

from graphburst import constants
from graphburst.capture import BurstGraph
from graphburst.engine import conditional
from graphburst.engine.round_exit import RoundExit
from graphburst.kernels import round_exit_ref
from graphburst.kernels.digest import greedy_reference
from graphburst.kernels.source import kernel_source

M_MAX = 8
VOCAB = 32003


def drained(tokens):
    return [t.tolist() for t in tokens]


# ---------------------------------------------------------------------------- the condition


def test_round_exit_macros_without_cupy():
    from pathlib import Path

    import graphburst.kernels as k

    src = kernel_source(Path(k.__file__).with_name("round_exit.cu"))
    for macro, value in [("GB_EXIT_WORDS", constants.EXIT_WORDS), ("GB_EXIT_GO", constants.EXIT_GO),
                         ("GB_EXIT_ACK", constants.EXIT_ACK), ("GB_EXIT_BY_FLAG", constants.EXIT_BY_FLAG),
                         ("GB_EXIT_BY_IDLE", constants.EXIT_BY_IDLE), ("GB_EXIT_BY_ROUNDS", constants.EXIT_BY_ROUNDS),
                         ("GB_EXIT_ROUNDS", constants.EXIT_ROUNDS), ("GB_EXIT_REASON", constants.EXIT_REASON),
                         ("GB_EXIT_RUNNING", constants.EXIT_RUNNING), ("GB_EXIT_THREADS", constants.EXIT_THREADS)]:
        assert f"#define {macro} {value}\n" in src, macro


def run_twin(budget, state, count, m_max, begin):
    state = np.array(state, np.int32)
    round_exit_ref.round_exit(np.array(budget, np.int32), state, np.array([count], np.int32), m_max=m_max,
                              begin=begin)
    return state.tolist()


def test_round_exit_twin_counts_rounds_and_names_why_it_stops():
    # [rounds, go, ack, reason]
    assert run_twin([0, 3], [9, 0, 5, 1], 5, 4, True) == [0, 1, 5, constants.EXIT_RUNNING]  # begin: count 0
    assert run_twin([0, 3], [2, 1, 5, 0], 5, 4, False) == [3, 1, 5, constants.EXIT_RUNNING]
    assert run_twin([0, 3], [3, 1, 5, 0], 5, 4, False) == [4, 0, 5, constants.EXIT_BY_ROUNDS]
    assert run_twin([0, 0], [1, 1, 5, 0], 5, 4, False) == [2, 0, 5, constants.EXIT_BY_IDLE]
    assert run_twin([0, -1], [0, 0, 0, 0], 0, 4, True) == [0, 0, 0, constants.EXIT_BY_IDLE]  # budgets <= 0: idle
    # a pending request ends the loop and is answered (ack <- the count read), even with rounds left
    assert run_twin([7], [1, 1, 5, 0], 6, 4, False) == [2, 0, 6, constants.EXIT_BY_FLAG]
    assert run_twin([7], [0, 0, 5, 0], 9, 4, True) == [0, 0, 9, constants.EXIT_BY_FLAG]
    # an end for another reason answers a request made before it, too
    assert run_twin([0], [1, 1, 5, 0], 5, 4, False)[2] == 5


def test_round_exit_twin_holds_stops_until_answered():
    state = np.array([1, 1, 5, 0], np.int32)
    round_exit_ref.round_exit(np.array([7], np.int32), state, np.array([6], np.int32), m_max=4, begin=False,
                              hold=True)
    assert state.tolist() == [2, 0, 5, constants.EXIT_BY_FLAG]  # ended by the flag, ack left alone
    state = np.array([1, 1, 5, 0], np.int32)
    round_exit_ref.round_exit(np.array([0], np.int32), state, np.array([5], np.int32), m_max=4, begin=False,
                              hold=True)
    assert state.tolist() == [2, 0, 5, constants.EXIT_BY_IDLE]


def test_held_stops_end_every_queued_burst_until_answered():
    check_held_stops("numpy", M_MAX)


def test_hold_stops_is_validated():
    dec = build("numpy", CASES["ragged_budgets"], M_MAX)
    with pytest.raises(ValueError, match="hold_stops=True needs device_exit"):
        BurstGraph(dec, hold_stops=True)
    with pytest.raises(TypeError, match="hold_stops must be a bool"):
        BurstGraph(dec, device_exit=True, hold_stops="yes")
    with pytest.raises(RuntimeError, match="answer_stop needs a graph that holds stops"):
        BurstGraph(dec, device_exit=True).answer_stop()


def test_stop_flag_counts_requests_and_wraps():
    from graphburst.backend import Backend
    from graphburst.buffers import StreamBufs

    backend = Backend("numpy")
    rx = RoundExit(StreamBufs(2, 1, 3, backend), backend, backend.new_stream())
    assert rx.flag.count == 0
    rx.request_stop()
    rx.request_stop()
    assert rx.flag.count == 2
    rx.flag.word[0] = constants.STOP_COUNT_MASK
    rx.request_stop()
    assert rx.flag.count == 0


# ---------------------------------------------------------------------------- the burst


@pytest.mark.parametrize("name", sorted(CASES))
def test_device_exit_burst_equals_the_fixed_burst_truncated_where_it_ended(name):
    """Tokens, rounds and state of device-exit bursts (graph and both eager modes) equal one-round
    bursts chained until no slot has budget or M_max; three bursts, so the state carries over."""
    case = CASES[name]
    graph_dec = build("numpy", case, M_MAX)
    graph = BurstGraph(graph_dec, device_exit=True)
    eager = {mode: build("numpy", case, M_MAX) for mode in ("pre_issued", "per_round_sync")}
    for n in range(3):
        want_tokens, want_rounds, want_state = truncated_oracle("numpy", case, M_MAX, bursts_before=n)
        got = graph.run()
        assert drained(got) == want_tokens, f"{name} burst {n}"
        assert graph.last_rounds == got.rounds == want_rounds, f"{name} burst {n}"
        assert_same_state(state(graph_dec), want_state, f"{name} burst {n} (graph)")
        np.testing.assert_array_equal(graph_dec.host_pos, want_state["pos_ctr"])  # the host mirror stays right
        np.testing.assert_array_equal(graph_dec.host_left, want_state["budget"])
        for mode, dec in eager.items():
            toks = dec.run_burst(mode=mode, device_exit=True)
            assert drained(toks) == want_tokens, f"{name} burst {n} {mode}"
            assert dec.last_rounds == want_rounds, f"{name} {mode}"
            assert_same_state(state(dec), want_state, f"{name} burst {n} ({mode})")
    assert graph.last_exit_reason in ("idle", "m_max")


def test_all_slots_finished_at_round_three_of_thirty_two_runs_three_rounds():
    case = {"batch": 3, "k": 3, "budgets": [12, 12, 12], "accept": 1.0, "p_min": 0.0}  # k + 1 = 4 tokens a round
    dec = build("numpy", case, 32)
    graph = BurstGraph(dec, device_exit=True)
    tokens = graph.run()
    assert graph.last_rounds == 3 and graph.last_exit_reason == "idle"
    assert [len(t) for t in tokens] == [12, 12, 12]
    assert dec.accept_counters()[:, 1].tolist() == [3, 3, 3]  # rounds that committed
    # idle now: the next burst runs no round
    assert graph.run().total == 0 and graph.last_rounds == 0


def test_fixed_m_graph_of_the_same_decoder_runs_every_round():
    case = {"batch": 3, "k": 3, "budgets": [12, 12, 12], "accept": 1.0, "p_min": 0.0}
    graph = BurstGraph(build("numpy", case, 32))
    assert graph.run().total == 36
    assert graph.last_rounds == 32 and graph.last_exit_reason is None and not graph.device_exit


@pytest.mark.parametrize("stop_after", [1, 2, 5])
@pytest.mark.parametrize("name", ["ragged_budgets", "eos_mid_round", "ngram", "separate_kernels", "sampling"])
def test_a_stop_request_mid_burst_ends_it_after_that_round(name, stop_after):
    case = dict(CASES[name], budgets=[None] * CASES[name]["batch"], eos_at=None)  # only the flag ends it early
    want_tokens, want_rounds, want_state = truncated_oracle("numpy", case, M_MAX, stop_after=stop_after)
    assert want_rounds == stop_after
    dec = build("numpy", case, M_MAX)
    stop_during_round(dec, stop_after)
    graph = BurstGraph(dec, device_exit=True)
    got = graph.run()
    assert graph.last_rounds == stop_after and graph.last_exit_reason == "flag"
    assert drained(got) == want_tokens
    assert_same_state(state(dec), want_state, name)
    # the request was answered: the next burst runs all M_max rounds, from the truncated state
    nxt = graph.run()
    assert graph.last_rounds == M_MAX
    for b, row in enumerate(drained(nxt)):
        assert row, f"slot {b} committed nothing after the stop"
    eager = build("numpy", case, M_MAX)
    stop_during_round(eager, stop_after)
    assert drained(eager.run_burst(mode="pre_issued", device_exit=True)) == want_tokens
    assert eager.last_rounds == stop_after and eager.last_exit_reason == "flag"


def test_a_stop_requested_before_launch_gives_a_zero_round_burst_that_changes_nothing():
    case = CASES["ragged_budgets"]
    dec = build("numpy", case, M_MAX)
    twin = build("numpy", case, M_MAX)  # never stopped
    graph, twin_graph = BurstGraph(dec, device_exit=True), BurstGraph(twin, device_exit=True)
    before = state(dec)
    dec.request_stop()
    tokens = graph.run()
    assert tokens.total == 0 and graph.last_rounds == 0 and graph.last_exit_reason == "flag"
    assert_same_state(state(dec), before, "zero-round burst")
    np.testing.assert_array_equal(dec.host_pos, before["pos_ctr"])
    # answered once: from here the stopped decoder runs exactly as the one never stopped
    for _ in range(3):
        assert drained(graph.run()) == drained(twin_graph.run())
        assert graph.last_rounds == twin_graph.last_rounds
    # two requests before one burst are answered by that one burst
    dec.request_stop()
    dec.request_stop()
    assert graph.run().total == 0 and graph.last_rounds == 0
    graph.run()
    assert graph.last_exit_reason != "flag"


def test_greedy_tokens_of_device_exit_bursts_with_slot_churn_equal_the_reference():
    case = {"batch": 4, "k": 3, "budgets": [7, 19, 3, 30]}
    dec = build("numpy", case, M_MAX)
    graph = BurstGraph(dec, device_exit=True, gapless=True)
    prompts = prefill(dec, case)  # the prompts build() wrote, written again (a fresh sequence per slot)
    out = [[] for _ in prompts]
    for n in range(12):
        graph.replay()
        for b, t in enumerate(graph.drain()):
            out[b] += t.tolist()
        assert graph.last_rounds <= M_MAX
        done = [b for b in range(4) if dec.host_left[b] == 0]
        for b in done:
            assert out[b] == greedy_reference(prompts[b], len(out[b]), VOCAB), f"slot {b} after burst {n}"
            assert len(out[b]) == case["budgets"][b]
        if done:
            new = prefill(dec, case, slots=set(done), seed_shift=n + 1)
            for b in done:
                prompts[b], out[b] = new[b], []


# ---------------------------------------------------------------------------- where it is refused


def test_device_exit_takes_false_true_or_auto():
    dec = build("numpy", CASES["ragged_budgets"], 2)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="device_exit must be one of"):
            BurstGraph(dec, device_exit=bad)
    with pytest.raises(TypeError, match="device_exit must be a bool"):
        dec.enqueue_burst(device_exit="auto")
    with pytest.raises(RuntimeError, match="request_stop needs a device-exit graph"):
        BurstGraph(dec).request_stop()


def test_unavailable_device_exit_is_refused_or_falls_back_to_fixed_m(monkeypatch):
    from graphburst import capture

    reason = "driver CUDA version 12020 is older than 12040 (conditional WHILE nodes)"
    monkeypatch.setattr(capture, "device_exit_refusal", lambda dec: (reason, reason))
    dec = build("numpy", CASES["ragged_budgets"], M_MAX)
    with pytest.raises(ValueError, match="12020 is older"):
        BurstGraph(dec, device_exit=True)
    graph = BurstGraph(dec, device_exit="auto")
    assert not graph.device_exit and graph.device_exit_probe == reason
    assert graph.info()["device_exit"] is False and graph.info()["device_exit_probe"] == reason
    graph.run()
    assert graph.last_rounds == M_MAX  # the fixed-M graph ran


def test_torch_models_on_the_gpu_need_the_torch_probe_too(monkeypatch):
    from graphburst import capture

    torch_model = types.SimpleNamespace(capture_api="torch")
    fake = types.SimpleNamespace(backend=types.SimpleNamespace(is_gpu=True, device_id=0), target=torch_model,
                                 draft=types.SimpleNamespace())
    monkeypatch.setattr(conditional, "probe", lambda device_id: (True, "trial WHILE graph ran"))
    monkeypatch.setattr(capture, "_torch_probe", lambda device_id: (False, "temporaries served from pool [0, 0]"))
    refusal, found = capture.device_exit_refusal(fake)
    assert refusal == found == "trial WHILE graph ran; torch: temporaries served from pool [0, 0]"
    monkeypatch.setattr(capture, "_torch_probe", lambda device_id: (True, "in the graph's pool"))
    refusal, found = capture.device_exit_refusal(fake)
    assert refusal is None and found == "trial WHILE graph ran; torch: in the graph's pool"
    # a cupy pair never runs the torch probe
    monkeypatch.setattr(capture, "_torch_probe", lambda device_id: pytest.fail("torch probe for a cupy pair"))
    cupy_pair = types.SimpleNamespace(backend=fake.backend, target=types.SimpleNamespace(),
                                      draft=types.SimpleNamespace())
    assert capture.device_exit_refusal(cupy_pair) == (None, "trial WHILE graph ran")


def test_the_probe_reports_what_is_missing_instead_of_raising():
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        ok, why = conditional.probe(0)
        assert not ok and "cuda-python (cuda.bindings) is not installed" in why
    else:
        pytest.skip("cuda.bindings is installed here: test_device_exit_gpu.py reports the probe")


def test_a_device_exit_graph_goes_stale_on_a_rebind_and_recaptures():
    from graphburst.guard import StaleGraphError

    case = CASES["ragged_budgets"]
    dec, twin = build("numpy", case, M_MAX), build("numpy", case, M_MAX)
    graph, twin_graph = BurstGraph(dec, device_exit=True), BurstGraph(twin, device_exit=True)
    assert drained(graph.run()) == drained(twin_graph.run())
    layer = dec.target.cache.layers[0]
    layer.length = layer.length.copy()
    with pytest.raises(StaleGraphError, match=r"KVLayer\.length"):
        graph.replay()
    graph.recapture()
    assert graph.device_exit and graph.captures == 2
    for _ in range(2):
        assert drained(graph.run()) == drained(twin_graph.run())
        assert graph.last_rounds == twin_graph.last_rounds
