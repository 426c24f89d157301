"""Sampling kernels on the device: bit-exact against sampling_ref.py, lossless, graph-safe.

Outputs are pre-filled with poison (NaN or -7) so a row or column a kernel forgets to
write fails the comparison, and so is the scratch (stale partials must never be read);
sizes are awkward on purpose: V = 1, 7, 19, 257 (one partial tile, partial float4s),
2048 (one full tile), 2049 and 5000 (a last tile of 1 or 904 tokens), 32000 and 128256
(the Llama shapes, 16 and 63 tiles).
"""

from __future__ import annotations

import numpy as np
import pytest

import sampling_stats as st
from marks import gpu
from graphburst.kernels import reference
from graphburst.kernels import sampling_ref as sr
from graphburst.constants import PLACEHOLDER_TOKEN

pytestmark = gpu
cp = pytest.importorskip("cupy")

BATCHES = [1, 7, 19, 257]
VOCABS = [1, 7, 19, 257, 2048, 2049, 5000, 32000]
BIG_VOCAB = 128256  # Llama 3: batches 1 and 16 only (the numpy twin is the slow side)
F32 = np.float32
POISON = -7


@pytest.fixture(scope="module")
def ops():
    from graphburst.kernels import cuda_ops

    cuda_ops.warm_up(cp.cuda.Device().id)
    return cuda_ops


