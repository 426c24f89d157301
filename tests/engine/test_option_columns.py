"""Per-slot model options as int32 columns the decoder writes in admission's one launch
(graphburst/engine/admission/options.py, protocol hook ``option_columns``)."""

from __future__ import annotations

import numpy as np
import pytest

from graphburst import SpecDecoder
from graphburst.constants import NO_EOS, UNBOUNDED_BUDGET
from graphburst.kernels import reference
from graphburst.kernels.digest import fixed24
from graphburst.models.ngram import NgramDraft
from graphburst.models.stubs import StubTarget, stub_pair

VOCAB = 50


def _host(backend, arr, stream) -> list:
    """A host copy of ``arr`` read on ``stream``, the one that wrote it (a decoder's ``stream``):
    a read on another stream could return the values from before those writes."""
    return backend.to_host(arr, stream).tolist()


def test_admit_slots_hand_case_with_columns():
    from graphburst.backend import Backend
    from graphburst.buffers import PtrTable

    be = Backend("numpy")
    budget, eos = np.array([3, 4, 5], np.int32), np.array([9, 9, 9], np.int32)
    acc = np.ones((3, 2), np.int32)
    seeds = np.array([7, 7, 7], np.uint32)
    other = np.array([-1, -1, -1], np.int32)
    # slot 2 and slot 0 admitted, slot 5 lies outside the batch and is skipped
    table = np.array([[2, 0, 5], [7, UNBOUNDED_BUDGET, 1], [NO_EOS, 11, 1], [-2, 4, 4], [30, 31, 32]], np.int32)
    reference.admit_slots(table, budget, eos, acc, PtrTable([seeds.view(np.int32), other], be))
    assert seeds.tolist() == [4, 7, 2**32 - 2]  # an int32 bit pattern read back as uint32
    assert other.tolist() == [31, -1, 30]
    assert budget.tolist() == [UNBOUNDED_BUDGET, 4, 7] and eos.tolist() == [11, 9, NO_EOS]


def test_admission_writes_the_admitted_slots_options_only(backend):
    target, draft = stub_pair(4, VOCAB, 1, 1, 32, accept_prob=0.25, seed=9, backend=backend)
    dec = SpecDecoder(target, draft, k=2, m_rounds=1)
    assert dec.option_columns.count == 2 and dec.option_columns.roles == ("draft",)
    big = dec.slot_options({"seed": 3_000_000_000, "accept_prob": 1.0})
    dec.prefill_slots([1, 3], [np.array([1, 2], np.int32), np.array([3], np.int32)], [0, 0],
                      options=[big, dec.slot_options({"seed": 5})])
    assert _host(backend, draft.seed, dec.stream) == [9, 3_000_000_000, 9, 5]
    assert _host(backend, draft.agree24, dec.stream) == [1 << 22, 1 << 24, 1 << 22, 1 << 22]
    # no options: the slots keep theirs; None: the defaults
    dec.prefill_slots([1], [np.array([4], np.int32)], [0])
    assert _host(backend, draft.seed, dec.stream) == [9, 3_000_000_000, 9, 5]
    dec.prefill_slots([0, 1], [np.array([4], np.int32)] * 2, [0, 0], options=[None, None])
    assert _host(backend, draft.seed, dec.stream) == [9, 9, 9, 5]
    assert _host(backend, draft.agree24, dec.stream) == [fixed24(0.25)] * 4
    assert dec.run_burst().counts.tolist() == [1, 1, 0, 1]  # a burst still runs on the admitted slots


def test_prefill_checked_applies_options_of_other_slots_apart(backend):
    target, draft = stub_pair(3, VOCAB, 1, 1, 32, seed=9, backend=backend)
    dec = SpecDecoder(target, draft, k=2, m_rounds=1)
    # slot 2's options without a prompt: scattered, not carried by the admission table
    dec.prefill_checked({0: np.array([1, 2], np.int32)}, {0: 0},
                        options={0: dec.slot_options({"seed": 1}), 2: dec.slot_options({"seed": 2})})
    assert _host(backend, draft.seed, dec.stream) == [1, 9, 2]
    dec.set_slot_options({0: None, 1: dec.slot_options({"seed": 4})})
    assert _host(backend, draft.seed, dec.stream) == [9, 4, 2]


def test_ngram_range_through_admission(backend):
    target = StubTarget(3, VOCAB, 1, 64, backend=backend)
    draft = NgramDraft(3, VOCAB, 64, n_min=1, n_max=3, backend=backend)
    dec = SpecDecoder(target, draft, k=3, m_rounds=2)
    dec.prefill_checked({0: np.array([1, 2, 1, 2], np.int32), 2: np.array([5], np.int32)}, {0: 0, 2: 0},
                        options={0: dec.slot_options({"ngram_min": 2, "ngram_max": 2}), 2: None})
    assert _host(backend, draft.n_min, dec.stream) == [2, 1, 1]
    assert _host(backend, draft.n_max, dec.stream) == [2, 3, 3]


