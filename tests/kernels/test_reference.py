"""CPU tests of the numpy reference: hand cases, sentinels, and the digest oracle."""

from __future__ import annotations

import re

import numpy as np
import pytest

from graphburst import constants

from graphburst.kernels import digest

from graphburst.kernels import reference
from graphburst.buffers import PtrTable
from graphburst.backend import Backend
from graphburst.models.stubs import stub_cache
from graphburst.kernels.source import kernel_source

CU = kernel_source()  # kernels.cu with its sections inlined


@pytest.mark.parametrize(
    "macro, value",
    [
        ("GB_PLACEHOLDER_TOKEN", constants.PLACEHOLDER_TOKEN),
        ("GB_UNBOUNDED_BUDGET", constants.UNBOUNDED_BUDGET),
        ("GB_NO_PREFILL", constants.NO_PREFILL),
        ("GB_CAP_THREADS", constants.CAP_THREADS),
        ("GB_DIGEST_INIT", digest.DIGEST_INIT),
        ("GB_DIGEST_CORRUPT", digest.DIGEST_CORRUPT),
        # the sampling kernels' launch shapes, draw indices and scratch layout
        ("GB_SAMPLE_THREADS", constants.SAMPLE_THREADS),
        ("GB_SAMPLE_TILE", constants.SAMPLE_TILE),
        ("GB_DRAW_DRAFT", constants.DRAW_DRAFT),
        ("GB_DRAW_ACCEPT", constants.DRAW_ACCEPT),
        ("GB_DRAW_RESAMPLE", constants.DRAW_RESAMPLE),
        ("GB_SEL_THREADS", constants.SELECT_THREADS),
        ("GB_SEL_DIGIT", constants.SELECT_DIGIT),
        ("GB_RACES_PER_ROW", constants.RACES_PER_ROW),
        ("GB_NGRAM_MAX", constants.NGRAM_MAX),
        ("GB_NGRAM_THREADS", constants.NGRAM_THREADS),
        ("GB_FIELDS_THREADS", constants.FIELDS_THREADS),
        ("GB_FIELDS_SPAN", constants.FIELDS_SPAN),
        ("GB_FIELDS_MAX_K1", constants.MAX_K + 1),
    ],
)
def test_cuda_macros_match_python_constants(macro, value):
    m = re.search(rf"#define {macro} \(?(-?(?:0x)?[0-9a-fA-F]+)u?\)?", CU)
    assert m, macro
    assert int(m.group(1), 0) == value


def test_mix32_known_values_and_array_form():
    xs = np.array([0, 1, 0xFFFFFFFF, 123456789], np.uint64)
    scalars = [digest.mix32(int(x)) for x in xs]
    assert digest.mix32(xs).tolist() == scalars
    assert scalars[0] == 0  # lowbias32 fixes 0
    assert len(set(scalars)) == 4


def test_greedy_reference_is_a_function_of_the_prefix():
    a = digest.greedy_reference([3, 1, 4], 20, 50)
    b = digest.greedy_reference([3, 1, 4], 25, 50)
    assert a == b[:20]
    assert digest.greedy_reference([3, 1, 5], 20, 50) != a
    assert all(0 <= t < 50 for t in b)
    # Continuing from a longer prompt equals continuing the sequence.
    assert digest.greedy_reference([3, 1, 4] + a[:5], 15, 50) == a[5:20]


def _accept_case(vtok_drafts, preds, n_valid):
    k = len(vtok_drafts)
    vtok = np.array([[9] + vtok_drafts], np.int32)
    tgt = np.array([preds], np.int32)
    brk = np.array([[n_valid, int(n_valid < k)]], np.int32)
    n_acc = np.full(1, -1, np.int32)
    last = np.full(1, -1, np.int32)
    reference.accept_greedy(vtok, tgt, brk, n_acc, last)
    return int(n_acc[0]), int(last[0])


def test_accept_hand_cases():
    assert _accept_case([5, 6, 7], [5, 2, 7, 8], 3) == (1, 2)  # early mismatch
    assert _accept_case([5, 6, 7], [5, 6, 7, 8], 3) == (3, 8)  # all accepted, bonus = last prediction
    assert _accept_case([5, 6, 7], [1, 6, 7, 8], 3) == (0, 1)  # nothing accepted
    assert _accept_case([5, 6, 7], [5, 6, 7, 8], 0) == (0, 5)  # break at position 0
    assert _accept_case([5, 6, 7], [5, 6, 7, 8], 2) == (2, 7)  # break cuts an agreeing run


