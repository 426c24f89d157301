"""The central invariant, on both backends: drained tokens == the target's greedy sequence.

After every burst, every KV length and the position counter equal the committed
position, and the accept counters agree with what was emitted.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from graphburst import SpecDecoder, greedy_reference, stub_pair
from graphburst.buffers import kv_len_ptr_table_range

VOCAB = 997
LAYOUTS = [
    ([True, False, True, True, False], [False, True]),
    ([False, False, True], [True, False, True, False]),
    ([True] * 6, [True]),
]
CONFIGS = [
    (b, k, m, acc, pmin, LAYOUTS[i % len(LAYOUTS)])
    for i, (b, k, m, acc) in enumerate(itertools.product([1, 3, 19], [1, 4, 7], [1, 3, 8], [0.0, 0.5, 1.0]))
    for pmin in ([0.0, 0.3][i % 2],)
]


def make_prompts(rng, batch):
    return [rng.integers(0, VOCAB, int(rng.integers(1, 9))).tolist() for _ in range(batch)]


def check_state(dec: SpecDecoder, emitted):
    """Lengths, position counter and accept counters after a drained burst."""
    want = dec.host_pos.astype(np.int32)
    for cache in (dec.target.cache, dec.draft.cache):
        lengths = cache.lengths(dec.stream)
        for i, layer in enumerate(cache.layers):
            if layer is not None:
                np.testing.assert_array_equal(lengths[i], want, err_msg=f"layer {i} length")
    np.testing.assert_array_equal(dec.positions(), want, err_msg="position counter")
    acc = dec.accept_counters()
    np.testing.assert_array_equal(acc[:, 0] + acc[:, 1], [len(e) for e in emitted], err_msg="accept counters")


def run_and_check(backend, batch, k, m, accept_prob, p_min, layouts, rng, bursts=3, fused=True):
    t_layout, d_layout = layouts
    capacity = 9 + bursts * m * (k + 1)
    target, draft = stub_pair(batch, VOCAB, t_layout, d_layout, capacity, accept_prob=accept_prob, p_min=p_min,
                              seed=int(rng.integers(0, 2**31)), backend=backend)
    # The separate path also launches assemble_verify over the draft's own vtok writes.
    dec = SpecDecoder(target, draft, k=k, m_rounds=m, fused=fused, assemble=not fused)
    prompts = make_prompts(rng, batch)
    dec.prefill(prompts)
    emitted = [[] for _ in range(batch)]
    for i in range(bursts):
        dec.enqueue_burst(mode="per_round_sync" if i % 2 else "pre_issued")
        for b, toks in enumerate(dec.drain()):
            assert 1 * m <= len(toks) <= m * (k + 1)
            emitted[b] += toks.tolist()
        check_state(dec, emitted)
    for b in range(batch):
        assert emitted[b] == greedy_reference(prompts[b], len(emitted[b]), VOCAB), f"sequence {b}"
    return dec, emitted


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
@pytest.mark.parametrize("batch, k, m, accept_prob, p_min, layouts", CONFIGS)
def test_bursts_equal_greedy_reference(backend, rng, batch, k, m, accept_prob, p_min, layouts, fused):
    dec, emitted = run_and_check(backend, batch, k, m, accept_prob, p_min, layouts, rng, fused=fused)
    acc = dec.accept_counters()
    if accept_prob == 1.0 and p_min == 0.0:
        assert (acc[:, 0] == k * acc[:, 1]).all()  # every draft accepted
    if accept_prob == 0.0:
        assert (acc[:, 0] == 0).all()


def test_pmin_one_breaks_every_chain(backend, rng):
    dec, emitted = run_and_check(backend, 5, 4, 3, 1.0, 1.0, LAYOUTS[0], rng)
    assert (dec.accept_counters()[:, 0] == 0).all()
    assert all(len(e) == 3 * 3 for e in emitted)  # one token per round


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_broken_rollback_is_detected(backend, rng, fused):
    """The stubs are strong: leaving one target layer out of the rollback changes tokens."""
    target, draft = stub_pair(2, VOCAB, [True, True, True], [True], 64, accept_prob=0.5, backend=backend)
    dec = SpecDecoder(target, draft, k=4, m_rounds=3, fused=fused)
    # Drop target layer 1 from the rollback table: its length keeps growing by k + 1.
    layers = [target.cache.layers[0].length, None, target.cache.layers[2].length, draft.cache.layers[0].length,
              dec.bufs.pos_ctr]
    from graphburst.buffers import PtrTable

    dec.table = PtrTable(layers, dec.backend, stream=dec.stream)  # copied in order with the bursts that read it
    prompts = [[1, 2, 3], [4]]
    dec.prefill(prompts)
    out = [[] for _ in prompts]
    for _ in range(2):
        for b, t in enumerate(dec.run_burst()):
            out[b] += t.tolist()
    assert any(out[b] != greedy_reference(prompts[b], len(out[b]), VOCAB) for b in range(2))


def test_stage_local_table_holds_only_its_layers(backend):
    target, draft = stub_pair(2, VOCAB, [True, False, True, True], [True], 16, backend=backend)
    table = kv_len_ptr_table_range([target.cache, draft.cache], range(1, 3))
    assert len(table) == 2
    assert table.resolve()[0] is None and table.resolve()[1] is target.cache.layers[2].length


def test_max_new_tokens_and_eos_stop_on_device(backend, rng):
    target, draft = stub_pair(3, VOCAB, [True, True], [True], 80, accept_prob=1.0, backend=backend)
    dec = SpecDecoder(target, draft, k=4, m_rounds=4)
    prompts = [[5, 6], [7], [8, 9, 10]]
    ref = [greedy_reference(p, 40, VOCAB) for p in prompts]
    eos = [None, ref[1][6], None]
    dec.prefill(prompts, max_new_tokens=[3, None, 11], eos=eos)
    out = [[] for _ in prompts]
    for _ in range(3):
        for b, t in enumerate(dec.run_burst()):
            out[b] += t.tolist()
    assert out[0] == ref[0][:3]
    assert out[1] == ref[1][: ref[1].index(ref[1][6]) + 1]
    assert out[2] == ref[2][:11]
    acc = dec.accept_counters()
    assert (acc[:, 0] + acc[:, 1]).tolist() == [len(o) for o in out]
