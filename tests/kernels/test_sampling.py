"""CPU tests of the sampling reference (sampling_ref.py) and of per-request validation.

The losslessness tests are the ones that matter: the emitted tokens of the reference
rule must follow the target distribution p by a chi-square test, and the same test must
reject rules that are subtly wrong.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

import sampling_stats as st
from graphburst import constants
from graphburst.kernels import reference
from graphburst.kernels import sampling_prims as sp
from graphburst.kernels import sampling_ref as sr
from graphburst.constants import PLACEHOLDER_TOKEN
from graphburst.sampling.params import SamplingParams, check_sampling
from graphburst.kernels.source import kernel_source

CU = kernel_source()  # kernels.cu with its sections inlined
F32 = np.float32


def run_accept(vtok, p, q, brk, seed, pos):
    n_acc = np.full(len(vtok), -7, np.int32)
    last = np.full(len(vtok), -7, np.int32)
    sr.accept_sample(vtok, p, q, brk, seed, pos, n_acc, last)
    return n_acc, last


def probs(logits, temperature, top_k=0, top_p=1.0):
    b = logits.shape[0]
    out = np.full_like(logits, np.nan)
    sr.probs_from_logits(logits, np.broadcast_to(F32(temperature), b).astype(F32),
                         np.broadcast_to(np.int32(top_k), b).astype(np.int32),
                         np.broadcast_to(F32(top_p), b).astype(F32), out)
    return out


# ------------------------------------------------------------------ generator and floats


@pytest.mark.parametrize("ctr, key, want", [
    # Random123 kat_vectors, "philox4x32 10" lines.
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
])
def test_philox_known_answers(ctr, key, want):
    assert sp.philox4x32_10(np.array(ctr, np.uint32), np.array(key, np.uint32)).tolist() == want


def test_every_kernel_is_warmed_up_before_capture():
    # launch imports cupy, so read its KERNEL_NAMES from the source instead.
    tree = ast.parse((Path(__file__).parents[2] / "graphburst" / "kernels" / "launch.py").read_text())
    names = next(ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "KERNEL_NAMES")
    assert sorted(names) == sorted(re.findall(r'extern "C" __global__ void (\w+)\(', CU))


def test_uniform_is_24_bit_keyed_and_uniform():
    n = 100_000
    seed = np.arange(n, dtype=np.uint64) << np.uint64(20)
    u = sr.uniform(seed, np.zeros(n), constants.DRAW_DRAFT)
    assert u.dtype == np.float32 and u.min() >= 0 and u.max() < 1
    assert np.all((u * 2**24) == np.floor(u * 2**24))
    assert abs(u.mean() - 0.5) < 0.005 and abs((u < 0.1).mean() - 0.1) < 0.005
    # Every key component changes the draw; the same key always gives the same draw.
    base = sr.uniform(seed[:1000], np.full(1000, 5), 1)
    assert np.array_equal(base, sr.uniform(seed[:1000], np.full(1000, 5), 1))
    for other in (sr.uniform(seed[:1000] + np.uint64(1 << 40), np.full(1000, 5), 1),
                  sr.uniform(seed[:1000], np.full(1000, 6), 1), sr.uniform(seed[:1000], np.full(1000, 5), 2)):
        assert np.mean(other == base) < 0.01


def test_exp_neg_accuracy_and_edges():
    x = np.linspace(-80, 0, 200_001, dtype=F32)
    got = sr.exp_neg(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    # y = x*log2(e) is rounded once (half an ulp of y): the error grows like |x| * 2^-23.
    assert np.all(np.abs(got - want) <= want * (4e-7 + np.abs(x) * 2.0**-23))
    assert sr.exp_neg(F32(0)) == 1 and sr.exp_neg(F32(-np.inf)) == 0 and sr.exp_neg(F32(-100)) == 0


def test_expo_is_exponential_and_accurate(rng):
    words = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32)
    e = sp.expo(words).astype(np.float64)
    # Against float64 -log1p(-v) of the same float32 v: the polynomial's own error.
    v = np.minimum((words | 1).astype(np.float64).astype(F32) * F32(2.0**-32), F32(1 - 2.0**-24))
    want = -np.log1p(-v.astype(np.float64))
    assert np.all(np.abs(e - want) <= 4e-7 * want)
    # Exponential(1): mean 1 and P(E > x) = e^-x, the small values (which decide races) included.
    assert abs(e.mean() - 1) < 0.01
    for x in (1e-4, 0.01, 0.5, 1, 3):
        assert abs((e > x).mean() - np.exp(-x)) < 4 * np.sqrt(np.exp(-x) / len(e)) + 1e-4
    # The extremes: word 0 keeps 32 bits near E = 0, the cap keeps v < 1.
    assert sp.expo(np.uint32(0)) == pytest.approx(2.0**-32, rel=1e-6)
    assert np.isfinite(sp.expo(np.uint32(0xFFFFFFFF))) and sp.expo(np.uint32(0xFFFFFFFF)) > 16


def test_race_hand_cases():
    w = np.array([[0, 0, 0, 2.5], [0, 0, 0, 0], [1e-40, 0, 1.0, 0], [0, 3, 0, 0]], F32)
    tok, wt = sr.race(w, np.arange(4, dtype=np.uint64), np.zeros(4), constants.DRAW_DRAFT)
    assert tok.tolist() == [3, -1, 2, 1] and wt.tolist() == [2.5, 0, 1, 3]


@pytest.mark.parametrize("vocab", [5, 2049])
def test_race_follows_the_weights(vocab):
    """Chi-square of race winners against w / sum(w), one row per seed (V = 2049: two tiles)."""
    rng = np.random.default_rng(11)
    w = np.zeros(vocab, F32)
    hot = rng.choice(vocab, 5, replace=False)
    w[hot] = [0.5, 0.25, 0.125, 0.1, 0.025]
    n = 8_000
    seeds = rng.integers(0, 2**64, n, dtype=np.uint64)
    tok, _ = sr.race(np.tile(w, (n, 1)), seeds, rng.integers(0, 2**31, n), constants.DRAW_RESAMPLE)
    pval, info = st.goodness_of_fit(tok, w)
    assert pval > st.ALPHA, info


def slow_tile_sums(e, vocab):
    """The device's tile sums by simulating each thread, warp and tree step in Python."""
    tile = constants.SAMPLE_TILE
    out = []
    for t0 in range(0, vocab, tile):
        acc = []
        for tid in range(constants.SAMPLE_THREADS):
            a = F32(0)
            for j in range(tile // (4 * constants.SAMPLE_THREADS)):
                for c in range(4):
                    i = t0 + (j * constants.SAMPLE_THREADS + tid) * 4 + c
                    if i < vocab:
                        a = F32(a + e[i])
            acc.append(a)

        def butterfly(vals):
            vals = list(vals)
            o = len(vals) // 2
            while o:
                vals = [F32(vals[i] + vals[i ^ o]) for i in range(len(vals))]
                o //= 2
            return vals[0]

        warps = [butterfly(acc[w * 32:(w + 1) * 32]) for w in range(len(acc) // 32)]
        out.append(butterfly(warps))
    return np.array(out, F32)


@pytest.mark.parametrize("vocab", [1, 7, 1024, 1025, 2048, 4099])
def test_tile_sums_match_a_thread_by_thread_simulation(vocab):
    rng = np.random.default_rng(vocab)
    e = sp.exp_neg(-rng.random(vocab).astype(F32) * 30)
    got = sp.tile_sum(sp.tiled(e[None], F32(0)))[0]
    np.testing.assert_array_equal(got.view(np.int32), slow_tile_sums(e, vocab).view(np.int32))
    np.testing.assert_allclose(got.astype(np.float64).sum(), e.astype(np.float64).sum(), rtol=1e-5)


def test_tile_combine_order():
    x = np.arange(1, 71, dtype=F32)[None] * F32(0.1)
    lanes = [F32(0)] * 32
    for t in range(70):
        lanes[t % 32] = F32(lanes[t % 32] + x[0, t])
    want = sp.halve_tree(np.array(lanes, F32))
    assert sp.tile_combine(x)[0].view(np.int32) == want.view(np.int32)


# ------------------------------------------------------------------ probs_from_logits


def test_greedy_is_one_hot_at_lowest_argmax():
    logits = np.array([[[1, 3, 3, 2]], [[-0.0, 0.0, -1, -np.inf]], [[-np.inf, -np.inf, 5, 5]]], F32)
    out = probs(logits, 0.0)
    assert out[:, 0].tolist() == [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]]


@pytest.mark.parametrize("vocab", [300, 4099, 128256])
def test_softmax_without_filters_matches_float64(rng, vocab):
    logits = (rng.normal(size=(2 if vocab > 5000 else 6, 3, vocab)) * 4).astype(F32)
    logits[0, 0, :7] = -np.inf
    if vocab > 2100:
        logits[1, 1, :2100] = -np.inf  # a whole first tile of -inf (its scale is 0)
    for temp in (0.3, 1.0, 2.5):
        got = probs(logits, temp)
        z = logits.astype(np.float64) / temp
        want = np.exp(z - z.max(axis=-1, keepdims=True))
        want /= want.sum(axis=-1, keepdims=True)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-9)
        np.testing.assert_allclose(got.sum(axis=-1), 1, rtol=1e-5)


def test_top_k_keeps_exactly_k_with_ties_broken_by_index(rng):
    logits = np.zeros((1, 1, 10), F32)  # all tied: the k lowest indices survive
    out = probs(logits, 1.0, top_k=3)
    assert (out[0, 0] > 0).tolist() == [True] * 3 + [False] * 7
    logits = rng.normal(size=(4, 2, 50)).astype(F32)
    out = probs(logits, 0.8, top_k=5)
    top5 = np.argsort(-logits, axis=-1, kind="stable")[..., :5]
    assert np.array_equal(np.sort(np.nonzero(out > 0)[2].reshape(4, 2, 5), axis=-1), np.sort(top5, axis=-1))


def test_top_k_one_equals_greedy(rng):
    logits = rng.normal(size=(8, 3, 40)).astype(F32)
    logits[0, 0, [4, 9]] = 9  # a tie for the maximum
    assert np.array_equal(probs(logits, 1.7, top_k=1), probs(logits, 0.0))


def test_top_p_keeps_the_shortest_head_reaching_p():
    logits = np.log(np.array([[[0.5, 0.3, 0.15, 0.05]]], np.float64)).astype(F32)
    for top_p, kept in [(0.4, 1), (0.49, 1), (0.55, 2), (0.79, 2), (0.81, 3), (0.96, 4), (1.0, 4)]:
        out = probs(logits, 1.0, top_p=top_p)
        assert (out[0, 0] > 0).sum() == kept, top_p
        np.testing.assert_allclose(out.sum(), 1, rtol=1e-6)
    out = probs(logits, 1.0, top_k=2, top_p=0.9)  # top-p over the top-k survivors
    assert (out[0, 0] > 0).tolist() == [True, True, False, False]


def test_in_place_and_step_rows(rng):
    logits = rng.normal(size=(3, 4, 33)).astype(F32)
    temp, k, p = np.array([0, 0.7, 1.3], F32), np.array([0, 4, 0], np.int32), np.array([1, 1, 0.8], F32)
    out = np.full_like(logits, np.nan)
    sr.probs_from_logits(logits, temp, k, p, out)
    inplace = logits.copy()
    sr.probs_from_logits(inplace, temp, k, p, inplace)
    assert np.array_equal(out, inplace)
    one = np.full_like(logits, -5.0)
    sr.probs_from_logits(logits, temp, k, p, one, step=2)
    assert np.array_equal(one[:, 2], out[:, 2]) and np.all(one[:, [0, 1, 3]] == -5)


# ------------------------------------------------------------------ sample_draft / accept


def test_sample_draft_rows_and_probabilities(rng):
    q = probs(rng.normal(size=(9, 3, 20)).astype(F32), 1.0)
    seed = rng.integers(0, 2**63, 9, dtype=np.uint64)
    pos = rng.integers(0, 1000, 9, dtype=np.int32)
    tok, prob = np.full((9, 3), -9, np.int32), np.full((9, 3), -1, F32)
    sr.sample_draft(q, seed, pos, tok, prob)
    assert np.array_equal(prob, np.take_along_axis(q, tok[..., None], axis=2)[..., 0]) and np.all(prob > 0)
    tok1, prob1 = np.full((9, 3), -9, np.int32), np.full((9, 3), -1, F32)
    sr.sample_draft(q, seed, pos, tok1, prob1, step=1)
    assert np.array_equal(tok1[:, 1], tok[:, 1]) and np.all(tok1[:, [0, 2]] == -9)
    dead = np.zeros((1, 1, 5), F32)
    sr.sample_draft(dead, seed[:1], pos[:1], tok[:1, :1], prob[:1, :1])
    assert tok[0, 0] == PLACEHOLDER_TOKEN and prob[0, 0] == 0


def test_accept_hand_cases():
    v = 4
    p = np.zeros((4, 3, v), F32)
    p[:] = [0.25, 0.25, 0.25, 0.25]
    q = p[:, :2].copy()
    vtok = np.array([[9, 1, 2], [9, 1, 2], [9, PLACEHOLDER_TOKEN, 2], [9, 3, 7]], np.int32)
    brk = np.array([[2, 0], [1, 1], [2, 0], [2, 0]], np.int32)
    p[3, 0] = [0.5, 0.5, 0, 0]  # draft 3 has p = 0: always rejected, replaced from {0, 1}
    seed = np.arange(4, dtype=np.uint64)
    n_acc, last = run_accept(vtok, p, q, brk, seed, np.zeros(4, np.int32))
    assert n_acc.tolist() == [2, 1, 0, 0]  # p == q accepts every valid draft; the break cuts
    assert 0 <= last[0] < v and 0 <= last[1] < v and 0 <= last[2] < v and last[3] in (0, 1)


def test_temperature_zero_equals_greedy_accept(rng):
    batch, k, vocab = 300, 4, 23
    logits = rng.normal(size=(batch, k + 1, vocab)).astype(F32)
    logits[::7, :, 3] = logits[::7].max(axis=-1) # ties at the maximum
    tgt_pred = np.argmax(logits, axis=-1).astype(np.int32)
    q = probs(rng.normal(size=(batch, k, vocab)).astype(F32), 1.5)
    vtok = rng.integers(0, vocab, (batch, k + 1), dtype=np.int32)
    agree = rng.random((batch, k)) < 0.7
    vtok[:, 1:] = np.where(agree, tgt_pred[:, :k], vtok[:, 1:])
    vtok[::11, 2] = PLACEHOLDER_TOKEN
    brk = np.stack([rng.integers(-1, k + 2, batch), rng.integers(0, 2, batch)], axis=1).astype(np.int32)
    seed = rng.integers(0, 2**63, batch, dtype=np.uint64)
    pos = rng.integers(0, 10_000, batch, dtype=np.int32)
    want_n, want_last = np.zeros(batch, np.int32), np.zeros(batch, np.int32)
    reference.accept_greedy(vtok, tgt_pred, brk, want_n, want_last)
    for p in (probs(logits, 0.0), probs(logits, 0.9, top_k=1)):
        n_acc, last = run_accept(vtok, p, q, brk, seed, pos)
        assert np.array_equal(n_acc, want_n) and np.array_equal(last, want_last)
    assert 0 < want_n.mean() < k  # both accepts and rejections were exercised


def test_batch_permutation_permutes_outputs(rng):
    batch, k, vocab = 40, 3, 30
    logits = rng.normal(size=(batch, k + 1, vocab)).astype(F32)
    temp = rng.choice(np.array([0, 0.5, 1, 2], F32), batch)
    top_k = rng.choice(np.array([0, 1, 5], np.int32), batch)
    top_p = rng.choice(np.array([1, 0.9, 0.5], F32), batch)
    seed = rng.integers(0, 2**63, batch, dtype=np.uint64)
    pos = rng.integers(0, 1000, batch, dtype=np.int32)

    def pipeline(ix):
        p = np.empty_like(logits)
        sr.probs_from_logits(logits[ix], temp[ix], top_k[ix], top_p[ix], p)
        q = p[:, :k] ** 0.5
        q /= q.sum(axis=-1, keepdims=True)
        vtok = np.zeros((batch, k + 1), np.int32)
        prob = np.zeros((batch, k), F32)
        sr.sample_draft(q, seed[ix], pos[ix], vtok[:, 1:], prob)
        brk = np.tile(np.array([k, 0], np.int32), (batch, 1))
        return (*run_accept(vtok, p, q, brk, seed[ix], pos[ix]), vtok)

    perm = rng.permutation(batch)
    for a, b in zip(pipeline(np.arange(batch)), pipeline(perm)):
        assert np.array_equal(a[perm], b)


# ------------------------------------------------------------------ losslessness


@pytest.mark.parametrize("df, critical", [(2, 13.816), (7, 24.322), (11, 31.264), (15, 37.697)])
def test_chi2_sf_matches_table_at_alpha(df, critical):
    # 0.999 quantiles of chi-square from standard tables.
    assert st.chi2_sf(critical, df) == pytest.approx(1e-3, rel=0.25)
    assert st.chi2_sf(critical * 0.8, df) > 1e-3 > st.chi2_sf(critical * 1.2, df)


def test_reference_rule_is_lossless():
    """Two draft positions per round over the fixed pairs: each emitted position follows its p."""
    n, k = 120_000, 2
    for shift in range(len(st.PAIRS)):
        pairs = st.PAIRS[shift:] + st.PAIRS[:shift]
        p, q, seed, pos = st.round_inputs(n, k, pairs)
        vtok = np.zeros((n, k + 1), np.int32)
        prob = np.zeros((n, k), F32)
        sr.sample_draft(q, seed, pos, vtok[:, 1:], prob)
        brk = np.tile(np.array([k, 0], np.int32), (n, 1))
        n_acc, last = run_accept(vtok, p, q, brk, seed, pos)
        for j in range(k):
            pval, info = st.goodness_of_fit(st.emitted(vtok, n_acc, last, j), p[0, j])
            assert pval > st.ALPHA, f"{pairs[j][0]} draft position {j}: {info}"


@pytest.mark.parametrize("name, p, q", st.PAIRS, ids=[c[0] for c in st.PAIRS])
def test_the_chi2_test_rejects_wrong_rules(name, p, q):
    rng = np.random.default_rng(20261130)
    n = 120_000
    pval, info = st.goodness_of_fit(st.one_draft(p, q, n, "correct", rng), p)
    assert pval > st.ALPHA, info
    for rule in st.WRONG_RULES:
        pval, info = st.goodness_of_fit(st.one_draft(p, q, n, rule, rng), p)
        assert pval < st.ALPHA, f"{rule} passed on {name}: {info}"


# ------------------------------------------------------------------ validation


def test_check_sampling_accepts_and_normalizes():
    assert check_sampling() == SamplingParams(0.0, 0, 1.0, 0)
    got = check_sampling(np.float32(0.7), np.int64(40), 0.95, 2**64 - 1)
    assert got == SamplingParams(float(np.float32(0.7)), 40, 0.95, 2**64 - 1)
    assert type(got.top_k) is int and type(got.seed) is int


@pytest.mark.parametrize("kw, exc, match", [
    (dict(temperature=-0.5), ValueError, r"temperature must be >= 0, got -0.5"),
    (dict(temperature=float("nan")), ValueError, r"temperature must be finite, got nan"),
    (dict(temperature=float("inf")), ValueError, r"temperature must be finite, got inf"),
    (dict(temperature=1e-50), ValueError, r"temperature must be 0 or >= .*, got 1e-50"),
    (dict(temperature=1e-40), ValueError, r"temperature must be 0 or >= 1.17549435.*e-38, got 1e-40"),
    (dict(temperature="1"), TypeError, r"temperature must be a number, got str '1'"),
    (dict(temperature=True), TypeError, r"temperature must be a number, got bool True"),
    (dict(top_k=-1), ValueError, r"top_k must be >= 0 \(0 = off\), got -1"),
    (dict(top_k=2.0), TypeError, r"top_k must be an int, got float 2.0"),
    (dict(top_k=2**31), ValueError, r"top_k must be <= 2147483647, got 2147483648"),
    (dict(temperature=1e39), ValueError, r"temperature must fit float32 .*, got 1e\+39"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_p=1e-50), ValueError, r"top_p must not round to 0 in float32 .*, got 1e-50"),
    (dict(top_p=1e-40), ValueError, r"top_p must not round to 0 in float32 .*, got 1e-40"),  # subnormal: flushed
    (dict(top_p=float("nan")), ValueError, r"top_p must be finite, got nan"),
    (dict(top_p=None), TypeError, r"top_p must be a number, got NoneType None"),
    (dict(seed=-1), ValueError, r"seed must be in \[0, 2\*\*64\), got -1"),
    (dict(seed=2**64), ValueError, r"seed must be in \[0, 2\*\*64\), got 18446744073709551616"),
    (dict(seed=1.0), TypeError, r"seed must be an int, got float 1.0"),
])
def test_check_sampling_rejects_with_named_field(kw, exc, match):
    with pytest.raises(exc, match=match):
        check_sampling(**kw)


