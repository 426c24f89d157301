"""Plain decoding (``draft=None``, ``k=0``): one token a round through the same burst, on numpy and (marked)
cupy. Held to the stub target's greedy oracle, to the sampled distribution computed from the stub's
definition, and to the device-exit rule (a burst ends at the round where its last slot finishes)."""

from __future__ import annotations

import numpy as np
import pytest
from test_sampling_burst import joint_expected, pooled_chi2

import sampling_stats as st
from graphburst.capture import BurstGraph
from graphburst.engine.decoder import SpecDecoder
from graphburst.engine.no_draft import NoDraft
from graphburst.kernels.digest import greedy_reference
from graphburst.models.stubs import StubTarget, stub_pair

VOCAB = 97


def target(backend, batch, capacity=128, *, peak=None, layers=(True, False, True)):
    return StubTarget(batch, VOCAB if peak is None else 4, list(layers), capacity, backend=backend, logit_peak=peak)


def prompts_for(rng, batch):
    return [rng.integers(0, VOCAB, int(rng.integers(1, 20))).tolist() for _ in range(batch)]


@pytest.mark.parametrize("batch", [1, 7, 19])
@pytest.mark.parametrize("engine", ["graph", "pre_issued", "per_round_sync", "unfused"])
def test_plain_bursts_equal_greedy(backend, rng, batch, engine):
    dec = SpecDecoder(target(backend, batch), None, k=0, m_rounds=5, fused=engine != "unfused")
    assert dec.plain and isinstance(dec.draft, NoDraft) and dec.k == 0
    prompts = prompts_for(rng, batch)
    budgets = [int(b) for b in rng.integers(1, 14, batch)]
    dec.prefill(prompts, max_new_tokens=budgets)
    run = BurstGraph(dec).run if engine == "graph" else (lambda: dec.run_burst(mode=engine.replace("unfused",
                                                                                                   "pre_issued")))
    out = [[] for _ in range(batch)]
    for _ in range(3):
        for b, toks in enumerate(run()):
            assert len(toks) <= 5  # one token a round
            out[b] += toks.tolist()
    assert [len(o) for o in out] == budgets
    assert out == [greedy_reference(p, n, VOCAB) for p, n in zip(prompts, budgets)]
    acc = dec.accept_counters()
    assert (acc[:, 0] == 0).all() and (acc[:, 1] == budgets).all()  # no drafts; one committing round a token
    np.testing.assert_array_equal(dec.positions(), [len(p) + n for p, n in zip(prompts, budgets)])


def test_plain_equals_speculative_greedy(backend, rng):
    """The same target decodes the same tokens with a draft (k=3) and without one."""
    prompts = prompts_for(rng, 4)
    outs = []
    for k in (0, 3):
        t, d = stub_pair(4, VOCAB, [True, False], [True], 160, accept_prob=0.7, backend=backend)
        dec = SpecDecoder(t, d if k else None, k=k, m_rounds=4)
        dec.prefill(prompts)
        graph = BurstGraph(dec)
        out = [[] for _ in prompts]
        for _ in range(6):
            for b, toks in enumerate(graph.run()):
                out[b] += toks.tolist()
        outs.append([o[:24] for o in out])
    assert outs[0] == outs[1]
    assert outs[0] == [greedy_reference(p, 24, VOCAB) for p in prompts]


def test_plain_sampling_follows_the_target(backend):
    """Temperature 1: the first three tokens (the prefill's draw committed in round 1, then one a round) follow p exactly; a
    temperature 25% off fails on the same counts."""
    n, peak, temperature = (12_000 if not backend.is_gpu else 200_000), 0.7, 1.0
    dec = SpecDecoder(target(backend, n, 32, peak=peak), None, k=0, m_rounds=3, sampling=True)
    seeds = (np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(0x5DEECE66D)
    dec.prefill([[1, 2, 3]] * n, max_new_tokens=3, temperature=temperature, seed=[int(s) for s in seeds])
    seqs = [tuple(t.tolist()) for t in BurstGraph(dec).run()]
    assert all(len(s) == 3 for s in seqs)
    observed = {}
    for s in seqs:
        observed[s] = observed.get(s, 0) + 1
    pval, info = pooled_chi2(observed, joint_expected([1, 2, 3], 4, peak, temperature, 3), n)
    assert pval > st.ALPHA, info
    wrong, info = pooled_chi2(observed, joint_expected([1, 2, 3], 4, peak, temperature * 1.25, 3), n)
    assert wrong < st.ALPHA, f"a temperature 25% off passed: {info}"


def test_plain_sampling_at_temperature_zero_is_greedy(backend, rng):
    prompts = prompts_for(rng, 5)
    dec = SpecDecoder(target(backend, 5), None, k=0, m_rounds=4, sampling=True, fields=True)
    dec.prefill(prompts, max_new_tokens=9, temperature=0.0, seed=3)
    graph = BurstGraph(dec)
    out = [[] for _ in prompts]
    for _ in range(3):
        for b, toks in enumerate(graph.run()):
            out[b] += toks.tolist()
    assert out == [greedy_reference(p, 9, VOCAB) for p in prompts]


def test_plain_device_exit_ends_at_the_last_slot(backend, rng):
    """With one token a round, a slot with budget n finishes at round n: a device-exit burst of M_max 16 over
    budgets up to 6 runs 6 rounds, and the tokens are the oracle's."""
    prompts = prompts_for(rng, 3)
    dec = SpecDecoder(target(backend, 3), None, k=0, m_rounds=16)
    dec.prefill(prompts, max_new_tokens=[2, 6, 4])
    graph = BurstGraph(dec, device_exit=True)
    out = graph.run()
    assert graph.last_rounds == 6 and graph.last_exit_reason == "idle"
    assert [t.tolist() for t in out] == [greedy_reference(p, n, VOCAB) for p, n in zip(prompts, [2, 6, 4])]


def test_plain_needs_k_zero_and_no_draft():
    t, d = stub_pair(2, VOCAB, 1, 1, 32, backend="numpy")
    with pytest.raises(ValueError, match="k=2 drafts per round need a draft model"):
        SpecDecoder(t, None, k=2, m_rounds=2)
    with pytest.raises(ValueError, match="k=0 decodes plainly and never calls the draft StubDraft"):
        SpecDecoder(t, d, k=0, m_rounds=2)
    with pytest.raises(TypeError, match="target object lacks the required member 'vocab'"):
        SpecDecoder(object(), None, k=0, m_rounds=2)
    with pytest.raises(TypeError, match="k must be an int"):
        SpecDecoder(t, None, k=0.0, m_rounds=2)
    with pytest.raises(RuntimeError, match="plain decoding has no draft steps"):
        NoDraft(t).draft_step(SpecDecoder(t, None, k=0, m_rounds=1).bufs, 0, None)
