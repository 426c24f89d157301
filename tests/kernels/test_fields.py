"""The logits processing twin (``fields_ref``) against transformers' logits processors, a plain CPU
reference for presence/frequency, hand cases, poisoned rows; min-p in the probability twin;
the count bookkeeping; the fields' validation.

The order is vLLM's: min_tokens, logit_bias, repetition, frequency, presence (then, after
temperature, min-p with top-k/top-p).
"""

from __future__ import annotations

import numpy as np
import pytest

from fields_cases import F32, args, make_case
from graphburst.constants import MAX_LOGIT_BIAS, NO_EOS, NO_PREFILL, PLACEHOLDER_TOKEN
from graphburst.kernels import fields_ref as fr
from graphburst.kernels import sampling_ref as sr
from graphburst.sampling.params import SamplingParams, check_fields, check_sampling

torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")


def presence_frequency(x, tokens, presence, frequency):
    """Plain CPU reference: ``l -= frequency * count + presence * (count > 0)``, element by element, float32."""
    x = np.array(x, F32)
    counts = np.bincount(np.asarray(tokens, np.int64), minlength=len(x)) if len(tokens) else np.zeros(len(x), int)
    for i in range(len(x)):
        c = int(counts[i])
        if frequency != 0:
            x[i] = F32(x[i] - F32(F32(frequency) * F32(c)))
        if presence != 0 and c > 0:
            x[i] = F32(x[i] - F32(presence))
    return x


def hf_row(logits_row, prompt, generated, *, eos, min_tokens, bias, repetition):
    """transformers' processors, in vLLM's order, on one row after ``prompt + generated``."""
    ids = torch.tensor([list(prompt) + list(generated)], dtype=torch.long)
    scores = torch.tensor(np.array(logits_row, F32))[None]
    if eos >= 0 and min_tokens > 0:
        scores = lp.MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, eos)(ids, scores)
    if bias:
        scores = lp.SequenceBiasLogitsProcessor([[[t], float(v)] for t, v in bias])(ids, scores)
    if repetition != 1:
        scores = lp.RepetitionPenaltyLogitsProcessor(float(repetition))(ids, scores)
    return scores[0].numpy().astype(F32)


def expected_rows(bufs, hist):
    """Per (b, row): transformers' processors, then the plain presence/frequency reference;
    ``(rows [B, T, V], used [B, T] bool)``. Rows past a slot's break (after its last valid
    draft) are never accepted from, so they are not compared (``used`` False)."""
    batch, n_rows, _ = bufs["logits"].shape
    out = np.array(bufs["logits"], F32)
    used = np.zeros((batch, n_rows), bool)
    for b, (_, _, drafts) in enumerate(hist):
        used[b, :len(drafts) + 1] = True
    for b, (prompt, gen, drafts) in enumerate(hist):
        nb = int(bufs["n_bias"][b])
        bias = list(zip(bufs["bias_ids"][b, :nb].tolist(), bufs["bias_val"][b, :nb].tolist()))
        active = fr.active_slots(bufs["eos"][b:b + 1], bufs["min_tokens"][b:b + 1], bufs["presence"][b:b + 1],
                                 bufs["frequency"][b:b + 1], bufs["repetition"][b:b + 1], bufs["n_bias"][b:b + 1])[0]
        if not active:
            continue
        for r in range(min(n_rows, len(drafts) + 1)):
            generated = gen + drafts[:r]
            row = hf_row(out[b, r], prompt, generated, eos=int(bufs["eos"][b]), min_tokens=int(bufs["min_tokens"][b]),
                         bias=bias, repetition=F32(bufs["repetition"][b]))
            out[b, r] = presence_frequency(row, generated, bufs["presence"][b], bufs["frequency"][b])
    return out, used


@pytest.mark.parametrize("batch", [1, 7, 19])
@pytest.mark.parametrize("k1", [1, 4, 9])
def test_twin_matches_transformers_processors(batch, k1):
    """Every row of every slot, bit for bit: the twin == transformers + the presence/frequency reference."""
    rng = np.random.default_rng(batch * 100 + k1)
    bufs, hist = make_case(rng, batch, k1, 257)
    want, used = expected_rows(bufs, hist)
    a = args(bufs)
    fr.apply_fields(*a)
    np.testing.assert_array_equal(a[0][used].view(np.int32), want[used].view(np.int32))
    assert used.sum() > batch or k1 == 1
    assert not np.array_equal(a[0], bufs["logits"]), "no field changed anything: the case tests nothing"


