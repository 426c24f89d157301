"""Per-request k and the batch-size switch (``engine/draft_caps.py``): the ``cap_drafts`` kernel against its
numpy twin, and decoders whose slots ask for fewer drafts held to decoders built with that k (greedy and
sampled, every engine), to the greedy oracle, and to plain decoding; on numpy and (marked) cupy."""

from __future__ import annotations

import numpy as np
import pytest

from graphburst.backend import get_backend
from graphburst.capture import BurstGraph
from graphburst.constants import NO_BATCH_LIMIT
from graphburst.engine.decoder import SpecDecoder
from graphburst.engine.draft_caps import DraftCaps
from graphburst.kernels import burst_ref
from graphburst.kernels.digest import greedy_reference
from graphburst.models.stubs import stub_pair
from marks import requires_gpu

VOCAB = 97
K = 4
M = 5


# ---------------------------------------------------------------------------- the kernel


def test_cap_drafts_twin_by_hand():
    budget = np.array([5, 0, 3, 9], np.int32)
    k_cap = np.array([0, 2, 9, 1], np.int32)  # a cap above k is k
    brk = np.array([[4, 0], [4, 0], [2, 1], [1, 0]], np.int32)
    burst_ref.cap_drafts(budget, k_cap, brk, k=4, max_batch=NO_BATCH_LIMIT)
    assert brk.tolist() == [[0, 1], [2, 1], [2, 1], [1, 0]]  # lowered only where the chain went past the cap
    brk = np.array([[4, 0], [4, 0], [2, 1], [0, 1]], np.int32)
    burst_ref.cap_drafts(budget, np.full(4, 4, np.int32), brk, k=4, max_batch=2)  # 3 active > 2: off
    assert brk.tolist() == [[0, 1], [0, 1], [0, 1], [0, 1]]
    brk = np.array([[4, 0]] * 4, np.int32)
    burst_ref.cap_drafts(budget, np.full(4, 4, np.int32), brk, k=4, max_batch=3)  # 3 active: on
    assert brk.tolist() == [[4, 0]] * 4


def _kernel_case(rng, batch: int, k: int):
    budget = rng.integers(-2, 4, batch).astype(np.int32)  # <= 0: idle
    k_cap = rng.integers(-1, k + 3, batch).astype(np.int32)  # outside [0, k] too
    brk = np.stack([rng.integers(-1, k + 2, batch), rng.integers(0, 2, batch)], axis=1).astype(np.int32)
    return budget, k_cap, brk


@requires_gpu
@pytest.mark.parametrize("batch", [1, 7, 19, 257, 600])
def test_cap_drafts_kernel_is_its_twin(rng, batch):
    """Awkward batches (600: more slots than the block's threads), caps and breaks outside [0, k], idle
    slots; the limit below, at and above the active count."""
    import cupy

    from graphburst.kernels import cuda_ops

    gpu = get_backend("cupy")
    for k in (1, 4, 7):
        budget, k_cap, brk = _kernel_case(rng, batch, k)
        active = int(np.count_nonzero(budget > 0))
        for max_batch in (0, max(active - 1, 0), active, NO_BATCH_LIMIT):
            want = brk.copy()
            burst_ref.cap_drafts(budget, k_cap, want, k=k, max_batch=max_batch)
            d = [cupy.asarray(a) for a in (budget, k_cap, brk)]
            stream = gpu.new_stream()
            cuda_ops.cap_drafts(*d, k=k, max_batch=max_batch, stream=stream)
            stream.synchronize()
            np.testing.assert_array_equal(cupy.asnumpy(d[2]), want, err_msg=f"B={batch} k={k} max={max_batch}")
            np.testing.assert_array_equal(cupy.asnumpy(d[0]), budget)  # read only
            np.testing.assert_array_equal(cupy.asnumpy(d[1]), k_cap)


# ---------------------------------------------------------------------------- the option