def test_ring_commit_stops_at_eos_and_budget():
    vtok = np.array([[4, 5, 6, 7], [4, 5, 6, 7]], np.int32)
    n_acc = np.array([3, 3], np.int32)
    last = np.array([8, 8], np.int32)
    eos = np.array([5, constants.NO_EOS], np.int32)
    budget = np.array([constants.UNBOUNDED_BUDGET, 3], np.int32)
    ring = np.full((2, 9), constants.PLACEHOLDER_TOKEN, np.int32)
    ring[:, 0] = 0
    pend = np.array([4, 4], np.int32)
    acc = np.zeros((2, 2), np.int32)
    n_commit = np.full(2, -1, np.int32)
    reference.ring_commit(vtok, n_acc, last, eos, budget, ring, pend, acc, n_commit)
    assert ring[0, :3].tolist() == [2, 4, 5] and ring[0, 3] == constants.PLACEHOLDER_TOKEN
    assert ring[1, :4].tolist() == [3, 4, 5, 6]
    assert n_commit.tolist() == [2, 3]
    assert budget.tolist() == [0, 0]
    assert acc.tolist() == [[1, 1], [2, 1]]
    assert pend.tolist() == [4, 4]  # a stopped run does not fold the bonus
    # A finished sequence commits nothing more and does not count a round.
    reference.ring_commit(vtok, n_acc, last, eos, budget, ring, pend, acc, n_commit)
    assert n_commit.tolist() == [0, 0] and acc.tolist() == [[1, 1], [2, 1]]


def test_rollback_follows_pointers_and_skips_absent():
    be = Backend("numpy")
    cache = stub_cache([True, False, True], 3, 16, be)
    pos = np.zeros(3, np.int32)
    table = PtrTable([cache.layers[0].length, None, cache.layers[2].length, pos], be)
    reference.rollback_stream(table, np.array([1, 2, 3], np.int32), np.array([4, 0, 1], np.int32))
    assert cache.layers[0].length.tolist() == [5, 2, 4]
    assert cache.layers[2].length.tolist() == [5, 2, 4]
    assert pos.tolist() == [5, 2, 4]


# Property tests: the vectorised reference against a plain scalar statement of the rule.
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def accept_inputs(draw):
    k = draw(st.integers(1, 9))
    batch = draw(st.integers(1, 6))
    tok = st.integers(-1, 3)
    vtok = np.array(draw(st.lists(st.lists(tok, min_size=k + 1, max_size=k + 1), min_size=batch, max_size=batch)),
                    np.int32)
    tgt = np.array(draw(st.lists(st.lists(tok, min_size=k + 1, max_size=k + 1), min_size=batch, max_size=batch)),
                   np.int32)
    brk = np.array([[draw(st.integers(-2, k + 2)), draw(st.integers(0, 1))] for _ in range(batch)], np.int32)
    return vtok, tgt, brk


@settings(max_examples=200, deadline=None)
@given(accept_inputs())
def test_accept_reference_matches_scalar_rule(inputs):
    vtok, tgt, brk = inputs
    k = vtok.shape[1] - 1
    n_acc = np.full(len(vtok), -9, np.int32)
    last = np.full(len(vtok), -9, np.int32)
    reference.accept_greedy(vtok, tgt, brk, n_acc, last)
    for b in range(len(vtok)):
        n_valid = min(max(int(brk[b, 0]), 0), k)
        n = 0
        while n < n_valid and vtok[b, n + 1] == tgt[b, n]:
            n += 1
        assert (n_acc[b], last[b]) == (n, tgt[b, n])


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 6), st.lists(st.integers(0, 4), min_size=7, max_size=7), st.integers(-1, 4),
       st.sampled_from([constants.UNBOUNDED_BUDGET, -1, 0, 1, 2, 5]), st.integers(0, 8))
def test_ring_commit_reference_matches_token_by_token_rule(n_acc, toks, eos, budget, count):
    k = 6
    vtok = np.array([toks], np.int32)
    ring = np.full((1, 2 * (k + 1) + 1), constants.PLACEHOLDER_TOKEN, np.int32)
    ring[0, 0] = count
    out = dict(budget=np.array([budget], np.int32), pend=np.array([9], np.int32), acc=np.zeros((1, 2), np.int32),
               n_commit=np.full(1, -9, np.int32))
    reference.ring_commit(vtok, np.array([n_acc], np.int32), np.array([7], np.int32), np.array([eos], np.int32),
                          out["budget"], ring, out["pend"], out["acc"], out["n_commit"])
    # The rule, one token at a time: stop when the budget is spent, after EOS, or when full.
    left, got = budget, []
    for t in toks[: n_acc + 1]:
        if left <= 0 or count + len(got) >= ring.shape[1] - 1:
            break
        got.append(t)
        left = left if left == constants.UNBOUNDED_BUDGET else left - 1
        if t == eos:
            left = 0
    assert ring[0, 1 + count : 1 + count + len(got)].tolist() == got
    assert int(ring[0, 0]) == count + len(got) and int(out["n_commit"][0]) == len(got)
    assert int(out["budget"][0]) == left
    assert int(out["pend"][0]) == (7 if len(got) == n_acc + 1 else 9)