# ------------------------------------------------------------------ flush to zero
# The device module is compiled with -ftz=true (CuPy appends it): every float op reads a
# subnormal input as 0 and flushes a subnormal result. Each case below gives a different
# answer without the flush, which the test also checks, so it fails if the twin stops
# modelling it. tests/kernels/test_sampling_gpu.py runs the same inputs on the device.

TINY = F32(2.0**-126)


def test_ftz_helper():
    x = np.array([1e-40, -1e-40, TINY, -TINY, 0.0, -0.0, np.inf, np.nan, 1.0], F32)
    got = sr.ftz(x)
    assert got[:2].tolist() == [0.0, 0.0] and np.signbit(got[1]) and not np.signbit(got[0])
    assert got[2] == TINY and got[3] == -TINY and np.isinf(got[6]) and np.isnan(got[7]) and got[8] == 1


def test_ftz_probability_underflow_is_zero():
    logits = np.array([[[0, 0, 0, -86.5]]], F32)
    e = sr.exp_neg(F32(-86.5))
    assert e >= TINY and 0 < e / F32(3) < TINY  # without the flush p[3] would be subnormal
    out = probs(logits, 1.0)
    assert out[0, 0, 3] == 0 and np.all(out[0, 0, :3] > 0)


def test_ftz_subnormal_logit_ranks_as_zero():
    logits = np.array([[[0.0, 1e-40, -1.0]]], F32)
    assert np.argmax(logits) == 1  # unflushed order
    assert probs(logits, 0.0)[0, 0].tolist() == [1, 0, 0]
    assert probs(logits, 1.0, top_k=1)[0, 0].tolist() == [1, 0, 0]


