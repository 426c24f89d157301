"""CPU tests of the numpy reference: hand cases, sentinels, and the digest oracle."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from graphburst import constants, digest, reference
from graphburst.buffers import KVCache, PtrTable
from graphburst.backend import Backend

CU = (Path(__file__).parents[1] / "graphburst" / "kernels.cu").read_text()


@pytest.mark.parametrize(
    "macro, value",
    [
        ("GB_PLACEHOLDER_TOKEN", constants.PLACEHOLDER_TOKEN),
        ("GB_UNBOUNDED_BUDGET", constants.UNBOUNDED_BUDGET),
        ("GB_NO_PREFILL", constants.NO_PREFILL),
        ("GB_DIGEST_INIT", digest.DIGEST_INIT),
        ("GB_DIGEST_CORRUPT", digest.DIGEST_CORRUPT),
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
    cache = KVCache.for_stub([True, False, True], 3, 16, be)
    pos = np.zeros(3, np.int32)
    table = PtrTable([cache.layers[0].length, None, cache.layers[2].length, pos], be)
    reference.rollback_stream(table, np.array([1, 2, 3], np.int32), np.array([4, 0, 1], np.int32))
    assert cache.layers[0].length.tolist() == [5, 2, 4]
    assert cache.layers[2].length.tolist() == [5, 2, 4]
    assert pos.tolist() == [5, 2, 4]
