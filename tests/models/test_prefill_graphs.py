"""Bucketed prefill graphs (graphburst.models.prefill_graphs) against the plain prefill.

On the numpy backend ``prefill_graphs=True`` runs each bucket's forward eagerly, so
the bucketing and the padding rows are held here: the same KV rows, lengths, positions and
first tokens as the unpadded prefill, and nothing written outside the prefilled rows but
row ``S - 1`` of slot 0. On the H200 the same checks run through captured graphs, and a
replay of a captured bucket never syncs with the host.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphburst import SpecDecoder
from graphburst.backend import Backend
from graphburst.constants import NO_EOS
from graphburst.models.llama import Llama
from graphburst.models.prefill_buckets import CAPTURE_AT_USE
from graphburst.models.prefill_graphs import PrefillGraphs
from graphburst.models.torch_adapter import TorchTarget

from marks import BACKENDS, requires_gpu
from prefill_cases import assert_decodes_greedy, prefill_fresh, tiny_adapters

torch.set_num_threads(1)

BATCH, CAPACITY = 7, 300


def test_buckets_round_rows_and_lengths_up_the_ladders():
    from graphburst.models.checkpoint import tiny_random_configs

    cfg, _ = tiny_random_configs()
    model = Llama(cfg, batch=2, capacity=64)
    g = PrefillGraphs(model, kv_layers=[True] * cfg.num_hidden_layers, capture=False, max_tokens=8192)
    assert g.bucket(1, 1) == (1, 16)
    assert g.bucket(5, 100) == (6, 128)
    assert g.bucket(11, 300) == (12, 384)
    assert g.bucket(64, 64) == (64, 64)
    assert g.bucket(1, 2049) == (1, 4096)  # past the ladder: doubling
    assert g.bucket(5, 2000) is None  # 6 x 2048 tokens: past max_tokens, eager
    assert g.bucket(257, 1) == (512, 16)  # rows double past the ladder too
    assert g.bucket(513, 16) is None


def _graphs(max_tokens=8192, capture_at=None):
    from graphburst.models.checkpoint import tiny_random_configs

    cfg, _ = tiny_random_configs()
    return PrefillGraphs(Llama(cfg, batch=2, capacity=64), kv_layers=[True] * cfg.num_hidden_layers, capture=False,
                         max_tokens=max_tokens, capture_at=capture_at)


def _cost(g, groups, lengths):
    total = 0
    for group in groups:
        total += g._call_cost(len(group), max(lengths[b] for b in group))
    return total


def test_plan_hand_cases():
    g = _graphs()
    # one long prompt among short ones is a call of its own; the short ones share one
    assert g.plan({0: 500, 1: 20, 2: 22, 3: 25}) == [[0], [1, 2, 3]]
    assert g.plan({4: 16, 2: 16, 6: 16}) == [[2, 4, 6]]  # alike: one call
    assert g.plan({3: 7}) == [[3]]
    assert g.plan({0: 100, 1: 90, 2: 200, 3: 210}) == [[2, 3], [0, 1]]


def test_a_bucket_passed_over_for_its_first_use_is_taken_the_next_time(rng):
    """With the GPU's policy (an eager first call), held on the CPU: 4 x 128 is split into calls of a
    captured 1 x 128 bucket rather than run its own bucket eagerly, but only once."""
    g = _graphs(capture_at=CAPTURE_AT_USE)
    one = torch.from_numpy(rng.integers(0, 100, (1, 128))).long()
    at = (torch.tensor([0]), torch.tensor([127]))
    assert g.run(one, *at, head=True) is NotImplemented  # the 1 x 128 bucket's first use: eager
    assert g.run(one, *at, head=True) is not NotImplemented  # its second: in the bucket from now on
    four = {0: 128, 1: 128, 2: 128, 3: 128}
    assert g.plan(four) == [[0], [1], [2], [3]]  # its own bucket would run eagerly: split
    assert g.plan(four) == [[0, 1, 2, 3]]  # that counted as its first use: one call now
    assert g.plan({0: 128, 1: 100}) == [[0], [1]] and g.plan({0: 128, 1: 100}) == [[0, 1]]  # (2, 128) alike
    uses = dict(g._uses)
    assert g.plan({5: 128}) == [[5]] and g._uses == uses  # an admission of one call counts nothing


def test_plan_is_the_cheapest_split_into_runs_of_sorted_lengths(rng):
    """Against every split of the longest-first order into contiguous runs (2^(n-1) of them)."""
    import itertools

    g = _graphs(max_tokens=2048)
    for _ in range(60):
        n = int(rng.integers(1, 8))
        lengths = {int(b): int(x) for b, x in zip(rng.choice(64, n, replace=False), rng.integers(1, 700, n))}
        groups = g.plan(lengths)
        assert sorted(b for grp in groups for b in grp) == sorted(lengths)  # every slot exactly once
        order = [b for b, _ in sorted(lengths.items(), key=lambda kv: (-kv[1], kv[0]))]
        best = min(_cost(g, [order[i:j] for i, j in zip((0, *cuts), (*cuts, n))], lengths)
                   for k in range(n) for cuts in itertools.combinations(range(1, n), k))
        assert _cost(g, groups, lengths) == best, (lengths, groups)


def _poisoned_decoder(backend, graphs: bool, packed: bool = False):
    target, draft = tiny_adapters(backend, batch=BATCH, capacity=CAPACITY, graphs=graphs, packed=packed)
    dec = SpecDecoder(target, draft, k=3, m_rounds=2)
    gen = torch.Generator().manual_seed(9)
    for m in (target, draft):
        for kv in m.module.kv:
            kv.copy_(torch.randn(kv.shape, generator=gen))  # finite garbage everywhere
    if backend.is_gpu:
        torch.cuda.synchronize()
    return dec


def _kv(dec):
    dec.stream.synchronize()
    return [kv.detach().cpu().clone() for m in (dec.target, dec.draft) for kv in m.module.kv]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("lengths", [{2: 5}, {0: 19, 1: 257, 3: 7, 4: 1, 6: 30}, {b: 16 for b in range(BATCH)}],
                         ids=["one", "five_padded", "all_equal"])
def test_a_bucketed_prefill_writes_what_the_plain_one_writes(rng, backend_name, lengths, packed):
    """Padded buckets, and prompts packed end to end (models.packed_prefill): the same KV rows as
    the plain prefill, and nothing else moved but rows no attention reads."""
    backend = Backend(backend_name)
    prompts = {b: rng.integers(0, 512, n).astype(np.int32) for b, n in lengths.items()}
    decs = [_poisoned_decoder(backend, graphs, packed) for graphs in (False, True)]
    before = _kv(decs[1])
    for dec in decs:
        dec.prefill_checked(prompts, {b: 0 for b in prompts}, limits={b: 40 for b in prompts},
                            stops={b: NO_EOS for b in prompts})
    plain, graphed = decs
    assert graphed.target.prefill_graphs is not None and plain.target.prefill_graphs is None
    assert graphed.target.packed_prefill == graphed.draft.packed_prefill == packed
    s = plain.target.module.kv[0].shape[2]
    # padded: a prompt's own padding tokens write its rows up to the bucket's length; packed: none
    padded = None if packed else graphed.target.prefill_graphs.bucket(len(prompts), max(lengths.values()))[1]
    for i, (want, got, old) in enumerate(zip(_kv(plain), _kv(graphed), before)):
        for b in range(BATCH):
            n = len(prompts.get(b, ()))
            torch.testing.assert_close(got[:, b, :n], want[:, b, :n], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"kv {i} slot {b}: {m}")
            # Nothing else moved but rows no attention reads (past each length): a prefilled
            # slot's rows up to the bucket's length (its padding tokens), and the last storage
            # row of slot 0 (padding rows) and of a prefilled slot (its tokens past S, clamped).
            lo = (n if packed else padded) if b in prompts else 0
            hi = s - 1 if (b == 0 or b in prompts) else s
            assert torch.equal(got[:, b, lo:hi], old[:, b, lo:hi]), f"kv {i} slot {b}: rows [{lo}, {hi}) moved"
    np.testing.assert_array_equal(graphed.positions(), plain.positions())
    np.testing.assert_array_equal(graphed.backend.to_host(graphed.bufs.pend, graphed.stream),
                                  plain.backend.to_host(plain.bufs.pend, plain.stream))
    for _ in range(3):
        assert [t.tolist() for t in graphed.run_burst()] == [t.tolist() for t in plain.run_burst()]


def test_prefill_graphs_are_checked_at_construction():
    backend = Backend("numpy")
    from graphburst.models.checkpoint import tiny_random_configs

    cfg, _ = tiny_random_configs()
    module = Llama(cfg, batch=2, capacity=32)
    with pytest.raises(TypeError, match="prefill_graphs must be a bool"):
        TorchTarget(module, batch=2, capacity=32, backend=backend, prefill_graphs="yes")
    assert TorchTarget(module, batch=2, capacity=32, backend=backend).prefill_graphs is None  # CPU default: off

    class NoFresh(torch.nn.Module):
        vocab, capacity, batch = 512, 32, 2

        def __init__(self):
            super().__init__()
            self.kv = [torch.zeros(2, 2, 40, 1, 4)]

        def kv_layers(self):
            return self.kv

    with pytest.raises(ValueError, match="accepts_fresh"):
        TorchTarget(NoFresh(), batch=2, capacity=32, backend=backend, prefill_graphs=True)


def test_a_prefill_past_every_bucket_runs_eagerly(rng):
    backend = Backend("numpy")
    dec = _poisoned_decoder(backend, True)
    dec.target.prefill_graphs.max_tokens = dec.draft.prefill_graphs.max_tokens = 64
    prompts = {0: rng.integers(0, 512, 100).astype(np.int32)}
    dec.prefill_checked(prompts, {0: 0}, limits={0: 9})
    assert dec.target.prefill_graphs.info() == {}  # no bucket made: the eager path ran
    ref = dec.target.module.greedy(prompts[0].tolist(), 9, row=5)
    got = []
    while len(got) < 9:
        got += dec.run_burst()[0].tolist()
    assert got[:9] == ref


@pytest.mark.gpu
@requires_gpu
def test_gpu_a_bucket_runs_eagerly_then_captures_then_replays_without_a_sync(rng):
    backend = Backend("cupy")
    dec = _poisoned_decoder(backend, True)  # padded buckets (the packed ones: test_packed_prefill.py)
    graphs = dec.target.prefill_graphs
    seen = []
    for n in (3, 3, 3, 2, 2):  # (3, 32): eager, captured, replayed; (2, 32): eager, captured
        prompts = {b: rng.integers(0, 512, 20 + b).astype(np.int32) for b in range(n)}
        replay = graphs.info().get((n, 32, True), False)
        prefill_fresh(dec, prompts, 30, no_sync=replay)  # a replay of a captured bucket never syncs
        seen.append((n, graphs.captures, replay))
        assert_decodes_greedy(dec, prompts, 30, scratch_row=BATCH - 1, label=f"{n} rows")
    assert seen == [(3, 0, False), (3, 1, False), (3, 1, True), (2, 1, False), (2, 2, False)]
    assert graphs.info() == {(3, 32, True): True, (2, 32, True): True}
    assert dec.draft.prefill_graphs.info() == {(3, 32, False): True, (2, 32, False): True}
