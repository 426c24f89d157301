"""Sampling through the whole burst: losslessness, determinism across engines and batch
positions, greedy equivalence, validation. Numpy here; the same tests on cupy are
gpu-marked (``backend`` fixture).

The chi-square test computes the expected distribution of the first three tokens on the
host, from the stub target's own definition (greedy oracle -> ``stub_logits`` ->
``probs_from_logits``), never from a burst, and checks the burst's empirical joint
distribution against it; the same counts against a slightly wrong temperature must fail.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import sampling_stats as st
from graphburst.kernels import reference
from graphburst.kernels import sampling_ref as sr
from graphburst.engine.decoder import SpecDecoder
from graphburst.capture import BurstGraph
from graphburst.kernels.digest import greedy_reference
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop
from graphburst.models.stubs import LOGIT_SPREAD, TARGET_SALT, stub_pair

F32 = np.float32


def target_probs(prefix, vocab, peak, temperature, top_k=0, top_p=1.0):
    """The stub target's distribution of the token after ``prefix``, from its definition."""
    g = np.array([[greedy_reference(prefix, 1, vocab)[0]]], np.int32)
    logits = np.zeros((1, 1, vocab), F32)
    reference.stub_logits(g, np.array([len(prefix)], np.int32), logits, pos_offset=0, salt=TARGET_SALT,
                          spread=LOGIT_SPREAD, peak=peak)
    out = np.zeros_like(logits)
    sr.probs_from_logits(logits, np.array([temperature], F32), np.array([top_k], np.int32),
                         np.array([top_p], F32), out)
    return out[0, 0].astype(np.float64)


def joint_expected(prompt, vocab, peak, temperature, n_tokens):
    """P(first n_tokens = t) for every t in vocab**n_tokens, from the chain rule."""
    cells = {}
    for toks in itertools.product(range(vocab), repeat=n_tokens):
        prob = 1.0
        for i in range(n_tokens):
            prob *= target_probs(list(prompt) + list(toks[:i]), vocab, peak, temperature)[toks[i]]
        cells[toks] = prob
    return cells


def pooled_chi2(observed: dict, expected: dict, n: int) -> tuple[float, str]:
    """Chi-square p-value with every cell of expected count < 5 pooled into one."""
    stat, df, small_obs, small_exp = 0.0, -1, 0, 0.0
    for cell, p in expected.items():
        e, o = n * p, observed.get(cell, 0)
        if e < 5:
            small_obs, small_exp = small_obs + o, small_exp + e
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if small_exp > 0:
        stat += (small_obs - small_exp) ** 2 / small_exp
        df += 1
    outside = sum(o for c, o in observed.items() if c not in expected)
    if outside:
        return 0.0, f"{outside} sequences outside the vocabulary"
    return st.chi2_sf(stat, df), f"chi2 = {stat:.1f}, df = {df}, n = {n}"


