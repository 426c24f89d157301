"""Decoders, cases and the truncated fixed-M oracle shared by the device-exit tests (CPU and GPU).

The oracle of a device-exit burst is a chain of one-round bursts of a decoder built the same
way with ``m_rounds=1``: a burst of r rounds leaves the state r one-round bursts leave, so the
device-exit burst's tokens are theirs concatenated, and its round count is how many of them ran
before no slot had budget left, ``M_max`` was reached, or the stop request came.
"""

from __future__ import annotations

import numpy as np

from graphburst import SpecDecoder, stub_pair
from graphburst.kernels.digest import greedy_reference
from graphburst.models.ngram import NgramDraft
from graphburst.models.stubs import StubTarget

VOCAB = 32003
CAPACITY = 4096


def prompts_for(batch, seed=0, repeat=False):
    """Ragged prompts; ``repeat``: each a short pattern repeated (the n-gram draft then accepts)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batch):
        n = int(rng.integers(1, 24))
        row = rng.integers(0, VOCAB, n).tolist()
        out.append((row * 4)[: 4 * n] if repeat else row)
    return out


def build(backend, case: dict, m_rounds: int) -> SpecDecoder:
    """A decoder for ``case`` (see CASES) with ``m_rounds`` rounds a burst, prefilled."""
    batch, k = case["batch"], case["k"]
    if case.get("draft") == "ngram":
        target = StubTarget(batch, VOCAB, [True, False, True], CAPACITY, backend=backend)
        draft = NgramDraft(batch, VOCAB, CAPACITY, n_min=1, n_max=3, backend=backend)
    else:
        target, draft = stub_pair(batch, VOCAB, [True, False, True], [True, False], CAPACITY,
                                  accept_prob=case.get("accept", 0.7), p_min=case.get("p_min", 0.05), seed=3,
                                  backend=backend, logit_peak=0.8 if case.get("sampling") else None)
    dec = SpecDecoder(target, draft, k=k, m_rounds=m_rounds, fused=case.get("fused", True),
                      sampling=bool(case.get("sampling")))
    prefill(dec, case)
    return dec


def prefill(dec, case, slots=None, seed_shift=0):
    batch = case["batch"]
    prompts = prompts_for(batch, seed=case.get("seed", 0) + seed_shift, repeat=case.get("draft") == "ngram")
    budgets = case.get("budgets")
    eos = None
    if case.get("eos_at") is not None:  # slot b stops on the token its greedy output has at eos_at[b]
        eos = [greedy_reference(p, at + 1, VOCAB)[at] if at is not None else None
               for p, at in zip(prompts, case["eos_at"])]
    extra = {}
    if case.get("sampling"):
        extra = {"temperature": [0.0 if b % 2 else 0.9 for b in range(batch)], "seed": [1000 + b for b in range(batch)]}
    idle = case.get("idle", ())  # slots never prefilled: idle (budget 0) throughout
    rows = [prompts[b] if (slots is None or b in slots) and b not in idle else None for b in range(batch)]
    dec.prefill(rows, max_new_tokens=budgets, eos=eos, **extra)
    return prompts


#: ragged batches, budgets, stop tokens mid-round, unfused rounds, the n-gram draft, sampling
CASES = {
    "ragged_budgets": {"batch": 5, "k": 3, "budgets": [5, 17, 1, 40, 9]},
    "eos_mid_round": {"batch": 4, "k": 4, "budgets": [60, 60, 60, 60], "eos_at": [2, 9, None, 21]},
    "unbounded_one_idle": {"batch": 3, "k": 2, "budgets": [None, 5, 7], "idle": [1]},
    "separate_kernels": {"batch": 4, "k": 3, "budgets": [3, 30, 12, 8], "fused": False},
    "all_accept": {"batch": 2, "k": 3, "budgets": [12, 12], "accept": 1.0, "p_min": 0.0},
    "ngram": {"batch": 3, "k": 4, "budgets": [30, 11, 50], "draft": "ngram"},
    "sampling": {"batch": 4, "k": 2, "budgets": [6, 20, 13, 9], "sampling": True},
}


def state(dec) -> dict:
    """Everything a burst leaves that the next one reads (scratch such as vtok is reseeded)."""
    bufs, stream = dec.bufs, dec.stream
    out = {name: dec.backend.to_host(getattr(bufs, name), stream) for name in ("pos_ctr", "pend", "budget", "acc",
                                                                              "eos")}
    for role in ("target", "draft"):
        out[f"{role}_lengths"] = getattr(dec, role).cache.lengths(stream)
    return out


def assert_same_state(got: dict, want: dict, what: str) -> None:
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=f"{what}: {name}")


def truncated_oracle(backend, case, m_max, *, stop_after=None, bursts_before=0):
    """(tokens per slot, rounds, state) of one device-exit burst, from one-round bursts.

    ``stop_after``: the host asks for a stop during round ``stop_after`` (1-based), so the
    burst ends after it. ``bursts_before``: device-exit bursts of ``m_max`` rounds run first
    (each as the same chain), so later bursts start from a carried state.
    """
    one = build(backend, case, 1)
    for _ in range(bursts_before):
        _chain(one, m_max, None)
    tokens, rounds = _chain(one, m_max, stop_after)
    return tokens, rounds, state(one)


def _chain(one, m_max, stop_after):
    tokens = [[] for _ in range(one.batch)]
    rounds = 0
    while rounds < m_max and (one.host_left > 0).any() and (stop_after is None or rounds < stop_after):
        for b, t in enumerate(one.run_burst()):
            tokens[b] += t.tolist()
        rounds += 1
    return tokens, rounds


def stop_during_round(dec, n: int) -> None:
    """Make ``dec`` ask for a stop while its n-th verify of a burst is enqueued (host-run bursts only:
    numpy, or eager). Set before the program is built: the calls bind ``target.verify``."""
    verify = dec.target.verify
    calls = {"n": 0}

    def counted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            dec.request_stop()
        return verify(*args, **kwargs)

    dec.target.verify = counted


def check_held_stops(backend, m_max: int) -> None:
    """Three bursts queued behind a stop request (``hold_stops``, depth 3) all run zero rounds and
    change nothing; a request made after the answer holds the next burst too; once answered, bursts
    run all ``m_max`` rounds with the tokens of a decoder never stopped."""
    from graphburst.capture import BurstGraph

    case = CASES["ragged_budgets"]
    case = dict(case, budgets=[None] * case["batch"], eos_at=None)  # only the flag ends a burst early
    dec, twin = build(backend, case, m_max), build(backend, case, m_max)
    graph = BurstGraph(dec, device_exit=True, hold_stops=True, gapless=True, depth=3)
    twin_graph = BurstGraph(twin, device_exit=True)
    before = state(dec)
    graph.request_stop()
    assert dec.stop_pending and graph.hold_stops
    for _ in range(3):
        graph.replay()
    for _ in range(3):
        assert graph.drain().total == 0 and graph.last_rounds == 0 and graph.last_exit_reason == "flag"
    assert_same_state(state(dec), before, "three zero-round bursts")
    graph.answer_stop()
    assert not dec.stop_pending
    graph.request_stop()  # made after the answer: pending again, answered by the next answer only
    assert dec.stop_pending and graph.run().total == 0
    graph.answer_stop()
    for _ in range(2):
        assert [t.tolist() for t in graph.run()] == [t.tolist() for t in twin_graph.run()]
        assert graph.last_rounds == m_max
