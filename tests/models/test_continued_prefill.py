"""A prompt's later chunks through the prefill graphs (``PrefillGraphs.run_continued``), and an
admission that mixes later chunks with fresh prompts (``admission._fresh_and_continued``).

A later chunk (start > 0) attends over the rows its earlier chunks cached, so it used to run
eagerly, and it sent every fresh prompt admitted beside it down the same padded path. Now it
replays a padded bucket whose ``start`` input sets the mask on the device, and the fresh
prompts beside it still run their own (packed or padded) call. On the numpy backend the
buckets run eagerly from their first call, so every chunk here goes through one; the plain
adapters (no graphs) are the reference: the same KV rows, positions, first tokens and bursts.
On the H200 a continued bucket runs eagerly, then is captured, then replays with no host sync.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphburst import SpecDecoder
from graphburst.engine.admission.slots import _fresh_and_continued
from graphburst.backend import Backend
from graphburst.constants import NO_EOS
from graphburst.models.llama import Llama
from graphburst.models.prefill_graphs import PrefillGraphs
from graphburst.models.checkpoint import tiny_random_configs

from marks import BACKENDS, requires_gpu
from prefill_cases import assert_decodes_greedy, poison, tiny_adapters

torch.set_num_threads(1)

BATCH, CAPACITY = 7, 300
# (final, {slot: (start, end)} of each slot's prompt): a chunked prompt's first chunk, then its
# later chunk beside fresh prompts (a mixed admission), a later chunk alone, and a last chunk of
# one token beside a fresh prompt of one token.
LENGTHS = {0: 26, 1: 19, 2: 1, 3: 257, 4: 200, 5: 7}
SCHEDULE = [
    (False, {0: (0, 7), 4: (0, 100)}),
    (True, {0: (7, 26), 1: (0, 19), 2: (0, 1)}),
    (False, {4: (100, 199)}),
    (True, {4: (199, 200), 5: (0, 7), 3: (0, 257)}),
]


def _calls(dec) -> list:
    """Log each prefill-graphs call of ``dec``'s two models: (model, method, rows)."""
    log = []
    for role in ("target", "draft"):
        graphs = getattr(dec, role).prefill_graphs
        for name in ("run", "run_packed", "run_continued"):
            real = getattr(graphs, name, None)
            if real is None:  # padded graphs have no run_packed
                continue

            def spy(*a, _real=real, _name=name, _role=role, **kw):
                rows = a[1] if _name != "run_packed" else torch.as_tensor(np.asarray(a[1]))
                log.append((_role, _name, sorted(rows.tolist())))
                return _real(*a, **kw)

            setattr(graphs, name, spy)
    return log


def _admit(dec, prompts, final, chunks) -> None:
    rows = {b: prompts[b][s:e] for b, (s, e) in chunks.items()}
    starts = {b: s for b, (s, _) in chunks.items()}
    if final:
        dec.prefill_checked(rows, starts, limits={b: 30 for b in rows}, stops={b: NO_EOS for b in rows})
    else:
        dec.prefill_checked(rows, starts, final=False)


def _kv(dec):
    dec.stream.synchronize()
    return [kv.detach().cpu().clone() for m in (dec.target, dec.draft) for kv in m.module.kv]