def test_the_option_is_checked_and_names_the_value(backend):
    caps = DraftCaps(3, K, backend)
    assert caps.slot_options({}) == (K,) and caps.slot_options({"k": 0}) == (0,)
    for bad, err in ((K + 1, ValueError), (-1, ValueError), (True, TypeError), (1.0, TypeError), ("2", TypeError)):
        with pytest.raises(err, match=f"option 'k'.*got {bad!r}" if err is TypeError else f"option 'k'.*got {bad}"):
            caps.slot_options({"k": bad})
    with pytest.raises(ValueError, match="spec_max_batch"):
        DraftCaps(3, K, backend, spec_max_batch=-1)
    t, d = stub_pair(2, VOCAB, [True], [True], 64, backend=backend)
    plain = SpecDecoder(t, d, k=K, m_rounds=M)
    assert plain.caps is None
    with pytest.raises(ValueError, match="unknown model option 'k'"):
        plain.slot_options({"k": 1})  # a decoder built without caps refuses the option
    dec = SpecDecoder(*stub_pair(2, VOCAB, [True], [True], 64, backend=backend), k=K, m_rounds=M, draft_caps=True)
    with pytest.raises(ValueError, match=r"must be in \[0, 4\].*got 5"):
        dec.slot_options({"k": 5})
    assert [c.name for c in dec.round_calls(first_round=False)].count("cap_drafts") == 1
    assert "cap_drafts" not in [c.name for c in plain.round_calls(first_round=False)]
    # plain decoding (k = 0) takes k = 0 and nothing else, and runs no cap launch
    t, _ = stub_pair(2, VOCAB, [True], [True], 64, backend=backend)
    zero = SpecDecoder(t, None, k=0, m_rounds=M, draft_caps=True)
    assert zero.slot_options({"k": 0})["speculation"] == () and zero.option_columns is None
    with pytest.raises(ValueError, match=r"must be in \[0, 0\].*got 1"):
        zero.slot_options({"k": 1})
    assert "cap_drafts" not in [c.name for c in zero.round_calls(first_round=False)]


# ---------------------------------------------------------------------------- decoders


def _decoder(backend, batch, k, *, sampling=False, fused=True, **kw):
    t, d = stub_pair(batch, VOCAB, [True, False, True], [True], 256, accept_prob=0.7, p_min=0.05, seed=2,
                     backend=backend)
    return SpecDecoder(t, d, k=k, m_rounds=M, sampling=sampling, fused=fused, **kw)


def _run(dec, engine: str, bursts: int) -> list[list[int]]:
    run = BurstGraph(dec).run if engine == "graph" else \
        BurstGraph(dec, device_exit=True).run if engine == "device_exit" else \
        (lambda: dec.run_burst(mode=engine))
    out = [[] for _ in range(dec.batch)]
    for _ in range(bursts):
        for b, toks in enumerate(run()):
            out[b] += toks.tolist()
    return out


PROMPTS = [[3, 1, 4], [1, 5, 9, 2, 6], [5, 3], [5, 8, 9, 7, 9, 3], [2, 3, 8, 4], [6, 2, 6, 4, 3, 3, 8]]
CAPS = [0, 1, 4, 2, 0, 3]


@pytest.mark.parametrize("engine", ["graph", "device_exit", "pre_issued", "per_round_sync", "unfused"])
def test_each_slot_decodes_as_a_decoder_with_its_k(backend, engine):
    """Greedy: a slot capped at c commits the tokens and accepted drafts of the same slot in a decoder built
    with k = c (c = 0: plain decoding), and the greedy oracle's tokens."""
    n = len(PROMPTS)
    budgets = [30, 27, 33, 24, 31, 29]
    dec = _decoder(backend, n, K, fused=engine != "unfused", draft_caps=True)
    dec.set_slot_options({b: dec.slot_options({"k": c}) for b, c in enumerate(CAPS)})
    dec.prefill(PROMPTS, max_new_tokens=budgets)
    mode = "pre_issued" if engine == "unfused" else engine
    out = _run(dec, mode, 8)
    assert out == [greedy_reference(p, n_, VOCAB) for p, n_ in zip(PROMPTS, budgets)]
    acc = dec.accept_counters()
    for c in sorted(set(CAPS)):
        slots = [b for b in range(n) if CAPS[b] == c]
        if c == 0:
            # plain decoding: no draft accepted, one committing round a token
            assert (acc[slots, 0] == 0).all() and (acc[slots, 1] == np.array(budgets)[slots]).all(), acc
            continue
        ref = _decoder(backend, n, c, fused=engine != "unfused")
        ref.prefill(PROMPTS, max_new_tokens=budgets)
        ref_out = _run(ref, mode, 8 * (K + 1))
        assert [ref_out[b] for b in slots] == [out[b] for b in slots]
        np.testing.assert_array_equal(acc[slots], ref.accept_counters()[slots], err_msg=f"cap {c}")
    assert acc[CAPS.index(4), 0] > acc[CAPS.index(1), 0] > 0  # the caps changed what was accepted


