"""Chunked prefill, model side: a prompt prefilled in chunks (``start``) leaves exactly the
state a whole prefill leaves, for the stub models and the n-gram draft.

Chunks have awkward sizes (1, 7, 19, 257 tokens), come ragged across slots (a slot may
skip a call, slots finish at different calls), and every buffer starts poisoned: a slot
never prefilled must keep its poison, and entries past a prompt must keep theirs. The torch
models are in ``test_chunked_prefill_torch.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from graphburst import NgramDraft, greedy_reference
from graphburst.constants import NO_PREFILL, PLACEHOLDER_TOKEN
from graphburst.models.stubs import StubDraft, StubTarget

from marks import BACKENDS

BATCH, CAPACITY, VOCAB = 6, 300, 1009
LENGTHS = {0: 257, 1: 19, 2: 7, 3: 1, 5: 19}  # slot 4 is never prefilled
# slot -> chunk size per call (0: the slot sits the call out); each row sums to its prompt.
SCHEDULES = {
    # call 0 finishes no slot: the target gets no pend there
    "late-finish": {0: [7, 249, 1], 1: [1, 18, 0], 2: [3, 4, 0], 3: [0, 0, 1], 5: [0, 19, 0]},
    "ragged": {0: [19, 1, 237], 1: [7, 7, 5], 2: [1, 6, 0], 3: [1, 0, 0], 5: [7, 0, 12]},
    "whole-in-one-chunk": {0: [257], 1: [19], 2: [7], 3: [1], 5: [19]},
}


def prompts_for(rng) -> dict:
    return {b: rng.integers(0, VOCAB, n).astype(np.int32) for b, n in LENGTHS.items()}


def chunk_calls(prompts: dict, schedule: dict, batch: int = BATCH) -> list[dict]:
    """The prefill calls of ``schedule``: host ``stage [B, P] int32`` (poisoned past each chunk),
    ``lens [B] int32`` (NO_PREFILL for slots sitting out), ``start [B] int32`` (poisoned for
    them), ``rows`` (the prefilled slots) and ``final`` (whether a slot's last chunk is in it)."""
    n_calls = max(len(sizes) for sizes in schedule.values())
    done = {b: 0 for b in schedule}
    calls = []
    for j in range(n_calls):
        sizes = {b: s[j] for b, s in schedule.items() if j < len(s) and s[j] > 0}
        p_max = max(sizes.values())
        stage = np.full((batch, p_max), PLACEHOLDER_TOKEN, np.int32)  # [B, P] int32
        lens = np.full(batch, NO_PREFILL, np.int32)  # [B] int32
        start = np.full(batch, 10_000, np.int32)  # [B] int32, ignored for slots sitting out
        for b, n in sizes.items():
            stage[b, :n] = prompts[b][done[b]: done[b] + n]
            lens[b], start[b] = n, done[b]
            done[b] += n
        final = {b for b in sizes if done[b] == len(prompts[b])}
        calls.append(dict(stage=stage, lens=lens, start=start, rows=np.array(sorted(sizes)), final=final))
    assert all(done[b] == len(p) for b, p in prompts.items())
    return calls


def whole_call(prompts: dict, batch: int = BATCH) -> dict:
    stage = np.full((batch, max(len(p) for p in prompts.values())), PLACEHOLDER_TOKEN, np.int32)
    lens = np.full(batch, NO_PREFILL, np.int32)
    for b, p in prompts.items():
        stage[b, : len(p)] = p
        lens[b] = len(p)
    return dict(stage=stage, lens=lens)


def poison_models(backend, models, seed: int) -> None:
    """Every KV layer's storage and length filled with seeded garbage, the same for each build."""
    rng = np.random.default_rng(seed)
    for model in models:
        for layer in model.cache.layers:
            if layer is not None:
                # on the current stream, like the models' own fills: state() orders it first
                current = backend.current_stream()
                layer.storage[...] = backend.to_device(rng.integers(-(2**31), 2**31 - 1, layer.storage.shape,
                                                                    dtype=np.int64).astype(np.int32), current)
                layer.length[...] = backend.to_device(rng.integers(-5, CAPACITY + 5, layer.length.shape,
                                                                   dtype=np.int32), current)


def state(backend, models, counters, stream) -> list[np.ndarray]:
    backend.order_after_current(stream)  # fills and poison ran on the current stream
    out = []
    for model in models:
        for layer in model.cache.layers:
            if layer is not None:
                out += [backend.to_host(layer.storage, stream), backend.to_host(layer.length, stream)]
    return out + [backend.to_host(c, stream) for c in counters]


def stub_models(backend):
    layout = [True, False, True, True]  # a layer without KV in between
    return (StubTarget(BATCH, VOCAB, layout, CAPACITY, backend=backend),
            StubDraft(BATCH, VOCAB, [False, True], CAPACITY, backend=backend))


def counters(backend):
    return backend.full((BATCH,), PLACEHOLDER_TOKEN, np.int32), backend.full((BATCH,), PLACEHOLDER_TOKEN, np.int32)


def run_whole(backend, models, prompts, stream):
    """The old positional call, each prompt in one piece."""
    target, draft = models
    call = whole_call(prompts)
    pos, pend = counters(backend)
    stage, lens = backend.to_device(call["stage"], stream), backend.to_device(call["lens"], stream)
    backend.order_after_current(stream)
    target.prefill(stage, lens, pos, pend, stream)
    draft.prefill(stage, lens, None, None, stream)
    return pos, pend


def run_chunked(backend, models, prompts, schedule, stream, seen=None):
    """The decoder's chunk calls: the target gets ``pend`` only when a slot finishes in the call."""
    target, draft = models
    pos, pend = counters(backend)
    for call in chunk_calls(prompts, schedule):
        stage, lens, start = (backend.to_device(call[n], stream) for n in ("stage", "lens", "start"))
        backend.order_after_current(stream)
        target.prefill(stage, lens, pos, pend if call["final"] else None, stream, start=start, rows=call["rows"])
        draft.prefill(stage, lens, None, None, stream, start=start, rows=call["rows"])
        if seen is not None:
            seen.append((call, backend.to_host(pos, stream), backend.to_host(pend, stream)))
    return pos, pend


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_stub_chunks_equal_a_whole_prefill(rng, schedule, backend_name):
    from graphburst.backend import Backend

    backend = Backend(backend_name)
    prompts = prompts_for(rng)
    stream = backend.new_stream()
    whole = stub_models(backend)
    poison_models(backend, whole, 7)
    want = state(backend, whole, run_whole(backend, whole, prompts, stream), stream)
    chunked = stub_models(backend)
    poison_models(backend, chunked, 7)
    before = state(backend, chunked, counters(backend), stream)
    seen = []
    got = state(backend, chunked, run_chunked(backend, chunked, prompts, SCHEDULES[schedule], stream, seen), stream)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"state array {i}")
    # The whole prefill against the stubs' own oracle, and slot 4 (never prefilled) kept its poison.
    pend = want[-1]
    for b, p in prompts.items():
        assert pend[b] == greedy_reference(p.tolist(), 1, VOCAB)[0], f"slot {b}"
        assert want[-2][b] == len(p)
    for g, b0 in zip(got, before):
        np.testing.assert_array_equal(g[4], b0[4], err_msg="slot 4 was never prefilled")
    # Between calls: pos_ctr is each slot's prefix so far; pend moves only in calls that pass it.
    pend_before = np.full(BATCH, PLACEHOLDER_TOKEN, np.int32)
    for call, pos, pend in seen:
        for b in call["rows"]:
            assert pos[b] == call["start"][b] + call["lens"][b]
        if not call["final"]:
            np.testing.assert_array_equal(pend, pend_before, err_msg="a call without pend wrote it")
        pend_before = pend


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_ngram_chunks_equal_a_whole_prefill(rng, schedule, backend_name):
    from graphburst.backend import Backend

    backend = Backend(backend_name)
    prompts = prompts_for(rng)
    stream = backend.new_stream()

    def build():
        draft = NgramDraft(BATCH, VOCAB, CAPACITY, backend=backend)
        poison_models(backend, [draft], 11)
        return draft

    whole, chunked = build(), build()
    before = state(backend, [chunked], [], stream)
    call = whole_call(prompts)
    stage, lens = backend.to_device(call["stage"], stream), backend.to_device(call["lens"], stream)
    backend.order_after_current(stream)
    whole.prefill(stage, lens, None, None, stream)
    for call in chunk_calls(prompts, SCHEDULES[schedule]):
        stage, lens, start = (backend.to_device(call[n], stream) for n in ("stage", "lens", "start"))
        backend.order_after_current(stream)
        chunked.prefill(stage, lens, None, None, stream, start=start, rows=call["rows"])
    (hist, hist_len), (want_hist, want_len) = state(backend, [chunked], [], stream), state(backend, [whole], [],
                                                                                           stream)
    np.testing.assert_array_equal(hist, want_hist)  # prompts and the poison past them
    np.testing.assert_array_equal(hist_len, want_len)
    for b, p in prompts.items():
        assert hist_len[b] == len(p) and (hist[b, : len(p)] == p).all(), f"slot {b}"
        assert (hist[b, len(p):] == before[0][b, len(p):]).all(), f"slot {b}: past the prompt"
    assert (hist[4] == before[0][4]).all() and hist_len[4] == before[1][4]


def test_models_declare_chunked_prefill():
    from graphburst.protocol import DraftModel, TargetModel, hook

    target, draft = stub_models("numpy")
    assert hook(target, "chunked_prefill") is True and hook(draft, "chunked_prefill") is True
    assert NgramDraft(1, VOCAB, 8, backend="numpy").chunked_prefill is True
    assert TargetModel.chunked_prefill is False and DraftModel.chunked_prefill is False
    assert hook(object(), "chunked_prefill") is False  # a duck-typed model gets whole prompts