class _RecordingTarget(StubTarget):
    """A target whose option is not a column: it keeps ``set_slot_options``."""

    option_keys = frozenset({"tag"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.applied = []

    def slot_options(self, options: dict):
        return options.get("tag")

    def set_slot_options(self, settings: dict, stream) -> None:
        self.applied.append(dict(settings))


def test_a_model_without_columns_still_gets_set_slot_options():
    _, draft = stub_pair(2, VOCAB, 1, 1, 32, seed=9, backend="numpy")
    target = _RecordingTarget(2, VOCAB, 1, 32, backend="numpy")
    dec = SpecDecoder(target, draft, k=2, m_rounds=1)
    dec.prefill_slots([0, 1], [np.array([1], np.int32)] * 2, [0, 0],
                      options=[dec.slot_options({"tag": "a", "seed": 3}), None])
    assert target.applied == [{0: "a", 1: None}]
    assert draft.seed.tolist() == [3, 9]


class _BadColumns(StubTarget):
    def __init__(self, *args, columns, values, **kwargs):
        super().__init__(*args, **kwargs)
        self._cols, self._values = columns, values

    def option_columns(self) -> tuple:
        return self._cols

    def slot_options(self, options: dict):
        return self._values


@pytest.mark.parametrize("columns, values, match", [
    (lambda: (np.zeros(3, np.int32),), (1,), r"option column 0 must be a contiguous \[2\] array"),
    (lambda: (np.zeros(2, np.int64),), (1,), "4-byte ints"),
    (lambda: (np.zeros(2, np.int32),), (1, 2), "a tuple of 1 ints"),
    (lambda: (np.zeros(2, np.int32),), (2**31,), "int32 range"),
    (lambda: (np.zeros(2, np.int32),), (True,), "int32 range"),
])
def test_bad_option_columns_fail_at_construction(columns, values, match):
    _, draft = stub_pair(2, VOCAB, 1, 1, 32, backend="numpy")
    target = _BadColumns(2, VOCAB, 1, 32, backend="numpy", columns=columns(), values=values)
    with pytest.raises(TypeError, match=match):
        SpecDecoder(target, draft, k=2, m_rounds=1)


def test_a_models_own_set_slot_options_writes_its_columns(backend):
    """Called directly (not by a decoder), each drafter's set_slot_options still writes only the named slots."""
    _, draft = stub_pair(3, VOCAB, 1, 1, 32, accept_prob=0.25, seed=9, backend=backend)
    ngram = NgramDraft(3, VOCAB, 32, n_min=1, n_max=3, backend=backend)
    stream = backend.new_stream()  # what a decoder would pass: its own stream, after the models' fills
    backend.order_after_current(stream)
    draft.set_slot_options({2: draft.slot_options({"seed": 3_000_000_000}), 0: None}, stream)
    assert _host(backend, draft.seed, stream) == [9, 9, 3_000_000_000]
    ngram.set_slot_options({1: ngram.slot_options({"ngram_min": 2, "ngram_max": 5})}, stream)
    ngram.set_slot_options({1: None, 2: ngram.slot_options({"ngram_max": 4})}, stream)
    assert _host(backend, ngram.n_min, stream) == [1, 1, 1] and _host(backend, ngram.n_max, stream) == [3, 3, 4]


def test_a_drafters_set_slot_options_names_a_bad_slot():
    _, draft = stub_pair(3, VOCAB, 1, 1, 32, backend="numpy")
    ngram = NgramDraft(3, VOCAB, 32, backend="numpy")
    for model, value in ((draft, None), (ngram, (2, 5))):
        with pytest.raises(ValueError, match="slot must be >= 0, got -1"):
            model.set_slot_options({-1: value}, None)
        with pytest.raises(ValueError, match="slot must be <= 2, got 3"):
            model.set_slot_options({3: value}, None)


def test_rebound_option_arrays_are_the_ones_admission_writes(backend):
    """An n-gram draft whose range arrays are rebound (a watched attribute): admission, with or
    without graphs, writes the arrays the search now reads."""
    for graphs in (True, False):
        target = StubTarget(3, VOCAB, 1, 64, backend=backend)
        draft = NgramDraft(3, VOCAB, 64, n_min=1, n_max=3, backend=backend)
        dec = SpecDecoder(target, draft, k=2, m_rounds=1, admission_graphs=graphs)
        dec.prefill_checked({0: np.arange(4, dtype=np.int32)}, {0: 0}, options={0: None})  # captures a graph
        draft.n_min = backend.to_device(np.ones(3, np.int32), dec.stream)
        draft.n_max = backend.to_device(np.full(3, 3, np.int32), dec.stream)
        dec.prefill_checked({1: np.arange(4, dtype=np.int32)}, {1: 0},
                            options={1: dec.slot_options({"ngram_min": 2, "ngram_max": 7})})
        assert _host(backend, draft.n_min, dec.stream) == [1, 2, 1]
        assert _host(backend, draft.n_max, dec.stream) == [3, 7, 3]


def test_the_defaults_are_the_models_own_at_each_admission(backend):
    """None means the model's defaults as its slot_options({}) gives them now (a default changed
    after the decoder was built is the one written)."""
    target, draft = stub_pair(2, VOCAB, 1, 1, 32, seed=7, backend=backend)
    dec = SpecDecoder(target, draft, k=2, m_rounds=1)
    draft.default_seed = 99
    dec.prefill_checked({0: np.arange(3, dtype=np.int32)}, {0: 0}, options={0: None})
    dec.set_slot_options({1: None})
    assert _host(backend, draft.seed, dec.stream) == [99, 99]