def test_an_admission_splits_into_fresh_and_continued_chunks():
    starts = np.array([0, 7, 0, 0, 100, 0, 0])
    assert _fresh_and_continued({0: 5, 2: 9}, starts) == [({0: 5, 2: 9}, True)]
    assert _fresh_and_continued({1: 5, 4: 1}, starts) == [({1: 5, 4: 1}, False)]
    assert _fresh_and_continued({0: 3, 1: 5, 4: 1, 6: 2}, starts) == [({0: 3, 6: 2}, True), ({1: 5, 4: 1}, False)]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_later_chunks_through_buckets_write_what_the_plain_chunks_write(rng, backend_name, packed):
    backend = Backend(backend_name)
    prompts = {b: rng.integers(0, 512, n).astype(np.int32) for b, n in LENGTHS.items()}
    decs = []
    for graphs in (False, True):
        models = tiny_adapters(backend, batch=BATCH, capacity=CAPACITY, graphs=graphs, packed=packed)
        poison(models)  # the same finite garbage in both
        decs.append(SpecDecoder(*models, k=3, m_rounds=2))
    plain, graphed = decs
    # without prefill graphs nothing is gained apart: one call (the split is the graphed adapters')
    assert not plain.target.prefill_fresh_apart and graphed.target.prefill_fresh_apart
    for m in (graphed.target, graphed.draft):
        m.prefill_graphs.capture_at = 1  # on a GPU too: every bucket captured at its first call
    log = _calls(graphed)
    for final, chunks in SCHEDULE:
        for dec in decs:
            _admit(dec, prompts, final, chunks)
    fresh = "run_packed" if packed else "run"
    # The mixed admissions run their fresh prompts in a call of their own (packed where the
    # adapters pack), and each later chunk through a continued bucket, in both models.
    # (the padded plan runs the 257-token prompt apart from the 7-token one; packing runs them in one call)
    last = [(fresh, [3, 5])] if packed else [(fresh, [3]), (fresh, [5])]
    want = [(fresh, [0, 4]), (fresh, [1, 2]), ("run_continued", [0]), ("run_continued", [4]), *last,
            ("run_continued", [4])]
    for role in ("target", "draft"):
        assert [(name, rows) for r, name, rows in log if r == role] == want, role
    # every bucket runs from its first call: the continued ones are made (and captured on a GPU)
    assert {k for k in graphed.target.prefill_graphs.info() if k[0] == "continued"} == {
        ("continued", 1, 32, True), ("continued", 1, 128, False), ("continued", 1, 16, True)}
    s = plain.target.module.kv[0].shape[2]
    for i, (want_kv, got_kv) in enumerate(zip(_kv(plain), _kv(graphed))):
        for b, p in prompts.items():
            torch.testing.assert_close(got_kv[:, b, : len(p)], want_kv[:, b, : len(p)], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"kv {i} slot {b}: {m}")
        # slot 6 was never prefilled; slot 0's last row takes the padding rows' writes
        assert torch.equal(got_kv[:, 6, : s - 1], want_kv[:, 6, : s - 1]), f"kv {i}: slot 6 moved"
    np.testing.assert_array_equal(graphed.positions(), plain.positions())
    np.testing.assert_array_equal(graphed.backend.to_host(graphed.bufs.pend, graphed.stream),
                                  plain.backend.to_host(plain.bufs.pend, plain.stream))
    for _ in range(3):
        assert [t.tolist() for t in graphed.run_burst()] == [t.tolist() for t in plain.run_burst()]


