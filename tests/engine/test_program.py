"""The eager burst's cached program: reused between bursts, rebuilt whenever what it binds moves."""

from __future__ import annotations

import numpy as np

from graphburst import SpecDecoder, greedy_reference, stub_pair

VOCAB = 32003


def make(backend, *, batch=2, k=3, m=2):
    target, draft = stub_pair(batch, VOCAB, [True, False, True], [True], 120, accept_prob=0.7, p_min=0.05, seed=4,
                              backend=backend)
    return SpecDecoder(target, draft, k=k, m_rounds=m)


def run(dec, out, mode="pre_issued"):
    for b, t in enumerate(dec.run_burst(mode=mode)):
        out[b] += t.tolist()


def check(prompts, out):
    for b, p in enumerate(prompts):
        assert len(out[b]) > 0
        assert out[b] == greedy_reference(p, len(out[b]), VOCAB)


def test_enqueue_reuses_its_calls_between_bursts(backend):
    dec = make(backend)
    prompts = [[5, 6, 7], [11]]
    dec.prefill(prompts)
    out = [[], []]
    run(dec, out)
    calls = dec._enqueued_calls()
    run(dec, out, mode="per_round_sync")
    assert dec._enqueued_calls() is calls  # built once, not per burst
    check(prompts, out)


def test_moved_buffers_and_tables_rebuild_the_calls(backend):
    """Each move below would make a stale program write where drain or rollback no longer looks."""
    dec = make(backend)
    prompts = [[1, 2, 3, 4], [9, 8]]
    dec.prefill(prompts)
    out = [[], []]
    run(dec, out)
    before = dec._enqueued_calls()
    # A new out_block moves the ring and the counters: the rebuilt seed and commit bind the new ones.
    dec.bufs.out_block = backend.zeros(dec.bufs.out_block.shape, np.int32)
    run(dec, out)
    after = dec._enqueued_calls()
    assert after is not before
    seed = after[0][0]
    assert seed.name == "seed_gather" and seed.fn.args[5] is dec.bufs.ring
    # A KV length moved, then refresh_tables: the rollback must follow the new table.
    layer = dec.target.cache.layers[0]
    layer.length = layer.length.copy()
    dec.refresh_tables()
    run(dec, out)
    epilogue = dec._enqueued_calls()[2][-1]
    assert epilogue.name == "epilogue" and epilogue.fn.args[-1] is dec.table
    # A flag changed after construction (as tests and benchmarks do): the unfused program.
    dec.fused = False
    run(dec, out)
    head, first, later = dec._enqueued_calls()
    assert head == [] and first[0].fn.keywords["reset_ring"] and not later[0].fn.keywords["reset_ring"]
    run(dec, out, mode="per_round_sync")
    check(prompts, out)
