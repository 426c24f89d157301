"""The logits processing fields through whole bursts (``SpecDecoder(..., sampling=True, fields=True)``).

At temperature 0 the speculative tokens must equal a plain host loop that applies transformers'
logits processors (and the plain presence/frequency rule) to the same stub target's logits one
token at a time and takes the argmax; the device counts must equal the committed tokens' counts;
a reused slot starts clean. Numpy here; the same tests on cupy are gpu-marked (``backend``).
"""

from __future__ import annotations

import numpy as np
import pytest

from graphburst.capture import BurstGraph
from graphburst.constants import NO_EOS
from graphburst.engine.decoder import SpecDecoder
from graphburst.models.stubs import stub_pair

from fields_reference import PEAK, VOCAB, host_decode, stub_target_logits

F32 = np.float32


FIELDS = [
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 0.7, "presence_penalty": 0.4},
    {"logit_bias": {3: 2.5, 17: -100.0, 40: 1.0}, "presence_penalty": -0.3},
    {"min_tokens": 6, "repetition_penalty": 1.2},
    {"ignore_eos": True, "frequency_penalty": 0.2},
    None,
]
PROMPTS = [[1, 2, 3, 4], [9], [5, 5, 5, 6, 7], [11, 12], [8, 8], [30, 31, 32]]


def build(backend, batch, *, k=3, m=3, engine_graph=False):
    target, draft = stub_pair(batch, VOCAB, [True, False, True], [True], 128, accept_prob=0.6, p_min=0.2, seed=4,
                              backend=backend, logit_peak=PEAK)
    return SpecDecoder(target, draft, k=k, m_rounds=m, sampling=True, fields=True)


def run(dec, bursts, graph=False):
    """Each slot's tokens over ``bursts`` bursts (None: until every slot is done, at most 40)."""
    out = [[] for _ in range(dec.batch)]
    g = BurstGraph(dec) if graph else None
    for _ in range(40 if bursts is None else bursts):
        if bursts is None and not (dec.host_left > 0).any():
            break
        tokens = g.run() if graph else dec.run_burst()
        for b in range(dec.batch):
            out[b] += [int(t) for t in tokens[b]]
    return out


def eos_of(prompt):
    return int(host_decode(prompt, 4, None)[3])  # a token greedy decoding emits: it matters


@pytest.mark.parametrize("graph", [False, True])
def test_greedy_fields_equal_a_host_loop_of_transformers_processors(backend, graph):
    """Temperature 0, every field, speculation on: the tokens are the one-token-at-a-time loop's."""
    if graph and not backend.is_gpu:
        pytest.skip("graph replay is the cupy path; the numpy backend replays the same calls")
    n = 24
    dec = build(backend, len(PROMPTS))
    eos = [eos_of(p) for p in PROMPTS]
    dec.prefill(PROMPTS, max_new_tokens=n, eos=eos, fields=FIELDS)
    got = run(dec, None, graph)
    changed = 0
    for b, (prompt, f) in enumerate(zip(PROMPTS, FIELDS)):
        want = host_decode(prompt, n, f, eos[b])
        assert got[b] == want, f"slot {b} {f}"
        changed += want != host_decode(prompt, n, None, eos[b])
    assert changed >= 4, "the fields changed too few sequences: the test would not see them ignored"
    acc = dec.accept_counters()
    assert acc[:, 0].sum() > 0  # drafts were accepted: speculation ran


def test_counts_are_the_committed_tokens(backend):
    """After several bursts: counts = the committed tokens, plus the pending token of a live slot."""
    dec = build(backend, len(PROMPTS))
    dec.prefill(PROMPTS, max_new_tokens=[10, 40, 40, 7, 40, 40], fields=FIELDS)
    got = run(dec, 3)
    counts = backend.to_host(dec.fields.counts, dec.stream)
    pend = backend.to_host(dec.bufs.pend, dec.stream)
    for b, toks in enumerate(got):
        want = np.bincount(np.asarray(toks, np.int64), minlength=VOCAB)
        if dec.host_left[b] > 0:
            want[pend[b]] += 1
        np.testing.assert_array_equal(counts[b], want, err_msg=f"slot {b}")
    assert (dec.host_left == 0).sum() == 2 and (dec.host_left > 0).sum() == 4


def test_reused_slot_starts_clean(backend):
    """A slot refilled while others run: its counts and prompt marks are its new request's only."""
    dec = build(backend, 3)
    first = [[1, 2, 3, 4], [9, 9, 9], [20, 21]]
    f = {"repetition_penalty": 2.0, "frequency_penalty": 0.5}
    dec.prefill(first, max_new_tokens=[6, 30, 30], fields=[f, f, f])
    run(dec, 2)
    assert dec.host_left[0] == 0
    new = [40, 41, 1]
    dec.prefill([new, None, None], max_new_tokens=12, fields={"presence_penalty": 1.0})
    got = run(dec, 5)
    assert got[0] == host_decode(new, 12, {"presence_penalty": 1.0})
    seen = backend.to_host(dec.fields.prompt_seen, dec.stream)
    assert np.flatnonzero(seen[0]).tolist() == sorted(set(new))
    counts = backend.to_host(dec.fields.counts, dec.stream)
    np.testing.assert_array_equal(counts[0], np.bincount(got[0], minlength=VOCAB))


def test_chunked_prompt_marks_every_chunk(backend):
    """A prompt prefilled in two chunks penalizes the tokens of both (repetition), like a whole one."""
    dec = build(backend, 2)
    prompt = [3, 4, 5, 6, 7, 8, 9]
    f = {"repetition_penalty": 3.0}
    dec.prefill([prompt[:4], None], final=False)
    dec.prefill([prompt[4:], prompt], start=[4, 0], max_new_tokens=10, fields=[f, f])
    got = run(dec, None)
    want = host_decode(prompt, 10, f)
    assert got[0] == want and got[1] == want