@pytest.mark.parametrize("qwen", [False, True], ids=["llama", "qwen3"])
def test_a_continued_bucket_equals_the_unpadded_chunk(rng, qwen):
    """``run_continued`` by hand, at awkward sizes: 1, 7 and 19 rows' chunks behind cached
    prefixes of 0 to 257 rows, padded to their bucket; the logits and KV rows equal the plain
    forward of the same chunks."""
    cfg, _ = tiny_random_configs()
    if qwen:
        cfg = cfg.replace(qk_norm=True, attention_bias=False, qkv_bias=True)
    kw = dict(batch=BATCH + 1, capacity=CAPACITY)
    plain, bucketed = Llama(cfg, **kw).init_random_(7), Llama(cfg, **kw).init_random_(7)
    for m in (plain, bucketed):
        gen = torch.Generator().manual_seed(2)
        for kv in m.kv:
            kv.copy_(torch.randn(kv.shape, generator=gen))  # the cached prefixes: finite garbage
    g = PrefillGraphs(bucketed, kv_layers=[True] * cfg.num_hidden_layers, capture=False)
    # (rows are sorted, as a decoder gives them; 7 rows of a batch of 8 make a bucket of 8 = B,
    # whose padding row is slot 0 again: the attention must gather, not take the batch in order)
    for rows, starts, n in (([3], [257], 1), ([0, 1, 2, 3, 4, 6, 7], [0, 9, 1, 40, 100, 2, 17], 7),
                            ([1, 6], [11, 0], 19)):
        idx = torch.tensor(rows)
        at = torch.tensor(starts, dtype=torch.int32)
        tokens = torch.from_numpy(rng.integers(0, cfg.vocab_size, (len(rows), n)))
        last = torch.full((len(rows),), n - 1)
        with torch.no_grad():
            want = plain(tokens, at, [at] * len(plain.kv), idx, logits_at=last)[:, 0]
            got = g.run_continued(tokens, idx, at, last, head=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for kv_p, kv_b in zip(plain.kv, bucketed.kv):
            for b, s in zip(rows, starts):
                torch.testing.assert_close(kv_b[:, b, : s + n], kv_p[:, b, : s + n], atol=1e-5, rtol=1e-5)
    assert sorted(g.info()) == [("continued", 1, 16, True), ("continued", 2, 32, True), ("continued", 8, 16, True)]


# ---------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@requires_gpu
def test_gpu_a_continued_bucket_runs_eagerly_then_captures_then_replays_without_a_sync(rng):
    backend = Backend("cupy")
    models = tiny_adapters(backend, batch=BATCH, capacity=CAPACITY)  # packed by default where flash serves
    poison(models)
    dec = SpecDecoder(*models, k=3, m_rounds=2)
    graphs = dec.target.prefill_graphs
    key = ("continued", 1, 32, True)
    seen = []
    for slot in (0, 1, 2):  # chunks of 21 tokens at 40: bucket (1, 32); eager, captured, replayed
        prompt = rng.integers(0, 512, 61).astype(np.int32)
        dec.prefill_checked({slot: prompt[:40]}, {slot: 0}, final=False)
        replay = graphs.info().get(key, False)
        if replay:
            torch.cuda.set_sync_debug_mode("error")  # a replay of a captured bucket never syncs
        try:
            dec.prefill_checked({slot: prompt[40:]}, {slot: 40}, limits={slot: 30})
        finally:
            torch.cuda.set_sync_debug_mode("default")
        seen.append((graphs.info().get(key), replay))  # None: no bucket yet (its first call ran eagerly)
        assert_decodes_greedy(dec, {slot: prompt}, 30, scratch_row=BATCH - 1, label=f"slot {slot}")
    assert seen == [(None, False), (True, False), (True, True)]
    assert dec.draft.prefill_graphs.info()[("continued", 1, 32, False)]


@pytest.mark.gpu
@requires_gpu
def test_gpu_a_warmed_continued_buckets_first_call_replays_without_a_sync_or_capture(rng):
    backend = Backend("cupy")
    models = tiny_adapters(backend, batch=BATCH, capacity=CAPACITY)
    before = poison(models)
    for m in models:
        m.warm_prefill(2, max_length=64)  # chunks of 64: the continued buckets up to (1, 64)
    s = models[0].module.kv[0].shape[2]
    for m, old in zip((kv for m in models for kv in m.module.kv), before):
        assert torch.equal(m.detach().cpu()[:, :, : s - 1], old[:, :, : s - 1]), "warm-up moved a readable row"
    dec = SpecDecoder(*models, k=3, m_rounds=2)
    captures = [m.prefill_graphs.captures for m in models]
    prompt = rng.integers(0, 512, 64 + 50).astype(np.int32)
    dec.prefill_checked({2: prompt[:64]}, {2: 0}, final=False)
    torch.cuda.set_sync_debug_mode("error")  # a replay never syncs
    try:
        dec.prefill_checked({2: prompt[64:]}, {2: 64}, limits={2: 30})  # (1, 64): warmed, replayed
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [m.prefill_graphs.captures for m in models] == captures, "captured at serving time"
    assert_decodes_greedy(dec, {2: prompt}, 30, scratch_row=BATCH - 1, label="warmed continued")