def test_a_sampled_slot_decodes_as_a_decoder_with_its_k(backend):
    """Temperature 1, per-slot seeds: a slot capped at c samples the very tokens of a decoder with k = c
    (its draws are keyed by seed and position, and a capped chain is a broken one), c = 0 those of
    plain sampling."""
    n = len(PROMPTS)
    seeds = [11, 12, 13, 14, 15, 16]
    dec = _decoder(backend, n, K, sampling=True, draft_caps=True)
    dec.set_slot_options({b: dec.slot_options({"k": c}) for b, c in enumerate(CAPS)})
    dec.prefill(PROMPTS, max_new_tokens=20, temperature=1.0, seed=seeds)
    out = _run(dec, "graph", 6)
    assert all(len(o) == 20 for o in out)
    for c in sorted(set(CAPS)):
        ref = _decoder(backend, n, c, sampling=True) if c else SpecDecoder(
            stub_pair(n, VOCAB, [True, False, True], [True], 256, backend=backend)[0], None, k=0, m_rounds=M,
            sampling=True)
        ref.prefill(PROMPTS, max_new_tokens=20, temperature=1.0, seed=seeds)
        ref_out = _run(ref, "graph", 20)
        for b in range(n):
            if CAPS[b] == c:
                assert out[b] == ref_out[b], f"slot {b}, cap {c}"
    assert len({tuple(o) for o in out}) > 1


def test_speculation_is_off_while_more_slots_than_the_limit_are_active(backend):
    """spec_max_batch = B - 1: with every slot live no draft is accepted, the tokens stay greedy; once one
    slot is released speculation resumes for the rest, in the same graph."""
    n = 4
    dec = _decoder(backend, n, K, spec_max_batch=n - 1)
    assert dec.caps is not None and dec.caps.max_batch == n - 1
    dec.prefill(PROMPTS[:n])
    graph = BurstGraph(dec)
    out = [[] for _ in range(n)]
    for _ in range(3):
        for b, toks in enumerate(graph.run()):
            assert len(toks) == M  # one token a round: speculation off
            out[b] += toks.tolist()
    assert (dec.accept_counters()[:, 0] == 0).all()
    dec.release([0])
    for _ in range(3):
        for b, toks in enumerate(graph.run()):
            out[b] += toks.tolist()
    assert out[0] == greedy_reference(PROMPTS[0], 3 * M, VOCAB)
    for b in range(1, n):
        assert out[b] == greedy_reference(PROMPTS[b], len(out[b]), VOCAB)
    assert (dec.accept_counters()[1:, 0] > 0).all()  # three active <= 3: drafts accepted again
    assert sum(len(o) for o in out[1:]) > 3 * 6 * M


def test_a_limit_of_the_batch_changes_nothing_and_zero_turns_speculation_off(backend):
    n = 3
    runs = {}
    for limit in (None, n, 0):
        dec = _decoder(backend, n, K, spec_max_batch=limit)
        dec.prefill(PROMPTS[:n], max_new_tokens=25)
        runs[limit] = (_run(dec, "graph", 6), dec.accept_counters().copy())
    assert runs[None][0] == runs[n][0] == runs[0][0] == [greedy_reference(p, 25, VOCAB) for p in PROMPTS[:n]]
    np.testing.assert_array_equal(runs[None][1], runs[n][1])
    assert (runs[None][1][:, 0] > 0).all() and (runs[0][1][:, 0] == 0).all()


def test_admission_writes_the_cap_and_a_reused_slot_takes_its_new_request(backend):
    """Options given with a prefill (a serving loop's admission) land in the one admit launch; None is the
    default (k)."""
    dec = _decoder(backend, 2, K, draft_caps=True)
    opts = [dec.slot_options({"k": 1}), None]
    dec.prefill_slots([0, 1], [np.array(p, np.int32) for p in PROMPTS[:2]], [0, 0], limits=[12, 12],
                      stops=[-1, -1], options=opts)
    np.testing.assert_array_equal(backend.to_host(dec.caps.k_cap, dec.stream), [1, K])
    out = _run(dec, "graph", 4)
    assert out == [greedy_reference(p, 12, VOCAB) for p in PROMPTS[:2]]
    dec.prefill_slots([0], [np.array(PROMPTS[2], np.int32)], [0], limits=[5], stops=[-1], options=[None])
    np.testing.assert_array_equal(backend.to_host(dec.caps.k_cap, dec.stream), [K, K])