@pytest.fixture
def stream():
    """A non-blocking stream that is also current, so the test's own cupy work (fills,
    copies, concatenations) is ordered with the kernels launched on it."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        yield s


def assert_bits(got, want, what):
    got = cp.asnumpy(got)
    want = np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.dtype == np.float32:
        got, want = got.view(np.int32), want.view(np.int32)
    np.testing.assert_array_equal(got, want, err_msg=what)


def settings(rng, batch, vocab):
    temp = rng.choice(np.array([0, 0.25, 1, 2.5], F32), batch)
    top_k = rng.choice(np.array([0, 1, 3, 50, vocab - 1, vocab, vocab + 5], np.int64), batch).astype(np.int32)
    top_p = rng.choice(np.array([1, 0.95, 0.5, 1e-6], F32), batch)
    return temp, top_k, top_p


def random_logits(rng, shape):
    logits = (rng.normal(size=shape) * rng.choice([0.5, 3.0, 20.0])).astype(F32)
    vocab = shape[-1]
    if vocab > 3:
        logits[::3, :, 1] = logits[::3].max(axis=-1)  # ties at the maximum
        logits[1::4, 0, : vocab // 2] = -np.inf
        logits[2::5, :, 2] = -0.0
    return logits


def ref_probs(logits, temp, top_k, top_p):
    out = np.full_like(logits, np.nan)
    sr.probs_from_logits(logits, temp, top_k, top_p, out)
    return out


def dev(*arrays):
    return [cp.asarray(a) for a in arrays]


def scratch(batch, rows, vocab):
    """Sampling scratch full of poison: a kernel that reads a cell this call did not write fails."""
    from graphburst.kernels.sampling_scratch import SampleScratch

    s = SampleScratch(batch, rows, vocab, cp)
    for name in ("sel_thr", "tile_key", "race_key", "sel_part"):
        getattr(s, name).fill(np.uint64(0xFFFFFFFFFFFFFFF0))
    for name in ("tile_sum", "race_w"):
        getattr(s, name).fill(cp.nan)
    return s


def shapes(batches=BATCHES, vocabs=VOCABS):
    return [(b, v) for v in vocabs for b in batches] + [(b, BIG_VOCAB) for b in (1, 16)]


# ------------------------------------------------------------------ bit-exact


@pytest.mark.parametrize("batch, vocab", shapes())
def test_probs_from_logits_matches_reference(rng, ops, stream, batch, vocab):
    logits = random_logits(rng, (batch, 2, vocab))
    if vocab > 2 * 2048:
        logits[0, 1, :2048] = -np.inf  # a whole tile of -inf: scale 0
    temp, top_k, top_p = settings(rng, batch, vocab)
    want = ref_probs(logits, temp, top_k, top_p)
    d_logits, d_temp, d_k, d_p = dev(logits, temp, top_k, top_p)
    sc = scratch(batch, 3, vocab)
    out = cp.full(logits.shape, cp.nan, cp.float32)
    ops.probs_from_logits(d_logits, d_temp, d_k, d_p, out, sc, stream=stream)
    in_place = d_logits.copy()
    ops.probs_from_logits(in_place, d_temp, d_k, d_p, in_place, scratch(batch, 2, vocab), stream=stream)
    one = cp.full(logits.shape, POISON, cp.float32)
    ops.probs_from_logits(d_logits, d_temp, d_k, d_p, one, sc, step=1, stream=stream)
    stream.synchronize()
    assert_bits(out, want, "probs")
    assert_bits(in_place, want, "probs in place")
    assert_bits(one[:, 1], want[:, 1], "probs step=1")
    assert bool(cp.all(one[:, 0] == POISON)), "step=1 wrote row 0"


def random_q(rng, batch, k, vocab):
    q = (rng.random((batch, k, vocab)) ** 3).astype(F32)
    q[:, :, rng.random(vocab) < 0.2] = 0
    q[:, :, 0] += F32(1e-3)  # every row keeps some mass ...
    q /= q.sum(axis=-1, keepdims=True)
    if batch > 2:
        q[2, 1] = 0  # ... but this one, which must give PLACEHOLDER_TOKEN
    return q


@pytest.mark.parametrize("batch, vocab", shapes())
def test_draft_probs_sample_matches_reference(rng, ops, stream, batch, vocab):
    """The fused draft step: q in place and the proposal, bit for bit, all rows and one row."""
    k = 3
    logits = random_logits(rng, (batch, k, vocab))
    temp, top_k, top_p = settings(rng, batch, vocab)
    seed = rng.integers(0, 2**64, batch, dtype=np.uint64)
    pos = rng.integers(-5, 2**31 - 10, batch).astype(np.int32)
    want_q = np.full(logits.shape, np.nan, F32)
    want_tok = np.full((batch, k), POISON, np.int32)
    want_prob = np.full((batch, k), np.nan, F32)
    sr.draft_probs_sample(logits, temp, top_k, top_p, seed, pos, want_q, want_tok, want_prob)
    d_logits, d_temp, d_k, d_p, d_seed, d_pos = dev(logits, temp, top_k, top_p, seed, pos)
    q = d_logits.copy()  # in place, as the decoder runs it
    tok = cp.full((batch, k), POISON, cp.int32)
    prob = cp.full((batch, k), cp.nan, cp.float32)
    ops.draft_probs_sample(q, d_temp, d_k, d_p, d_seed, d_pos, q, tok, prob, scratch(batch, k + 1, vocab),
                           stream=stream)
    q1 = cp.full(logits.shape, POISON, cp.float32)
    tok1 = cp.full((batch, k), POISON, cp.int32)
    prob1 = cp.full((batch, k), cp.nan, cp.float32)
    ops.draft_probs_sample(d_logits, d_temp, d_k, d_p, d_seed, d_pos, q1, tok1, prob1, scratch(batch, k, vocab),
                           step=1, stream=stream)
    stream.synchronize()
    assert_bits(q, want_q, "q")
    assert_bits(tok, want_tok, "draft_tok")
    assert_bits(prob, want_prob, "draft_prob")
    assert_bits(q1[:, 1], want_q[:, 1], "q step=1")
    assert_bits(tok1[:, 1], want_tok[:, 1], "draft_tok step=1")
    assert_bits(prob1[:, 1], want_prob[:, 1], "draft_prob step=1")
    assert bool(cp.all(tok1[:, [0, 2]] == POISON)) and bool(cp.all(q1[:, [0, 2]] == POISON)), "step=1 wrote other rows"


@pytest.mark.parametrize("batch, vocab", shapes())
def test_sample_draft_matches_reference(rng, ops, stream, batch, vocab):
    k = 3
    q = random_q(rng, batch, k, vocab)
    seed = rng.integers(0, 2**64, batch, dtype=np.uint64)
    pos = rng.integers(-5, 2**31 - 10, batch).astype(np.int32)
    want_tok = np.full((batch, k), POISON, np.int32)
    want_prob = np.full((batch, k), np.nan, F32)
    sr.sample_draft(q, seed, pos, want_tok, want_prob)
    d_q, d_seed, d_pos = dev(q, seed, pos)
    tok = cp.full((batch, k), POISON, cp.int32)
    prob = cp.full((batch, k), cp.nan, cp.float32)
    ops.sample_draft(d_q, d_seed, d_pos, tok, prob, scratch(batch, k, vocab), stream=stream)
    tok1 = cp.full((batch, k), POISON, cp.int32)
    prob1 = cp.full((batch, k), cp.nan, cp.float32)
    ops.sample_draft(d_q, d_seed, d_pos, tok1, prob1, scratch(batch, k + 1, vocab), step=1, stream=stream)
    stream.synchronize()
    assert_bits(tok, want_tok, "draft_tok")
    assert_bits(prob, want_prob, "draft_prob")
    assert_bits(tok1[:, 1], want_tok[:, 1], "draft_tok step=1")
    assert bool(cp.all(tok1[:, [0, 2]] == POISON)), "step=1 wrote other rows"


def accept_inputs(rng, batch, k, vocab):
    """p, q from the reference filters, drafts from q, then broken drafts and markers."""
    temp, top_k, top_p = settings(rng, batch, vocab)
    p = ref_probs(random_logits(rng, (batch, k + 1, vocab)), temp, top_k, top_p)
    q = ref_probs(random_logits(rng, (batch, k, vocab)), *settings(rng, batch, vocab))
    seed = rng.integers(0, 2**64, batch, dtype=np.uint64)
    pos = rng.integers(0, 2**30, batch).astype(np.int32)
    vtok = np.zeros((batch, k + 1), np.int32)
    vtok[:, 0] = rng.integers(0, vocab, batch)
    sr.sample_draft(q, seed, pos, vtok[:, 1:], np.zeros((batch, k), F32))
    # p-agreeing drafts so long accepted runs happen, then junk the kernel must reject.
    agree = rng.random((batch, k)) < 0.3
    vtok[:, 1:] = np.where(agree, np.argmax(p[:, :k], axis=-1), vtok[:, 1:])
    junk = rng.random((batch, k)) < 0.05
    vtok[:, 1:] = np.where(junk, rng.choice(np.array([PLACEHOLDER_TOKEN, vocab, -3]), (batch, k)), vtok[:, 1:])
    brk = np.stack([rng.integers(-2, k + 3, batch), rng.integers(0, 2, batch)], axis=1).astype(np.int32)
    brk[rng.random(batch) < 0.5] = [k, 0]
    return vtok, p, q, brk, seed, pos


@pytest.mark.parametrize("batch, vocab", shapes())
def test_accept_sample_matches_reference(rng, ops, stream, batch, vocab):
    k = 3
    host = accept_inputs(rng, batch, k, vocab)
    want_n = np.full(batch, POISON, np.int32)
    want_last = np.full(batch, POISON, np.int32)
    sr.accept_sample(*host, want_n, want_last)
    n_acc = cp.full(batch, POISON, cp.int32)
    last = cp.full(batch, POISON, cp.int32)
    ops.accept_sample(*dev(*host), n_acc, last, scratch(batch, 1, vocab), stream=stream)
    stream.synchronize()
    assert_bits(n_acc, want_n, "n_acc")
    assert_bits(last, want_last, "last_pred")


def test_hand_cases_on_device(ops, stream):
    # Greedy ties (lowest index, -0 == +0) and the top-p head of the CPU tests.
    logits = np.array([[[1, 3, 3, 2]], [[-0.0, 0.0, -1, -np.inf]], [[-np.inf, -np.inf, 5, 5]]], F32)
    zeros = np.zeros(3, F32)
    out = cp.full(logits.shape, cp.nan, cp.float32)
    ops.probs_from_logits(*dev(logits, zeros, np.zeros(3, np.int32), np.ones(3, F32)), out, scratch(3, 1, 4),
                          stream=stream)
    head = np.log(np.array([[[0.5, 0.3, 0.15, 0.05]]] * 4)).astype(F32)
    head_out = cp.full(head.shape, cp.nan, cp.float32)
    ops.probs_from_logits(*dev(head, np.ones(4, F32), np.zeros(4, np.int32), np.array([0.4, 0.55, 0.81, 0.96], F32)),
                          head_out, scratch(4, 1, 4), stream=stream)
    stream.synchronize()
    assert cp.asnumpy(out)[:, 0].tolist() == [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]]
    assert (cp.asnumpy(head_out)[:, 0] > 0).sum(axis=1).tolist() == [1, 2, 3, 4]


# ------------------------------------------------------------------ greedy equivalence


@pytest.mark.parametrize("vocab", [7, 257, 32000])
def test_temperature_zero_and_top_k_one_equal_greedy(rng, ops, stream, vocab):
    batch, k = 257, 4
    logits = random_logits(rng, (batch, k + 1, vocab))
    vtok, _, q, brk, seed, pos = accept_inputs(rng, batch, k, vocab)
    tgt_pred = np.argmax(logits, axis=-1).astype(np.int32)
    agree = rng.random((batch, k)) < 0.7
    vtok[:, 1:] = np.where(agree, tgt_pred[:, :k], vtok[:, 1:])
    d_logits, d_vtok, d_q, d_brk, d_seed, d_pos, d_pred = dev(logits, vtok, q, brk, seed, pos, tgt_pred)
    want_n = cp.full(batch, POISON, cp.int32)
    want_last = cp.full(batch, POISON, cp.int32)
    ops.accept_greedy(d_vtok, d_pred, d_brk, want_n, want_last, stream=stream)  # the greedy kernel
    sc = scratch(batch, k + 1, vocab)
    for temp, top_k in [(0.0, 0), (1.3, 1)]:
        p = cp.full(logits.shape, cp.nan, cp.float32)
        ops.probs_from_logits(d_logits, cp.full(batch, temp, cp.float32), cp.full(batch, top_k, cp.int32),
                              cp.ones(batch, cp.float32), p, sc, stream=stream)
        n_acc = cp.full(batch, POISON, cp.int32)
        last = cp.full(batch, POISON, cp.int32)
        ops.accept_sample(d_vtok, p, d_q, d_brk, d_seed, d_pos, n_acc, last, sc, stream=stream)
        stream.synchronize()
        assert_bits(n_acc, cp.asnumpy(want_n), f"n_acc, temperature {temp}, top_k {top_k}")
        assert_bits(last, cp.asnumpy(want_last), f"last_pred, temperature {temp}, top_k {top_k}")
    host_n = np.zeros(batch, np.int32)
    reference.accept_greedy(vtok, tgt_pred, brk, host_n, np.zeros(batch, np.int32))
    assert 0 < host_n.mean() < k


# ------------------------------------------------------------------ determinism, graphs


def pipeline(ops, stream, logits, temp, top_k, top_p, seed, pos, k):
    """probs -> draft sampling -> accept, all on the device without a sync in between."""
    batch, vocab = logits.shape[0], logits.shape[2]
    sc = scratch(batch, k + 1, vocab)
    p = cp.empty_like(logits)
    ops.probs_from_logits(logits, temp, top_k, top_p, p, sc, stream=stream)
    q = p[:, :k].copy()  # a draft that proposes from the target's own filtered rows
    draft_tok = cp.empty((batch, k), cp.int32)
    draft_prob = cp.empty((batch, k), cp.float32)
    ops.sample_draft(q, seed, pos, draft_tok, draft_prob, sc, stream=stream)
    vtok = cp.concatenate([cp.zeros((batch, 1), cp.int32), draft_tok], axis=1)
    brk = cp.tile(cp.array([k, 0], cp.int32), (batch, 1))
    n_acc = cp.empty(batch, cp.int32)
    last = cp.empty(batch, cp.int32)
    ops.accept_sample(vtok, p, q ** 0.5 / (q ** 0.5).sum(axis=-1, keepdims=True), brk, seed, pos, n_acc, last, sc,
                      stream=stream)
    stream.synchronize()
    return cp.asnumpy(draft_tok), cp.asnumpy(n_acc), cp.asnumpy(last)


def test_batch_permutation_permutes_outputs(rng, ops, stream):
    batch, k, vocab = 100, 3, 257
    logits = random_logits(rng, (batch, k + 1, vocab))
    temp, top_k, top_p = settings(rng, batch, vocab)
    seed = rng.integers(0, 2**64, batch, dtype=np.uint64)
    pos = rng.integers(0, 10_000, batch).astype(np.int32)
    perm = rng.permutation(batch)
    with stream:
        base = pipeline(ops, stream, *dev(logits, temp, top_k, top_p, seed, pos), k)
        moved = pipeline(ops, stream, *dev(logits[perm], temp[perm], top_k[perm], top_p[perm], seed[perm], pos[perm]), k)
    for a, b in zip(base, moved):
        np.testing.assert_array_equal(a[perm], b)


@pytest.mark.parametrize("vocab", [257, 5000])
def test_graph_replay_needs_nothing_from_the_host(rng, ops, stream, vocab):
    """probs -> k draft steps (fused and from q) -> assemble -> accept, captured once and
    replayed twice over poisoned outputs."""
    batch, k = 19, 3
    logits = cp.asarray(random_logits(rng, (batch, k + 1, vocab)))  # [B, K1, V]
    q_logits = cp.asarray(random_logits(rng, (batch, k, vocab)))  # [B, k, V]
    temp, top_k, top_p = dev(*settings(rng, batch, vocab))
    seed = cp.asarray(rng.integers(0, 2**64, batch, dtype=np.uint64))  # [B] uint64
    pos = cp.asarray(rng.integers(0, 10_000, batch).astype(np.int32))  # [B]
    pend = cp.asarray(rng.integers(0, vocab, batch).astype(np.int32))  # [B]
    p = cp.empty(logits.shape, cp.float32)  # [B, K1, V]
    q = cp.empty(q_logits.shape, cp.float32)  # [B, k, V]
    draft_tok = cp.empty((batch, k), cp.int32)
    draft_prob = cp.empty((batch, k), cp.float32)
    vtok = cp.empty((batch, k + 1), cp.int32)
    brk = cp.tile(cp.array([k, 0], cp.int32), (batch, 1))  # [B, 2]
    n_acc = cp.empty(batch, cp.int32)
    last = cp.empty(batch, cp.int32)
    q2 = cp.empty(q_logits.shape, cp.float32)  # [B, k, V] the fused draft step's q
    tok2 = cp.empty((batch, k), cp.int32)
    prob2 = cp.empty((batch, k), cp.float32)
    sc = scratch(batch, k + 1, vocab)  # allocated before the capture, like the decoder's
    outputs = (p, q, draft_tok, draft_prob, vtok, n_acc, last, q2, tok2, prob2)

    def body(s):
        ops.probs_from_logits(logits, temp, top_k, top_p, p, sc, stream=s)
        ops.probs_from_logits(q_logits, temp, top_k, top_p, q, sc, stream=s)
        for j in range(k):  # one draft step at a time, as a draft model would
            ops.sample_draft(q, seed, pos, draft_tok, draft_prob, sc, step=j, stream=s)
            ops.draft_probs_sample(q_logits, temp, top_k, top_p, seed, pos, q2, tok2, prob2, sc, step=j, stream=s)
        ops.assemble_verify(pend, draft_tok, brk, vtok, stream=s)
        ops.accept_sample(vtok, p, q, brk, seed, pos, n_acc, last, sc, stream=s)

    body(stream)
    want = [cp.asnumpy(a) for a in outputs]  # syncs the (current) test stream
    s = cp.cuda.Stream(non_blocking=True)
    s.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)  # pool growth inside would raise
    body(s)
    graph = s.end_capture()
    graph.upload(s)
    for _ in range(2):
        with s:
            for a in outputs:
                a.fill(POISON)
            graph.launch(s)
            got = [cp.asnumpy(a) for a in outputs]
        for g, exp in zip(got, want):
            np.testing.assert_array_equal(g.view(np.int32) if g.dtype == np.float32 else g,
                                          exp.view(np.int32) if exp.dtype == np.float32 else exp,
                                          err_msg="graph replay")


# ------------------------------------------------------------------ losslessness


def test_device_rule_is_lossless_and_wrong_rules_fail(ops, stream):
    n, k = 400_000, 2
    checked = 20_000  # rows also compared bit for bit with the reference
    for shift in range(len(st.PAIRS)):
        pairs = st.PAIRS[shift:] + st.PAIRS[:shift]
        p, q, seed, pos = st.round_inputs(n, k, pairs)
        d_p, d_q, d_seed, d_pos = dev(p, q, seed, pos)
        draft_tok = cp.full((n, k), POISON, cp.int32)
        draft_prob = cp.full((n, k), cp.nan, cp.float32)
        sc = scratch(n, k + 1, p.shape[2])
        ops.sample_draft(d_q, d_seed, d_pos, draft_tok, draft_prob, sc, stream=stream)
        vtok = cp.concatenate([cp.zeros((n, 1), cp.int32), draft_tok], axis=1)
        brk = cp.tile(cp.array([k, 0], cp.int32), (n, 1))
        n_acc = cp.full(n, POISON, cp.int32)
        last = cp.full(n, POISON, cp.int32)
        ops.accept_sample(vtok, d_p, d_q, brk, d_seed, d_pos, n_acc, last, sc, stream=stream)
        stream.synchronize()
        h_vtok, h_n, h_last = cp.asnumpy(vtok), cp.asnumpy(n_acc), cp.asnumpy(last)
        for j in range(k):
            pval, info = st.goodness_of_fit(st.emitted(h_vtok, h_n, h_last, j), p[0, j])
            print(f"device {pairs[j][0]} draft position {j}: p = {pval:.3g}, {info}")
            assert pval > st.ALPHA, f"{pairs[j][0]} draft position {j}: {info}"
        want_n = np.zeros(checked, np.int32)
        want_last = np.zeros(checked, np.int32)
        sr.accept_sample(h_vtok[:checked], p[:checked], q[:checked], cp.asnumpy(brk)[:checked], seed[:checked],
                         pos[:checked], want_n, want_last)
        np.testing.assert_array_equal(h_n[:checked], want_n)
        np.testing.assert_array_equal(h_last[:checked], want_last)
    rng = np.random.default_rng(20261130)
    for name, p1, q1 in st.PAIRS:
        for rule in st.WRONG_RULES:
            pval, info = st.goodness_of_fit(st.one_draft(p1, q1, n, rule, rng), p1)
            assert pval < st.ALPHA, f"{rule} passed on {name} with n = {n}: {info}"


# ------------------------------------------------------------------ flush to zero
# CuPy builds the module with -ftz=true; these inputs give different bits without the
# flush (tests/kernels/test_sampling.py checks that on the reference), so both sides must flush.


def test_ftz_probabilities_match_reference(ops, stream):
    logits = np.array([[[0, 0, 0, -86.5]], [[0.0, 1e-40, -1.0, -2.0]], [[1e-40, -1e-40, 0.0, 5e-39]]], F32)
    for temp in (0.0, 1.0, 0.5):
        t = np.full(3, temp, F32)
        k, p = np.zeros(3, np.int32), np.ones(3, F32)
        want = ref_probs(logits, t, k, p)
        out = cp.full(logits.shape, cp.nan, cp.float32)
        ops.probs_from_logits(*dev(logits, t, k, p), out, scratch(3, 1, 4), stream=stream)
        stream.synchronize()
        assert_bits(out, want, f"probs, temperature {temp}")
    assert cp.asnumpy(out)[0, 0, 3] == 0  # e / 3 is subnormal: flushed


def test_ftz_sample_and_accept_match_reference(ops, stream):
    from test_sampling import ftz_accept_inputs

    w = np.array([[[1e-40, 0, 1.0]], [[1e-40, 1e-39, 0]]], F32)  # q [2, 1, 3]
    seed, pos = np.array([1, 2], np.uint64), np.array([0, 0], np.int32)
    want_tok, want_prob = np.full((2, 1), POISON, np.int32), np.full((2, 1), np.nan, F32)
    sr.sample_draft(w, seed, pos, want_tok, want_prob)
    tok, prob = cp.full((2, 1), POISON, cp.int32), cp.full((2, 1), cp.nan, cp.float32)
    ops.sample_draft(*dev(w, seed, pos), tok, prob, scratch(2, 1, 3), stream=stream)
    host = ftz_accept_inputs()
    want_n, want_last = np.full(2, POISON, np.int32), np.full(2, POISON, np.int32)
    sr.accept_sample(*host, want_n, want_last)
    n_acc, last = cp.full(2, POISON, cp.int32), cp.full(2, POISON, cp.int32)
    ops.accept_sample(*dev(*host), n_acc, last, scratch(2, 1, 3), stream=stream)
    stream.synchronize()
    assert_bits(tok, want_tok, "draft_tok")
    assert_bits(prob, want_prob, "draft_prob")
    assert cp.asnumpy(tok).tolist() == [[2], [PLACEHOLDER_TOKEN]]  # subnormal weights are no weight
    assert_bits(n_acc, want_n, "n_acc")
    assert_bits(last, want_last, "last_pred")
    assert cp.asnumpy(n_acc).tolist() == [0, 0] and int(cp.asnumpy(last)[1]) == 2


# ------------------------------------------------------------------ stub distributions, whole bursts


def test_stub_logits_match_reference(rng, ops, stream):
    from graphburst.kernels import reference

    batch, rows, vocab = 19, 4, 1000
    pred = rng.integers(-1, vocab, (batch, rows)).astype(np.int32)
    pos = rng.integers(0, 2**31 - 10, batch).astype(np.int32)
    kw = dict(pos_offset=1, salt=0x1234567, spread=2.0, peak=7.9)
    want = np.full((batch, rows, vocab), np.nan, F32)
    reference.stub_logits(pred, pos, want, **kw)
    got = cp.full(want.shape, cp.nan, cp.float32)
    ops.stub_logits(*dev(pred, pos), got, **kw, stream=stream)
    one = np.full((batch, rows, vocab), POISON, F32)
    reference.stub_logits(pred[:, :1], pos, one, pos_offset=0, salt=5, spread=0.5, peak=1.0, step=0)
    got_one = cp.full(want.shape, POISON, cp.float32)
    ops.stub_logits(cp.asarray(pred[:, :1]), cp.asarray(pos), got_one, pos_offset=0, salt=5, spread=0.5, peak=1.0,
                    step=0, stream=stream)
    stream.synchronize()
    assert_bits(got, want, "stub_logits")
    assert_bits(got_one, one, "stub_logits step=0, pred stride 1")


def test_sampling_burst_equals_numpy_bit_for_bit():
    """The whole sampling burst (stub kernels, draws, first token, draft_append_last) on the
    device gives the numpy backend's tokens, counters and KV lengths exactly."""
    from graphburst.backend import Backend
    from graphburst.engine.decoder import SpecDecoder
    from graphburst.capture import BurstGraph
    from graphburst.models.stubs import stub_pair

    batch = 37
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 1000, int(rng.integers(1, 9))).tolist() for _ in range(batch)]
    kw = dict(temperature=rng.choice([0.0, 0.5, 1.0, 2.0], batch).tolist(),
              top_k=rng.choice([0, 1, 20], batch).tolist(), top_p=rng.choice([1.0, 0.9, 0.3], batch).tolist(),
              seed=[int(s) for s in rng.integers(0, 2**63, batch)])

    def run(name):
        target, draft = stub_pair(batch, 1000, [True, False, True], [True, True], 200, accept_prob=0.6, p_min=0.1,
                                  seed=2, backend=Backend(name))
        dec = SpecDecoder(target, draft, k=4, m_rounds=3, sampling=True)
        dec.prefill(prompts, **kw)
        graph = BurstGraph(dec)
        toks = [[t.tolist() for t in graph.run()] for _ in range(3)]
        return toks, dec.accept_counters().tolist(), draft.cache.lengths(dec.stream).tolist()

    assert run("cupy") == run("numpy")