def sampled_tokens(backend, n, *, vocab, peak, temperature, engine="graph", k=2, m=3, n_tokens=3, p_min=0.3):
    target, draft = stub_pair(n, vocab, [True, False, True], [True], 32, accept_prob=0.6, p_min=p_min, seed=5,
                              backend=backend, logit_peak=peak)
    dec = SpecDecoder(target, draft, k=k, m_rounds=m, sampling=True)
    seeds = (np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(0x5DEECE66D)
    dec.prefill([[1, 2, 3]] * n, max_new_tokens=n_tokens, temperature=temperature, seed=[int(s) for s in seeds])
    tokens = (BurstGraph(dec).run if engine == "graph" else dec.run_burst)()
    return [tuple(t.tolist()) for t in tokens], dec


def test_whole_burst_is_lossless(backend):
    """First three tokens (prefill draw, drafts accepted or replaced, breaks) follow p exactly."""
    vocab, peak, temperature = 4, 0.7, 1.0
    n = 12_000 if not backend.is_gpu else 200_000
    seqs, dec = sampled_tokens(backend, n, vocab=vocab, peak=peak, temperature=temperature)
    assert all(len(s) == 3 for s in seqs)
    acc = dec.accept_counters()
    assert 0 < acc[:, 0].sum() < acc[:, 1].sum() * dec.k  # accepts and rejections both happened
    observed = {}
    for s in seqs:
        observed[s] = observed.get(s, 0) + 1
    pval, info = pooled_chi2(observed, joint_expected([1, 2, 3], vocab, peak, temperature, 3), n)
    print(f"{backend.name}: p = {pval:.3g}, {info}")
    assert pval > st.ALPHA, info
    # The same counts must fail against a slightly different distribution: the test has power.
    wrong, info = pooled_chi2(observed, joint_expected([1, 2, 3], vocab, peak, temperature * 1.25, 3), n)
    assert wrong < st.ALPHA, f"a temperature 25% off passed: {info}"


PROMPT = [5, 9, 2, 7]
OTHERS = [([3], 0.0), ([8, 8, 1], 1.3), ([4, 4], 0.5)]


def run_engine(backend, engine, slot, others, *, bursts=2, batch=4, sampling=dict(temperature=1.5, top_p=0.95,
                                                                                  seed=2**63 + 11)):
    """The tokens of PROMPT at ``slot`` in a batch filled with ``others`` (prompt, temperature)."""
    target, draft = stub_pair(batch, 64, [True, False], [True, True], 96, accept_prob=0.7, p_min=0.1, seed=3,
                              backend=backend)
    dec = SpecDecoder(target, draft, k=3, m_rounds=2, sampling=True)
    prompts, temps, seeds = [None] * batch, [None] * batch, [None] * batch
    fill = iter(others)
    for b in range(batch):
        if b == slot:
            continue
        prompts[b], temps[b] = next(fill)
        seeds[b] = 1000 + b
    prompts[slot], temps[slot], seeds[slot] = PROMPT, sampling["temperature"], sampling["seed"]
    top_p = [sampling["top_p"] if b == slot else 1.0 for b in range(batch)]
    dec.prefill(prompts, temperature=temps, top_p=top_p, seed=seeds)
    out = []
    if engine in ("graph", "gapless"):
        graph = BurstGraph(dec, gapless=engine == "gapless")
        if engine == "gapless":
            graph.replay()
            graph.replay()
            out = graph.drain()[slot].tolist() + graph.drain()[slot].tolist()
        else:
            for _ in range(bursts):
                out += graph.run()[slot].tolist()
    else:
        for _ in range(bursts):
            out += dec.run_burst(mode=engine)[slot].tolist()
    return out


def test_same_seed_same_tokens_in_every_engine_and_slot(backend):
    want = run_engine(backend, "per_round_sync", 0, OTHERS)
    assert len(want) >= 6 and want != greedy_reference(PROMPT, len(want), 64)  # really sampled
    for engine, slot, others in [("pre_issued", 3, OTHERS[::-1]), ("graph", 1, [(o[0], 0.0) for o in OTHERS]),
                                 ("gapless", 2, [([1, 2, 3, 4, 5], 2.0)] * 3)]:
        assert run_engine(backend, engine, slot, others) == want, (engine, slot)
    other_seed = run_engine(backend, "graph", 0, OTHERS, sampling=dict(temperature=1.5, top_p=0.95, seed=12))
    assert other_seed != want


def test_temperature_zero_and_top_k_one_equal_greedy(backend):
    prompts = [[1, 2, 3], [40, 41], [7], [9, 9, 9, 9]]

    def run(sampling, **kw):
        target, draft = stub_pair(4, 300, [True, False, True], [True], 128, accept_prob=0.6, p_min=0.05, seed=1,
                                  backend=backend)
        dec = SpecDecoder(target, draft, k=3, m_rounds=3, sampling=sampling)
        dec.prefill(prompts, **kw)
        graph = BurstGraph(dec)
        out = [[] for _ in prompts]
        for _ in range(3):
            for b, t in enumerate(graph.run()):
                out[b] += t.tolist()
        return out, dec.accept_counters()

    greedy, acc = run(False)
    assert greedy == [greedy_reference(p, len(o), 300) for p, o in zip(prompts, greedy)]
    for kw in (dict(), dict(temperature=0.0, seed=5), dict(temperature=[1.5, 0.7, 3.0, 1.0], top_k=1, seed=9)):
        out, acc_s = run(True, **kw)
        assert out == greedy, kw
        assert np.array_equal(acc_s, acc), kw  # the same proposals, accepts and breaks


# ------------------------------------------------------------------ validation


def test_sampling_needs_models_that_support_it():
    target, draft = stub_pair(1, 10, 1, 1, 16, backend="numpy")
    type(draft).supports_sampling = property(lambda self: False)
    try:
        with pytest.raises(ValueError, match="draft StubDraft does not declare supports_sampling = True"):
            SpecDecoder(target, draft, k=2, m_rounds=1, sampling=True)
    finally:
        del type(draft).supports_sampling
    SpecDecoder(target, draft, k=2, m_rounds=1, sampling=True)


def test_prefill_validates_sampling_settings():
    target, draft = stub_pair(2, 10, 1, 1, 32, backend="numpy")
    greedy = SpecDecoder(target, draft, k=2, m_rounds=1)
    with pytest.raises(ValueError, match=r"temperature\[1\] = 0.5 needs sampling: build the decoder with sampling"):
        greedy.prefill([[1], [2]], temperature=[0.0, 0.5])
    greedy.prefill([[1], [2]], temperature=0.0, top_k=3, seed=4)  # greedy settings are fine anywhere
    target, draft = stub_pair(2, 10, 1, 1, 32, backend="numpy")
    dec = SpecDecoder(target, draft, k=2, m_rounds=1, sampling=True)
    for kw, exc, match in [(dict(top_p=[1.0, 0.0]), ValueError, r"top_p must be in \(0, 1\], got 0.0 \(slot 1\)"),
                           (dict(temperature=float("nan")), ValueError, r"temperature must be finite, got nan"),
                           (dict(temperature=-1.0), ValueError, r"temperature must be >= 0, got -1.0 \(slot 0\)"),
                           (dict(seed=[1, -2]), ValueError, r"seed must be in \[0, 2\*\*64\), got -2 \(slot 1\)"),
                           (dict(top_k=[1]), ValueError, r"top_k must be a scalar or have one entry per slot"),
                           (dict(top_k="3"), TypeError, r"top_k must be an int, got str '3'")]:
        with pytest.raises(exc, match=match):
            dec.prefill([[1], [2]], **kw)


def test_serve_loop_sampling_fields():
    target, draft = stub_pair(2, 50, 1, 1, 64, backend="numpy")
    greedy = ServeLoop(target, draft, k=2, m_rounds=2)
    with pytest.raises(ValueError, match=r"temperature 0.7 needs sampling, but this loop decodes greedily"):
        greedy.submit(Request([1, 2], 5, temperature=0.7))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        greedy.submit(Request([1, 2], 5, top_p=1.5))
    g = greedy.submit(Request([1, 2], 5, temperature=0.0, seed=3))
    greedy.run_until_idle()
    assert g.tokens == greedy_reference([1, 2], 5, 50)

    def serve(engine, reqs):
        target, draft = stub_pair(2, 50, 1, 1, 64, backend="numpy")
        loop = ServeLoop(target, draft, k=2, m_rounds=2, engine=engine, sampling=True)
        states = [loop.submit(r) for r in reqs]
        loop.run_until_idle()
        return states

    a = serve("graph", [Request([1, 2], 12, temperature=0.9, seed=77), Request([3], 4, temperature=0.5)])
    b = serve("per_round_sync", [Request([9, 9, 9], 3), Request([1, 2], 12, temperature=0.9, seed=77)])
    assert a[0].tokens == b[1].tokens and len(a[0].tokens) == 12
    assert a[1].sampling.seed is not None and a[1].sampling.temperature == 0.5  # a random seed was drawn
    assert b[0].tokens == greedy_reference([9, 9, 9], 3, 50)
