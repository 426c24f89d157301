"""Prompt-lookup (n-gram) drafting: the search's spec, its twin, the kernel, the drafter in bursts.

The search is stated plainly in ``ngram_ref.ngram_match`` (hand cases below); the twin
``ngram_search`` computes it the kernel's way and is held equal to the spec on random
histories; the CUDA kernels are held bit-exact to the twins (gpu). In bursts the drafter
can never change a token: greedy output equals the target's own greedy decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

from graphburst import NgramDraft, SpecDecoder, StubTarget, greedy_reference
from graphburst.capture import BurstGraph
from graphburst.constants import NGRAM_MAX, NO_PREFILL, PLACEHOLDER_TOKEN, UNBOUNDED_BUDGET
from graphburst.kernels import reference
from graphburst.kernels.ngram_ref import ngram_match
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop

VOCAB = 5  # a small vocabulary: the stub target's hashed tokens then repeat, so drafts are found and accepted


# ---------------------------------------------------------------------- the spec, by hand

@pytest.mark.parametrize("history, n_min, n_max, k, want", [
    ([1, 2, 3, 4], 1, 3, 4, []),  # no match: the last token never occurred before
    ([], 1, 3, 4, []),  # no history
    ([7], 1, 3, 4, []),  # one token: nothing earlier
    ([5, 6, 9, 9, 9, 5], 1, 1, 3, [6, 9, 9]),  # a match at the very start
    ([5, 6, 9, 9, 9, 5, 6], 2, 2, 2, [9, 9]),  # a 2-gram at the very start
    ([1, 2, 0, 1, 3, 0, 1, 4, 0, 1], 2, 2, 1, [4]),  # several matches: the most recent wins
    ([1, 2, 0, 1, 3, 0, 1, 4, 0, 1], 1, 1, 1, [4]),
    ([8, 1, 2, 5, 1, 2, 6, 3, 2], 1, 3, 2, [6, 3]),  # n=3, n=2 fail; the most recent 1-gram "2"
    ([8, 1, 2, 5, 3, 2, 6, 1, 2], 1, 3, 2, [5, 3]),  # the longer match beats a more recent shorter one
    ([4, 4, 4, 4], 2, 2, 3, [4]),  # overlapping: the window at 1 overlaps the suffix, runs into the end
    ([3, 5, 3, 5, 3], 2, 2, 4, [5, 3]),  # overlapping 2-gram [3, 5, 3]: most recent at 1
    ([3, 5, 3, 5, 3], 3, 3, 4, [5, 3]),  # ... as a 3-gram
    ([1, 2, 1, 2], 3, 8, 4, []),  # n_max longer than the history; 3-gram [2, 1, 2] never occurred
    ([1, 2, 1, 2], 2, 8, 4, [1, 2]),  # n_max > history, n=2 matches at 0 and runs into the end
    ([9, 1, 2, 9], 1, 4, 8, [1, 2, 9]),  # a match that runs into the end of the history (pending token)
    ([9, 1, 2, 9], 2, 4, 8, []),  # n_min excludes the only match
])
def test_spec_hand_cases(history, n_min, n_max, k, want):
    assert ngram_match(history, n_min, n_max, k) == want


def brute(history, n_min, n_max, k):
    """A second, literal reading of the rule: every (n, start) pair, best by (n, start)."""
    h, length, best = list(history), len(history), None
    for n in range(n_min, n_max + 1):
        for i in range(0, length - n):
            if h[i:i + n] == h[length - n:] and (best is None or (n, i) > best):
                best = (n, i)
    return [] if best is None else h[best[0] + best[1]: best[0] + best[1] + k]


def test_spec_matches_brute_force(rng):
    for _ in range(400):
        h = rng.integers(0, int(rng.integers(1, 5)), int(rng.integers(0, 30))).tolist()
        lo = int(rng.integers(1, 5))
        hi = int(rng.integers(lo, 8))
        k = int(rng.integers(1, 6))
        assert ngram_match(h, lo, hi, k) == brute(h, lo, hi, k), (h, lo, hi, k)


# ---------------------------------------------------------------------- the kernel's inputs and outputs

def search_inputs(rng, batch, k, capacity, alphabet=3, poison=True):
    """Random search inputs: ragged positions (0, 1, n_max - 1, capacity - 1, random), idle
    slots, per-slot n ranges, a history with poison past each position."""
    pos = rng.integers(0, capacity, batch).astype(np.int32)
    special = [0, 1, 2, 3, capacity - 1, capacity - 2]
    pos[: min(batch, len(special))] = special[: min(batch, len(special))]
    hist = rng.integers(0, alphabet, (batch, capacity)).astype(np.int32)
    if poison:
        for b in range(batch):
            hist[b, pos[b]:] = rng.integers(-7, 1000, capacity - pos[b])  # stale entries: never read
    lo = rng.integers(1, 4, batch).astype(np.int32)
    hi = np.minimum(lo + rng.integers(-1, 6, batch), NGRAM_MAX + 2).astype(np.int32)  # some hi < lo, some clipped
    budget = np.where(rng.random(batch) < 0.15, 0, rng.choice([1, 5, UNBOUNDED_BUDGET], batch)).astype(np.int32)
    vtok = np.full((batch, k + 1), PLACEHOLDER_TOKEN, np.int32)
    vtok[:, 0] = rng.integers(0, alphabet, batch)
    outs = dict(hist_len=np.full(batch, -5, np.int32), draft_tok=np.full((batch, k), 77, np.int32),
                draft_conf=np.full((batch, k), 9.0, np.float32), brk=np.full((batch, 2), 3, np.int32))
    return dict(vtok=vtok, pos_ctr=pos, budget=budget, n_min=lo, n_max=hi, hist=hist, **outs)


ORDER = ("vtok", "pos_ctr", "budget", "n_min", "n_max", "hist", "hist_len", "draft_tok", "draft_conf", "brk")


def run_search(ops, arrays, write_vtok, stream=None):
    ops.ngram_search(*(arrays[n] for n in ORDER), write_vtok=write_vtok, stream=stream)


def test_twin_equals_spec_and_writes_the_history(rng):
    batch, k, cap = 40, 5, 24
    inp = search_inputs(rng, batch, k, cap)
    before = {n: a.copy() for n, a in inp.items()}
    run_search(reference, inp, write_vtok=True)
    for b in range(batch):
        p = int(before["pos_ctr"][b])
        live = before["budget"][b] > 0
        want = []
        if live:
            history = list(before["hist"][b, :p]) + [int(before["vtok"][b, 0])]
            want = ngram_match(history, max(int(before["n_min"][b]), 1), min(int(before["n_max"][b]), NGRAM_MAX), k)
        nv = len(want)
        assert inp["brk"][b].tolist() == [nv, int(nv < k)]
        assert inp["draft_tok"][b].tolist() == want + [PLACEHOLDER_TOKEN] * (k - nv)
        assert inp["vtok"][b, 1:].tolist() == inp["draft_tok"][b].tolist()
        assert inp["draft_conf"][b].tolist() == [1.0] * nv + [0.0] * (k - nv)
        if live:
            end = min(p + 1 + nv, cap)
            assert inp["hist"][b, :end].tolist() == history + want[: end - p - 1]
            assert (inp["hist"][b, end:] == before["hist"][b, end:]).all()
            assert inp["hist_len"][b] == end
        else:  # an idle slot writes nothing but its break
            assert (inp["hist"][b] == before["hist"][b]).all() and inp["hist_len"][b] == -5


def as_backend(backend, arrays):
    """Device copies of ``arrays``, uploaded on a new stream the kernel then runs on."""
    stream = backend.new_stream()
    return {n: backend.to_device(a, stream) for n, a in arrays.items()}, stream


def assert_same(backend, got, want, stream):
    for name, w in want.items():
        g = backend.to_host(got[name], stream)
        assert g.dtype == w.dtype and (g == w).all(), name


@pytest.mark.parametrize("batch", [1, 7, 19, 257])
@pytest.mark.parametrize("write_vtok", [True, False])
def test_search_kernel_equals_twin(backend, rng, batch, write_vtok):
    for k, cap, alphabet in ((1, 5, 2), (4, 37, 3), (7, 700, 2), (64, 1300, 5)):
        inp = search_inputs(rng, batch, k, cap, alphabet)
        dev, stream = as_backend(backend, inp)
        run_search(reference, inp, write_vtok)
        run_search(backend.ops, dev, write_vtok, stream)
        assert_same(backend, dev, inp, stream)


@pytest.mark.parametrize("batch", [1, 7, 19, 257])
def test_prefill_append_logits_kernels_equal_twins(backend, rng, batch):
    k, cap, p_max, vocab = 6, 50, 45, 3001
    lens = rng.integers(1, p_max + 1, batch).astype(np.int32)
    lens[rng.random(batch) < 0.3] = NO_PREFILL
    arrays = dict(prompt=rng.integers(0, vocab, (batch, p_max)).astype(np.int32), prompt_len=lens,
                  hist=rng.integers(-3, 9, (batch, cap)).astype(np.int32), hist_len=np.full(batch, 7, np.int32))
    dev, stream = as_backend(backend, arrays)
    reference.ngram_prefill(*arrays.values())
    backend.ops.ngram_prefill(*dev.values(), stream=stream)
    assert_same(backend, dev, arrays, stream)

    pos = rng.integers(0, cap, batch).astype(np.int32)
    pos[0] = cap - 2  # drafts past the capacity are not stored
    brk = np.stack([rng.integers(0, k + 1, batch), rng.integers(0, 2, batch)], 1).astype(np.int32)
    prop = rng.integers(-2, vocab + 2, (batch, k)).astype(np.int32)  # out-of-range tokens fall back to 0
    arrays = dict(draft_tok=prop, pos_ctr=pos, brk=brk, hist=rng.integers(0, 9, (batch, cap)).astype(np.int32))
    dev, stream = as_backend(backend, arrays)
    reference.ngram_append(*arrays.values())
    backend.ops.ngram_append(*dev.values(), stream=stream)
    assert_same(backend, dev, arrays, stream)

    logits = np.full((batch, k, vocab), 5.0, np.float32)
    arrays = dict(prop=prop, brk=brk, logits=logits)
    dev, stream = as_backend(backend, arrays)
    for step in (0, k - 1):
        reference.ngram_onehot_logits(*arrays.values(), step=step)
        backend.ops.ngram_onehot_logits(*dev.values(), step=step, stream=stream)
    assert_same(backend, dev, arrays, stream)
    assert (np.isfinite(logits[:, 0]).sum(axis=1) == 1).all() and (logits[:, 1:k - 1] == 5.0).all()


@pytest.mark.parametrize("batch", [1, 7, 19, 257])
@pytest.mark.parametrize("p_max", [1, 7, 19, 257])
def test_prefill_chunk_kernel_equals_twin(backend, rng, batch, p_max):
    # A chunk copies at start (clamped to [0, capacity], the chunk to what fits) and leaves the
    # history below start and past the chunk as it was (poisoned here).
    cap = 300
    lens = rng.integers(0, p_max + 1, batch).astype(np.int32)
    lens[rng.random(batch) < 0.3] = NO_PREFILL
    start = rng.integers(0, cap + 1, batch).astype(np.int32)
    start[rng.random(batch) < 0.1] = rng.choice([-3, cap + 5])
    start[0], lens[0] = cap - 1, p_max  # a chunk that runs past the capacity
    prompt = rng.integers(0, 3001, (batch, p_max)).astype(np.int32)
    prompt[np.arange(p_max)[None, :] >= np.maximum(lens, 0)[:, None]] = PLACEHOLDER_TOKEN
    arrays = dict(prompt=prompt, prompt_len=lens, hist=rng.integers(-9, -1, (batch, cap)).astype(np.int32),
                  hist_len=np.full(batch, -5, np.int32))
    before = {n: a.copy() for n, a in arrays.items()}
    dev, stream = as_backend(backend, arrays)
    dev_start = backend.to_device(start, stream)
    reference.ngram_prefill(*arrays.values(), start=start)
    backend.ops.ngram_prefill(*dev.values(), start=dev_start, stream=stream)
    assert_same(backend, dev, arrays, stream)
    for b in range(batch):  # the twin itself, by hand
        if lens[b] == NO_PREFILL:
            assert (arrays["hist"][b] == before["hist"][b]).all() and arrays["hist_len"][b] == -5
            continue
        s = min(max(int(start[b]), 0), cap)
        n = min(int(lens[b]), cap - s)
        assert arrays["hist_len"][b] == s + n and (arrays["hist"][b, s:s + n] == prompt[b, :n]).all()
        untouched = np.r_[0:s, s + n:cap]
        assert (arrays["hist"][b, untouched] == before["hist"][b, untouched]).all()


# ---------------------------------------------------------------------- the drafter in bursts

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [4], [0, 0, 0, 0, 0, 0], [2, 3, 4, 0, 1]]


def decode(dec, prompts, runner=None, **prefill):
    dec.prefill(prompts, **prefill)
    runner = runner or dec.run_burst
    got = [[] for _ in prompts]
    while dec.host_left.any():
        tokens = runner()
        for b in range(len(prompts)):
            got[b] += tokens[b].tolist()
    return got


def pair(batch, capacity=256, n_min=1, n_max=3, backend="numpy"):
    target = StubTarget(batch, VOCAB, [True, False, True], capacity, backend=backend)
    return target, NgramDraft(batch, VOCAB, capacity, n_min=n_min, n_max=n_max, backend=backend)


@pytest.mark.parametrize("engine", ["fused", "separate", "graph", "per_round_sync"])
def test_greedy_equals_the_targets_greedy(backend, engine):
    target, draft = pair(len(PROMPTS), backend=backend)
    dec = SpecDecoder(target, draft, k=4, m_rounds=3, fused=engine != "separate")
    runner = {"graph": BurstGraph(dec).run if engine == "graph" else None,
              "per_round_sync": lambda: dec.run_burst(mode="per_round_sync")}.get(engine)
    limits = [40, 30, 25, 33]
    got = decode(dec, PROMPTS, runner, max_new_tokens=limits)
    for b, prompt in enumerate(PROMPTS):
        assert got[b] == greedy_reference(prompt, limits[b], VOCAB), b
    acc = dec.accept_counters()
    assert acc[:, 0].sum() > 0 and acc[:, 0].sum() < acc[:, 1].sum() * dec.k  # accepts and misses both ran


def test_budgets_eos_and_a_refill_midway():
    target, draft = pair(3)
    dec = SpecDecoder(target, draft, k=5, m_rounds=2)
    ref = greedy_reference([3, 3, 1], 30, VOCAB)
    eos = ref[7]
    got = decode(dec, [[3, 3, 1], [1, 2], None], max_new_tokens=[30, 3, None], eos=[eos, None, None])
    assert got[0] == ref[: ref.index(eos) + 1] and got[1] == greedy_reference([1, 2], 3, VOCAB) and got[2] == []
    # Refill slot 1 with a longer, different prompt while slot 0 has finished: its history is replaced.
    got = decode(dec, [None, [0, 1, 0, 1, 0, 1, 0], None], max_new_tokens=[None, 20, None])
    assert got[1] == greedy_reference([0, 1, 0, 1, 0, 1, 0], 20, VOCAB)


def test_zero_draft_rounds_commit_one_token_each():
    """With n_min above anything that repeats, every round proposes nothing (brk = [0, 1])
    and commits the pending token alone, as plain decoding does."""
    target = StubTarget(1, 1000, 1, 64, backend="numpy")
    draft = NgramDraft(1, 1000, 64, n_min=8, n_max=8, backend="numpy")
    dec = SpecDecoder(target, draft, k=4, m_rounds=3)
    got = decode(dec, [[1, 2, 3]], max_new_tokens=[12])
    assert got[0] == greedy_reference([1, 2, 3], 12, 1000)
    assert dec.accept_counters().tolist() == [[0, 12]]  # 12 rounds, no draft accepted


def test_per_request_range_and_validation():
    target, draft = pair(2)
    dec = SpecDecoder(target, draft, k=3, m_rounds=2)
    with pytest.raises(ValueError, match="ngram_min \\(5\\) must be <= ngram_max \\(3\\)"):
        dec.slot_options({"ngram_min": 5})
    with pytest.raises(ValueError, match="ngram_max must be <= 16"):
        dec.slot_options({"ngram_max": 17})
    with pytest.raises(ValueError, match="unknown model option 'accept_prob'"):
        dec.slot_options({"accept_prob": 0.5})
    dec.set_slot_options({0: dec.slot_options({"ngram_min": 2, "ngram_max": 2}), 1: None})
    assert draft.n_min.tolist() == [2, 1] and draft.n_max.tolist() == [2, 3]
    got = decode(dec, PROMPTS[:2], max_new_tokens=20)
    assert got == [greedy_reference(p, 20, VOCAB) for p in PROMPTS[:2]]
    with pytest.raises(ValueError, match="ngram_min must be >= 1"):
        NgramDraft(1, VOCAB, 8, n_min=0, backend="numpy")


def test_sampling_at_temperature_zero_is_greedy(backend):
    target, draft = pair(len(PROMPTS), backend=backend)
    dec = SpecDecoder(target, draft, k=3, m_rounds=2, sampling=True)
    got = decode(dec, PROMPTS, BurstGraph(dec).run, max_new_tokens=24, temperature=0.0)
    assert got == [greedy_reference(p, 24, VOCAB) for p in PROMPTS]
    assert dec.accept_counters()[:, 0].sum() > 0


def test_sampling_is_lossless():
    """The first three sampled tokens follow the target's joint distribution (chi-square)."""
    from test_sampling_burst import joint_expected, pooled_chi2
    import sampling_stats as st
    vocab, peak, temperature, n = 4, 0.7, 1.0, 6000
    target = StubTarget(n, vocab, 1, 16, backend="numpy", logit_peak=peak)
    draft = NgramDraft(n, vocab, 16, n_min=1, n_max=2, backend="numpy")
    dec = SpecDecoder(target, draft, k=2, m_rounds=3, sampling=True)  # >= 3 tokens a burst
    seeds = [int(s) for s in (np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(7)]
    dec.prefill([[1, 2, 3]] * n, max_new_tokens=3, temperature=temperature, seed=seeds)
    seqs = [tuple(t.tolist()) for t in dec.run_burst()]
    assert all(len(s) == 3 for s in seqs)
    acc = dec.accept_counters()
    assert 0 < acc[:, 0].sum() < acc[:, 1].sum() * dec.k
    observed = {}
    for s in seqs:
        observed[s] = observed.get(s, 0) + 1
    pval, info = pooled_chi2(observed, joint_expected([1, 2, 3], vocab, peak, temperature, 3), n)
    assert pval > st.ALPHA, info
    wrong, info = pooled_chi2(observed, joint_expected([1, 2, 3], vocab, peak, temperature * 1.25, 3), n)
    assert wrong < st.ALPHA, f"a temperature 25% off passed: {info}"


def test_serve_loop_with_cancel_and_refill(rng):
    batch = 3
    target, draft = pair(batch, capacity=128)
    loop = ServeLoop(target, draft, k=4, m_rounds=2)
    reqs = []
    for _ in range(10):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 12))).tolist()
        limit = int(rng.integers(1, 40))
        ref = greedy_reference(prompt, limit, VOCAB)
        eos = ref[int(rng.integers(0, limit))] if rng.random() < 0.4 else None
        opts = {"ngram_max": int(rng.integers(1, 5))} if rng.random() < 0.5 else None
        reqs.append(Request(prompt, limit, eos=eos, options=opts))
    states = [loop.submit(r) for r in reqs]
    cancelled = set()
    while not loop.idle:
        loop.step()
        for s in states:
            if not s.done and s.tokens and rng.random() < 0.1:
                loop.cancel(s)
                cancelled.add(id(s))
    for s in states:
        r = s.request
        ref = greedy_reference(r.prompt, r.max_new_tokens, VOCAB)
        if r.eos is not None and r.eos in ref:
            ref = ref[: ref.index(r.eos) + 1]
        if id(s) in cancelled:
            assert s.tokens == ref[: len(s.tokens)]
        else:
            assert s.tokens == ref, r
    assert sum(s.accepted for s in states) > 0