def test_ftz_subnormal_weight_is_no_weight():
    w = np.array([[1e-40, 0, 0]] * 3, F32)
    assert sr.race(w, np.arange(3, dtype=np.uint64), np.zeros(3), 0)[0].tolist() == [-1] * 3  # unflushed: 0


def ftz_accept_inputs():
    """Two sequences, k = 1, V = 3: a subnormal p(x) (never accepted when flushed) and a
    residual whose only positive entry is subnormal (flushed: the replacement comes from p)."""
    p = np.zeros((2, 2, 3), F32)
    q = np.zeros((2, 1, 3), F32)
    p[0, 0] = [1e-39, 0.5, 0.5]
    q[0, 0] = [1e-39, 0.5, 0.5]
    p[1, 0] = [0.0, 2.0**-125, 1.0]
    q[1, 0] = [0.5, 1.5 * 2.0**-126, 1.0]
    p[:, 1] = [0.25, 0.25, 0.5]
    vtok = np.array([[5, 0], [5, 0]], np.int32)
    brk = np.array([[1, 0], [1, 0]], np.int32)
    return vtok, p, q, brk, np.array([3, 4], np.uint64), np.array([10, 20], np.int32)


def test_ftz_accept_and_residual():
    vtok, p, q, brk, seed, pos = ftz_accept_inputs()
    assert 0 < p[1, 0, 1] - q[1, 0, 1] < TINY  # unflushed residual: token 1 only
    n_acc, last = run_accept(vtok, p, q, brk, seed, pos)
    assert n_acc.tolist() == [0, 0]  # unflushed, u * q < p would accept draft 0 of row 0
    assert last[1] == 2  # flushed residual is all zero: drawn from p, whose mass is at 2