def test_each_field_alone_by_hand():
    """V = 5, one slot, one row after prompt [1] and generated [2, 2] (pending 2), draft [3] in row 1."""
    base = {"vtok": np.array([[2, 3]], np.int32), "pos": np.array([2], np.int32),
            "counts": np.array([[0, 0, 2, 0, 0]], np.int32), "prompt_seen": np.array([[0, 1, 0, 0, 0]], np.uint8),
            "prompt_len": np.array([1], np.int32), "eos": np.array([4], np.int32),
            "min_tokens": np.zeros(1, np.int32), "presence": np.zeros(1, F32), "frequency": np.zeros(1, F32),
            "repetition": np.ones(1, F32), "bias_ids": np.zeros((1, MAX_LOGIT_BIAS), np.int32),
            "bias_val": np.zeros((1, MAX_LOGIT_BIAS), F32), "n_bias": np.zeros(1, np.int32)}
    row = np.array([1.0, 2.0, -2.0, 4.0, 3.0], F32)

    def run(**change):
        b = {**base, **{k: np.asarray(v, base[k].dtype) for k, v in change.items()}}
        b["logits"] = np.stack([row, row])[None].copy()
        a = args(b)
        fr.apply_fields(*a)
        return a[0][0]

    np.testing.assert_array_equal(run(), [row, row])  # nothing set: untouched
    # repetition 2: prompt token 1 and generated 2 (and the draft 3 in row 1) penalized
    np.testing.assert_array_equal(run(repetition=[2.0]), [[1, 1, -4, 4, 3], [1, 1, -4, 2, 3]])
    # frequency 0.5: counts 2 -> -1; row 1 also counts the draft 3 once
    np.testing.assert_array_equal(run(frequency=[0.5]), [[1, 2, -3, 4, 3], [1, 2, -3, 3.5, 3]])
    np.testing.assert_array_equal(run(presence=[1.0]), [[1, 2, -3, 4, 3], [1, 2, -3, 3, 3]])
    # min_tokens 4: generated before row 0's token: 2 (2 < 4: masked); row 1: 3 (masked)
    got = run(min_tokens=[4])
    assert np.isneginf(got[:, 4]).all() and (got[:, :4] == row[:4]).all()
    assert (run(min_tokens=[3])[1] == row).all()  # row 1: 3 generated, not < 3
    ids = np.zeros((1, MAX_LOGIT_BIAS), np.int32)
    val = np.zeros((1, MAX_LOGIT_BIAS), F32)
    ids[0, :2], val[0, :2] = [0, 3], [10, -100]
    np.testing.assert_array_equal(run(bias_ids=ids, bias_val=val, n_bias=[2]), [[11, 2, -2, -96, 3]] * 2)


def test_unused_rows_and_inactive_slots_stay_poisoned():
    """step=0 writes row 0 only; a slot with every field off is never written (NaN stays NaN, bit for bit)."""
    rng = np.random.default_rng(7)
    bufs, _ = make_case(rng, 7, 5, 257)
    bufs["presence"][:] = 0.5
    bufs["presence"][3] = 0
    bufs["frequency"][3], bufs["repetition"][3], bufs["n_bias"][3], bufs["min_tokens"][3] = 0, 1, 0, 0
    bufs["logits"][:, 1:] = np.nan
    bufs["logits"][3] = np.nan
    before = bufs["logits"].copy()
    a = args(bufs)
    fr.apply_fields(*a, step=0)
    np.testing.assert_array_equal(a[0][:, 1:].view(np.int32), before[:, 1:].view(np.int32))
    np.testing.assert_array_equal(a[0][3].view(np.int32), before[3].view(np.int32))
    assert not np.array_equal(a[0][0, 0], before[0, 0])