class RecordingNgram(NgramDraft):
    """Records every round's proposals with the sequence position they were made at (numpy only:
    the twins run at once, so the buffers can be read right after the search)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.records = []

    def draft_step(self, bufs, step, stream):
        super().draft_step(bufs, step, stream)
        if step == 0:
            prop = self.prop if bufs.sampling else bufs.draft_tok
            for b in range(self.batch):
                if bufs.budget[b] > 0:
                    nv = int(bufs.brk[b, 0])
                    self.records.append((b, int(bufs.pos_ctr[b]), int(bufs.vtok[b, 0]), prop[b, :nv].tolist()))


@pytest.mark.parametrize("sampling", [False, True])
def test_proposals_are_the_spec_of_the_true_sequence(sampling):
    """Every round proposes exactly ngram_match of the sequence so far (prompt, committed
    tokens, pending token): the device history never drifts, through a refill too. Greedy
    parity alone could not see a stale history (it would only lower acceptance)."""
    target = StubTarget(3, VOCAB, 1, 128, backend="numpy")
    draft = RecordingNgram(3, VOCAB, 128, n_min=1, n_max=3, backend="numpy")
    dec = SpecDecoder(target, draft, k=3, m_rounds=2, sampling=sampling)
    kw = dict(temperature=[0.9, 0.0, 1.3], seed=[1, 2, 3]) if sampling else {}
    for prompts in ([[1, 2, 3, 1, 2], [4, 4], [0, 1, 2, 3, 4, 0, 1]], [[3, 1, 3, 1], None, [2]]):
        draft.records.clear()
        live = [b for b, p in enumerate(prompts) if p is not None]
        got = decode(dec, prompts, max_new_tokens=[30 if p else None for p in prompts], **kw)
        for b, pos, pend, prop in draft.records:
            assert b in live
            seq = prompts[b] + got[b]
            assert pend == seq[pos]
            assert prop == ngram_match(seq[: pos + 1], 1, 3, 3), (b, pos)
        assert sum(len(r[3]) for r in draft.records) > 0