def test_fields_need_the_flag_and_sampling():
    target, draft = stub_pair(2, VOCAB, [True], [True], 64, backend="numpy")
    with pytest.raises(ValueError, match="sampling=True"):
        SpecDecoder(target, draft, k=2, m_rounds=2, fields=True)
    dec = SpecDecoder(target, draft, k=2, m_rounds=2, sampling=True)
    assert dec.fields is None
    with pytest.raises(ValueError, match=r"min_p\[0\] = 0.1 needs logits processing"):
        dec.prefill([[1], None], fields={"min_p": 0.1})
    dec = SpecDecoder(target, draft, k=2, m_rounds=2, sampling=True, fields=True)
    with pytest.raises(ValueError, match="logit_bias"):
        dec.prefill([[1], None], fields={"logit_bias": {VOCAB: 1.0}})
    with pytest.raises(ValueError, match="presence_penalty"):
        dec.prefill([[1], [2]], fields=[None, {"presence_penalty": 3}])
    with pytest.raises(TypeError, match="non-final chunk"):
        dec.prefill([[1], None], final=False, fields={"min_p": 0.1})
    with pytest.raises(TypeError, match="fields must be a bool"):
        SpecDecoder(target, draft, k=2, m_rounds=2, sampling=True, fields="yes")


STAT_FIELDS = {"repetition_penalty": 1.6, "presence_penalty": 0.4, "frequency_penalty": 0.3,
               "logit_bias": {1: 0.5}, "min_p": 0.12}


def fields_probs(prompt, generated, fields, *, vocab, peak, temperature):
    """The distribution of the token after ``prompt + generated`` with ``fields``, from the
    definitions: the stub's logits, the fields' twin over that history, the probability twin."""
    from graphburst.kernels import fields_ref
    from graphburst.kernels import sampling_ref as sr
    from graphburst.sampling.params import check_fields

    f = check_fields(**fields, vocab=vocab)
    logits = stub_target_logits(list(prompt) + list(generated), vocab, peak)[None, None].copy()
    counts = np.bincount(np.asarray(generated, np.int64), minlength=vocab).astype(np.int32)[None]
    seen = np.zeros((1, vocab), np.uint8)
    seen[0, prompt] = 1
    nb = len(f["logit_bias"])
    ids = np.array([[t for t, _ in f["logit_bias"]]], np.int32).reshape(1, nb)
    val = np.array([[v for _, v in f["logit_bias"]]], F32).reshape(1, nb)

    def one(v, dt):
        return np.array([v], dt)

    fields_ref.apply_fields(logits, np.zeros((1, 1), np.int32), one(len(prompt) + len(generated) - 1, np.int32),
                            counts, seen, one(len(prompt), np.int32), one(NO_EOS, np.int32), one(0, np.int32),
                            one(f["presence_penalty"], F32), one(f["frequency_penalty"], F32),
                            one(f["repetition_penalty"], F32), ids, val, one(nb, np.int32), step=0)
    out = np.zeros_like(logits)
    sr.probs_from_logits(logits, one(temperature, F32), one(0, np.int32), one(1.0, F32), out,
                         min_p=one(f["min_p"], F32))
    return out[0, 0].astype(np.float64)


def test_whole_burst_with_fields_is_lossless(backend):
    """Temperature 1 with every field of STAT_FIELDS: the first three tokens (prefill draw, drafts
    accepted or replaced) follow the processed p exactly; the same counts fail against p without the fields."""
    import itertools

    import sampling_stats as st
    from test_sampling_burst import pooled_chi2

    vocab, peak, temperature, prompt = 4, 0.7, 1.0, [1, 2, 3]
    n = 12_000 if not backend.is_gpu else 200_000
    target, draft = stub_pair(n, vocab, [True, False, True], [True], 32, accept_prob=0.6, p_min=0.3, seed=5,
                              backend=backend, logit_peak=peak)
    dec = SpecDecoder(target, draft, k=2, m_rounds=3, sampling=True, fields=True)
    seeds = (np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(0x5DEECE66D)
    dec.prefill([prompt] * n, max_new_tokens=3, temperature=temperature, seed=[int(s) for s in seeds],
                fields=STAT_FIELDS)
    tokens = (BurstGraph(dec).run if backend.is_gpu else dec.run_burst)()
    seqs = [tuple(t.tolist()) for t in tokens]
    assert all(len(s) == 3 for s in seqs)
    acc = dec.accept_counters()
    assert 0 < acc[:, 0].sum() < acc[:, 1].sum() * dec.k  # accepts and rejections both happened
    observed = {}
    for s in seqs:
        observed[s] = observed.get(s, 0) + 1

    def joint(fields):
        cells = {}
        for toks in itertools.product(range(vocab), repeat=3):
            prob = 1.0
            for i in range(3):
                prob *= fields_probs(prompt, toks[:i], fields, vocab=vocab, peak=peak,
                                     temperature=temperature)[toks[i]]
            cells[toks] = prob
        return cells

    pval, info = pooled_chi2(observed, joint(STAT_FIELDS), n)
    print(f"{backend.name}: p = {pval:.3g}, {info}")
    assert pval > st.ALPHA, info
    wrong, info = pooled_chi2(observed, joint({}), n)
    assert wrong < st.ALPHA, f"the distribution without the fields passed: {info}"
    wrong, info = pooled_chi2(observed, joint({**STAT_FIELDS, "min_p": 0.0}), n)
    assert wrong < st.ALPHA, f"the distribution without min_p passed: {info}"
