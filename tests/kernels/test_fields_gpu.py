"""The logits processing kernels on the device, bit for bit against ``fields_ref``; min-p in
``spec_probs_select`` bit for bit against ``sampling_ref.select_thr``.

Sizes are awkward on purpose (B 1, 7, 19; V 257, one partial span; 2049 and 32000, several
spans and select chunks; k + 1 up to 9). Rows and slots the kernels must not write are NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

from fields_cases import args, make_case
from marks import gpu
from graphburst.constants import NO_PREFILL, PLACEHOLDER_TOKEN
from graphburst.kernels import fields_ref as fr
from graphburst.kernels import sampling_ref as sr
from test_sampling_gpu import F32, assert_bits, dev, ops, scratch, stream  # noqa: F401 (fixtures)
from test_sampling_select_gpu import KINDS, assert_clean, run_select, select_logits

pytestmark = gpu
cp = pytest.importorskip("cupy")


@pytest.mark.parametrize("batch", [1, 7, 19])
@pytest.mark.parametrize("k1", [1, 4, 9])
@pytest.mark.parametrize("vocab", [257, 2049, 32000])
def test_apply_fields_matches_twin(ops, stream, batch, k1, vocab):  # noqa: F811
    rng = np.random.default_rng(batch * 1000 + k1 * 10 + vocab)
    bufs, _ = make_case(rng, batch, k1, vocab)
    want = args(bufs)
    fr.apply_fields(*want)
    got = args(bufs, cp)
    ops.apply_fields(*got, stream=stream)
    # one row only (the prefill's first token): the other rows stay NaN
    one = args(bufs, cp)
    one[0][:, 1:] = cp.nan
    ops.apply_fields(*one, step=0, stream=stream)
    stream.synchronize()
    assert_bits(got[0], want[0], "apply_fields")
    assert_bits(one[0][:, 0], want[0][:, 0], "apply_fields step=0")
    assert bool(cp.isnan(one[0][:, 1:]).all()), "step=0 wrote other rows"
    for name, before, after in zip(("vtok", "pos", "counts"), got[1:4], args(bufs, cp)[1:4]):
        assert bool(cp.all(before == after)), f"{name} changed"


def test_inactive_slots_untouched(ops, stream):  # noqa: F811
    rng = np.random.default_rng(5)
    bufs, _ = make_case(rng, 7, 5, 2049)
    for name, off in (("presence", 0), ("frequency", 0), ("repetition", 1), ("n_bias", 0), ("min_tokens", 0)):
        bufs[name][1:] = off
    bufs["logits"][1:] = np.nan
    got = args(bufs, cp)
    ops.apply_fields(*got, stream=stream)
    stream.synchronize()
    assert bool(cp.isnan(got[0][1:]).all())
    want = args(bufs)
    fr.apply_fields(*want)
    assert_bits(got[0][0], want[0][0], "slot 0")


@pytest.mark.parametrize("batch", [1, 7, 19])
def test_count_kernels_match_twin(ops, stream, batch):  # noqa: F811
    rng = np.random.default_rng(batch)
    k1, vocab, p_max = 9, 257, 37
    vtok = rng.integers(0, vocab, (batch, k1)).astype(np.int32)
    vtok[::3, 5:] = PLACEHOLDER_TOKEN
    n_acc = rng.integers(0, k1, batch).astype(np.int32)
    n_commit = np.minimum(n_acc + 1, rng.integers(0, k1 + 1, batch)).astype(np.int32)
    budget = rng.choice(np.array([0, 3, 2**31 - 1], np.int32), batch)
    pend = rng.integers(-1, vocab, batch).astype(np.int32)
    counts = rng.integers(0, 5, (batch, vocab)).astype(np.int32)
    seen = rng.integers(0, 2, (batch, vocab)).astype(np.uint8)
    lengths = rng.choice(np.array([NO_PREFILL, 1, 5, p_max], np.int32), batch)
    starts = rng.choice(np.array([0, 0, 7], np.int32), batch)
    chunks = rng.integers(0, vocab, (batch, p_max)).astype(np.int32)
    w_counts, w_seen = counts.copy(), seen.copy()
    fr.fields_commit(vtok, n_acc, n_commit, budget, pend, w_counts)
    d = dev(vtok, n_acc, n_commit, budget, pend, counts)
    ops.fields_commit(*d, stream=stream)
    stream.synchronize()
    assert_bits(d[5], w_counts, "fields_commit")
    fr.fields_reset(lengths, starts, w_counts, w_seen)
    fr.fields_prompt(lengths, chunks, w_seen)
    fr.fields_first(lengths, pend, w_counts)
    g_len, g_start, g_chunks, g_seen, g_pend = dev(lengths, starts, chunks, seen, pend)
    g_counts = d[5]
    ops.fields_reset(g_len, g_start, g_counts, g_seen, stream=stream)
    ops.fields_prompt(g_len, g_chunks, g_seen, stream=stream)
    ops.fields_first(g_len, g_pend, g_counts, stream=stream)
    stream.synchronize()
    assert_bits(g_counts, w_counts, "reset + first")
    assert_bits(g_seen, w_seen, "reset + prompt")


def minp_settings(rng, batch, vocab):
    temp = rng.choice(np.array([0, 0.25, 1, 2.5], F32), batch)
    top_k = rng.choice(np.array([0, 0, 1, 3, 50, 2100, vocab - 1], np.int64), batch).astype(np.int32)
    top_p = rng.choice(np.array([1, 1, 0.9, 0.5, 1e-6], F32), batch)
    min_p = rng.choice(np.array([0, 1e-6, 0.01, 0.1, 0.5, 1.0], F32), batch)
    return temp, top_k, top_p, min_p


@pytest.mark.parametrize("vocab", [7, 257, 2049, 32000, 128256])
@pytest.mark.parametrize("kind", KINDS)
def test_min_p_select_matches_twin(rng, ops, stream, vocab, kind):  # noqa: F811
    """Min-p alone, with top-k on both sides of its count, with top-p, all three; greedy rows."""
    batch, rows = (19, 3) if vocab <= 32000 else (4, 2)
    logits = select_logits(rng, kind, (batch, rows, vocab))
    temp, top_k, top_p, min_p = minp_settings(rng, batch, vocab)
    temp[:4], min_p[:4] = 1, 0.1
    top_k[:4], top_p[:4] = [0, 3, min(vocab - 1, 2100), 50], [1, 1, 1, 0.9]
    flat = logits.reshape(batch * rows, vocab)
    rep = lambda a: np.repeat(a, rows)  # noqa: E731 (per sequence -> per row)
    want = sr.select_thr(flat, rep(temp), rep(top_k), rep(top_p), rep(min_p)).reshape(batch, rows)
    sc = scratch(batch, rows + 1, vocab)
    sc.sel_part.fill(np.uint64(0xFFFFFFFFFFFFFFF0))
    d = dev(logits, temp, top_k, top_p, min_p)
    for attempt in ("first call", "second call"):
        ops.probs_select(*d[:4], sc, min_p=d[4], stream=stream)
        stream.synchronize()
        assert_bits(cp.asnumpy(sc.sel_thr)[:, :rows], want, f"sel_thr with min_p, {attempt}")
        assert_clean(sc, attempt)
    # min_p = 0 everywhere: the bits of no min_p at all
    none = run_select(ops, stream, logits, temp, top_k, top_p, sc)[:, :rows]
    zero = dev(np.zeros(batch, F32))[0]
    ops.probs_select(*d[:4], sc, min_p=zero, stream=stream)
    stream.synchronize()
    assert_bits(cp.asnumpy(sc.sel_thr)[:, :rows], none, "min_p 0")


@pytest.mark.parametrize("vocab", [257, 32000])
def test_probs_with_min_p_match_twin(rng, ops, stream, vocab):  # noqa: F811
    batch = 7
    logits = select_logits(rng, "normal", (batch, 9, vocab))
    temp, top_k, top_p, min_p = minp_settings(rng, batch, vocab)
    want = np.full_like(logits, np.nan)
    sr.probs_from_logits(logits, temp, top_k, top_p, want, min_p=min_p)
    d = dev(logits, temp, top_k, top_p, min_p)
    ops.probs_from_logits(d[0], d[1], d[2], d[3], d[0], scratch(batch, 9, vocab), min_p=d[4], stream=stream)
    stream.synchronize()
    assert_bits(d[0], want, "probs with min_p")