def test_race_words_of_single_elements_match_the_row_layout(rng):
    seed = rng.integers(0, 2**64, 3, dtype=np.uint64)
    pos = rng.integers(0, 2**32, 3)
    rows = sp.race_words(seed, pos, constants.DRAW_DRAFT, 40)
    idx = np.array([0, 7, 39])
    assert np.array_equal(sp.race_words_at(seed, pos, constants.DRAW_DRAFT, idx), rows[np.arange(3), idx])
    # Word i % 4 of counter [pos, draw, i // 4, 0], spelled out for one element.
    ctr = np.array([pos[1] & 0xFFFFFFFF, constants.DRAW_DRAFT, 7 // 4, 0], np.uint32)
    key = np.array([int(seed[1]) & 0xFFFFFFFF, int(seed[1]) >> 32], np.uint32)
    assert rows[1, 7] == sp.philox4x32_10(ctr, key)[7 % 4]


# ------------------------------------------------------------------ the fused draft step


def fused_draft(logits, temp, top_k=0, top_p=1.0, seed=None, pos=None):
    b, k, _ = logits.shape
    seed = np.arange(b, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) if seed is None else seed
    pos = np.arange(b, dtype=np.int32) * 13 if pos is None else pos
    q = np.full_like(logits, np.nan)
    tok, prob = np.full((b, k), -9, np.int32), np.full((b, k), np.nan, F32)
    sr.draft_probs_sample(logits, np.full(b, temp, F32), np.full(b, top_k, np.int32), np.full(b, top_p, F32), seed,
                          pos, q, tok, prob)
    return q, tok, prob, seed, pos


@pytest.mark.parametrize("vocab", [19, 5000])
def test_fused_draft_step_is_a_race_over_its_probabilities(vocab):
    """q equals probs_from_logits bit for bit, draft_prob = q[token], and the token equals a
    float64 race over q with the same exponentials (the fused race rescales tile winners
    in float32, so a near-tie may differ: at most 1 row in 500)."""
    rng = np.random.default_rng(vocab)
    logits = (rng.normal(size=(500, 2, vocab)) * 2).astype(F32)
    q, tok, prob, seed, pos = fused_draft(logits, 0.8, top_p=0.97)
    assert np.array_equal(q, probs(logits, 0.8, top_p=0.97))
    assert np.array_equal(prob, np.take_along_axis(q, tok[..., None], axis=2)[..., 0]) and np.all(prob > 0)
    agree = 0
    for t in range(2):
        words = sp.race_words(seed, pos.astype(np.int64) + t + 1, constants.DRAW_DRAFT, -(-vocab // 4) * 4)
        e = sp.expo(words)[:, :vocab].astype(np.float64)
        key = np.where(q[:, t] > 0, q[:, t] / e, -1.0)
        agree += int(np.sum(np.argmax(key, axis=1) == tok[:, t]))
    assert agree >= 2 * 500 - 1


def test_fused_draft_step_greedy_and_distribution():
    logits = np.array([[[1, 3, 3, 2]]] * 2, F32)
    q, tok, prob, *_ = fused_draft(logits, 0.0)
    assert tok.tolist() == [[1], [1]] and prob.tolist() == [[1], [1]] and q[0, 0].tolist() == [0, 1, 0, 0]
    # Temperature 1 over a small vocabulary: the proposals follow q (chi-square).
    n = 40_000
    row = np.log(np.array([0.4, 0.3, 0.2, 0.1, 1e-9], np.float64)).astype(F32)
    q, tok, *_ = fused_draft(np.tile(row, (n, 1, 1)), 1.0)
    pval, info = st.goodness_of_fit(tok[:, 0], q[0, 0])
    assert pval > st.ALPHA, info