def test_placeholder_drafts_count_nothing():
    """Rows past the break read PLACEHOLDER_TOKEN drafts: they add no count (and never fault)."""
    rng = np.random.default_rng(3)
    bufs, hist = make_case(rng, 19, 9, 257)
    assert any(len(d) < 8 for _, _, d in hist) and (bufs["vtok"] == PLACEHOLDER_TOKEN).any()
    want, used = expected_rows(bufs, hist)
    a = args(bufs)
    fr.apply_fields(*a)
    np.testing.assert_array_equal(a[0][used].view(np.int32), want[used].view(np.int32))
    # a row past the break counts no placeholder: it equals the row at the break but for the position
    # (min_tokens) -- with min_tokens off the two rows' processing is the same function of the logits
    b = next(i for i, (_, _, d) in enumerate(hist) if len(d) < 8)
    n = len(hist[b][2])
    one = {name: v[b:b + 1].copy() for name, v in bufs.items()}
    one["min_tokens"][:] = 0
    one["logits"][0, n + 1] = one["logits"][0, n]
    a1 = args(one)
    fr.apply_fields(*a1)
    np.testing.assert_array_equal(a1[0][0, n + 1].view(np.int32), a1[0][0, n].view(np.int32))


@pytest.mark.parametrize("batch", [1, 7, 19])
@pytest.mark.parametrize("top_k", [0, 3, 40])
def test_min_p_matches_transformers(batch, top_k):
    """Min-p after temperature, then top-k (vLLM's order): the kept tokens are transformers'
    MinPLogitsWarper then TopKLogitsWarper's; min_p = 0 gives the bits of no min-p at all."""
    rng = np.random.default_rng(batch + top_k)
    vocab, n_rows = 257, 3
    logits = (rng.standard_normal((batch, n_rows, vocab)) * 3).astype(F32)
    temp = rng.choice(np.array([0.5, 1.0, 1.7], F32), batch)
    min_p = rng.choice(np.array([0.0, 0.01, 0.1, 0.5, 1.0], F32), batch)
    tk = np.full(batch, top_k, np.int32)
    tp = np.ones(batch, F32)
    out = np.zeros_like(logits)
    sr.probs_from_logits(logits, temp, tk, tp, out, min_p=min_p)
    for b in range(batch):
        for r in range(n_rows):
            s = lp.TemperatureLogitsWarper(float(temp[b]))(None, torch.tensor(logits[b, r])[None])
            if min_p[b] > 0:
                s = lp.MinPLogitsWarper(float(min_p[b]))(None, s)
            if top_k:
                s = lp.TopKLogitsWarper(top_k)(None, s)
            kept = torch.isfinite(s[0]).numpy()
            np.testing.assert_array_equal(out[b, r] > 0, kept, err_msg=f"b={b} r={r} min_p={min_p[b]}")
            assert abs(float(out[b, r].sum(dtype=np.float64)) - 1) < 1e-5
    off = np.zeros_like(logits)
    plain = np.zeros_like(logits)
    sr.probs_from_logits(logits, temp, tk, tp, off, min_p=np.zeros(batch, F32))
    sr.probs_from_logits(logits, temp, tk, tp, plain)
    np.testing.assert_array_equal(off.view(np.int32), plain.view(np.int32))


def test_min_p_then_top_p_runs_over_min_p_survivors():
    """Top-p's mass is over what min-p kept: with min-p keeping 2 of 4 equal-ish tokens, top_p 0.5 keeps 1."""
    logits = np.array([[[2.0, 1.99, -5.0, -5.0]]], F32)
    one = np.ones(1, F32)
    out = np.zeros_like(logits)
    sr.probs_from_logits(logits, one, np.zeros(1, np.int32), np.array([0.6], F32), out, min_p=np.array([0.5], F32))
    assert (out[0, 0] > 0).tolist() == [True, True, False, False]
    sr.probs_from_logits(logits, one, np.zeros(1, np.int32), np.array([0.4], F32), out, min_p=np.array([0.5], F32))
    assert (out[0, 0] > 0).tolist() == [True, False, False, False]
    sr.probs_from_logits(logits, np.zeros(1, F32), np.zeros(1, np.int32), one, out, min_p=np.array([1.0], F32))
    assert out[0, 0].tolist() == [1, 0, 0, 0]  # temperature 0: one-hot, min-p irrelevant


def test_commit_counts_committed_drafts_and_the_new_pending_token():
    """fields_commit against a plain loop over ring_commit's outcome, slot by slot."""
    k1, vocab = 4, 9
    vtok = np.array([[1, 2, 2, 3], [4, 5, PLACEHOLDER_TOKEN, PLACEHOLDER_TOKEN], [6, 7, 8, 0], [1, 1, 1, 1]], np.int32)
    n_acc = np.array([3, 1, 2, 0], np.int32)
    n_commit = np.array([4, 2, 2, 0], np.int32)  # slot 2 stopped after one draft (EOS or budget); slot 3 idle
    budget = np.array([5, 0, 0, 0], np.int32)
    pend = np.array([7, 3, 0, 1], np.int32)
    counts = np.zeros((4, vocab), np.int32)
    fr.fields_commit(vtok, n_acc, n_commit, budget, pend, counts)
    want = np.zeros((4, vocab), np.int32)
    for t in (2, 2, 3, 7):
        want[0, t] += 1  # 3 drafts + the bonus as the new pending token
    want[1, 5] += 1  # slot 1 committed its run but its budget ran out: no pending token
    want[2, 7] += 1  # slot 2: the draft it committed
    np.testing.assert_array_equal(counts, want)
    assert k1 == vtok.shape[1]


def test_admission_reset_prompt_and_first_token():
    """A fresh prompt's rows are zeroed, a continued chunk's are kept; chunk tokens are marked; the
    first token is counted; slots left alone are untouched."""
    counts = np.full((3, 6), 9, np.int32)
    seen = np.ones((3, 6), np.uint8)
    lengths = np.array([2, NO_PREFILL, 1], np.int32)
    starts = np.array([0, 0, 4], np.int32)
    fr.fields_reset(lengths, starts, counts, seen)
    chunks = np.array([[3, 5, 0], [1, 1, 1], [2, 0, 0]], np.int32)
    fr.fields_prompt(lengths, chunks, seen)
    fr.fields_first(lengths, np.array([4, 0, 1], np.int32), counts)
    np.testing.assert_array_equal(seen, [[0, 0, 0, 1, 0, 1], [1] * 6, [1] * 6])
    np.testing.assert_array_equal(counts, [[0, 0, 0, 0, 1, 0], [9] * 6, [9, 10, 9, 9, 9, 9]])


def test_fields_validation_names_the_field():
    assert check_sampling().fields == {}
    p = check_sampling(0.5, logit_bias={"7": 1.5, 3: -2}, min_p=0.2, ignore_eos=True, min_tokens=4, vocab=10)
    assert p.logit_bias == ((3, -2.0), (7, 1.5)) and p.fields["min_p"] == 0.2
    assert isinstance(p, SamplingParams) and hash(p)
    bad = [({"presence_penalty": 2.5}, ValueError, "presence_penalty"),
           ({"frequency_penalty": "1"}, TypeError, "frequency_penalty"),
           ({"repetition_penalty": 0}, ValueError, "repetition_penalty"),
           ({"min_p": 1.5}, ValueError, "min_p"),
           ({"min_tokens": -1}, ValueError, "min_tokens"),
           ({"min_tokens": 1.0}, TypeError, "min_tokens"),
           ({"ignore_eos": 1}, TypeError, "ignore_eos"),
           ({"logit_bias": {5: 101}}, ValueError, "logit_bias"),
           ({"logit_bias": {10: 1}}, ValueError, "logit_bias"),
           ({"logit_bias": {"x": 1}}, TypeError, "logit_bias"),
           ({"logit_bias": {"\u00b2": 1}}, TypeError, "logit_bias"),  # a digit to str.isdigit, not to int()
           ({"logit_bias": [1, 2]}, TypeError, "logit_bias"),
           ({"logit_bias": {i: 1 for i in range(MAX_LOGIT_BIAS + 1)}}, ValueError, "logit_bias"),
           ({"logit_bias": {1: float("nan")}}, ValueError, "logit_bias")]
    for kw, exc, name in bad:
        with pytest.raises(exc, match=name):
            check_fields(**kw, vocab=10 if "logit_bias" in kw and kw["logit_bias"] != {
                i: 1 for i in range(MAX_LOGIT_BIAS + 1)} else None)
    with pytest.raises(TypeError, match="unknown sampling field 'best_of'"):
        check_sampling(best_of=2)
    assert NO_EOS < 0
