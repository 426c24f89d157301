"""A ladder of burst lengths (``BurstGraph(..., ladder=True)``): one fixed-length graph per rung (1, 2, 4, ...,
M) per graph in rotation, over the same buffers. A burst of any rung leaves exactly the state of that many
rounds: the tokens of any sequence of rungs are the CPU greedy oracle's, on numpy and (marked) cupy."""

from __future__ import annotations

import numpy as np
import pytest
from marks import gpu

from graphburst import greedy_reference, stub_pair
from graphburst.capture import BurstGraph, ladder_rungs
from graphburst.engine.decoder import SpecDecoder

VOCAB = 211


def decoder(backend, batch, m, k=3, capacity=512, draft=True):
    target, d = stub_pair(batch, VOCAB, [True, False, True], 1, capacity, accept_prob=0.6, seed=5, backend=backend)
    return SpecDecoder(target, d if draft else None, k=k if draft else 0, m_rounds=m)


def test_rungs():
    assert ladder_rungs(1) == (1,)
    assert ladder_rungs(8) == (1, 2, 4, 8)
    assert ladder_rungs(12) == (1, 2, 4, 8, 12)
    assert ladder_rungs(2) == (1, 2)


@pytest.mark.parametrize("m, depth", [(8, None), (12, 3), (1, 2)])
@pytest.mark.parametrize("draft", [True, False], ids=["spec", "plain"])
def test_any_sequence_of_rungs_equals_the_oracle(backend, rng, m, depth, draft):
    batch = 7
    dec = decoder(backend, batch, m, draft=draft)
    prompts = [rng.integers(0, VOCAB, int(rng.integers(1, 19))).tolist() for _ in range(batch)]
    dec.prefill(prompts)
    graph = BurstGraph(dec, ladder=True, gapless=depth is not None, depth=depth)
    assert graph.ladder and graph.rungs == ladder_rungs(m) and graph.info()["ladder"] == list(ladder_rungs(m))
    asked = [int(r) for r in rng.integers(1, m + 3, 9)] + [None]  # past M: capped at the longest rung
    out = [[] for _ in range(batch)]
    ran, in_flight = [], 0
    for i, r in enumerate(asked):
        graph.replay(rounds=r)
        in_flight += 1
        if in_flight == graph.n_graphs or i == len(asked) - 1:  # bursts of several rungs in flight, then drained
            for _ in range(in_flight):
                tokens = graph.drain()
                ran.append(graph.last_rounds)
                assert tokens.rounds == graph.last_rounds
                for b, t in enumerate(tokens):
                    out[b] += t.tolist()
            in_flight = 0
            assert graph.rounds_in_flight == 0
    assert ran == [graph.rung_for(r) for r in asked]
    assert all(rung in graph.rungs for rung in ran)
    acc = dec.accept_counters()
    assert (acc[:, 1] == sum(ran)).all()  # every slot committed in every round run
    for b in range(batch):
        assert out[b] == greedy_reference(prompts[b], len(out[b]), VOCAB), b


def test_rung_for_picks_the_shortest_rung_that_covers_the_rounds():
    dec = decoder("numpy", 1, 12)
    graph = BurstGraph(dec, ladder=True)
    assert [graph.rung_for(r) for r in (1, 2, 3, 4, 5, 8, 9, 12, 13, None)] == [1, 2, 4, 4, 8, 8, 12, 12, 12, 12]
    fixed = BurstGraph(dec)
    assert not fixed.ladder and fixed.rungs == (12,) and fixed.rung_for(3) == 12  # no ladder: always M


def test_ladder_flags():
    dec = decoder("numpy", 1, 4)
    with pytest.raises(ValueError, match="ladder=True stands in for a device-exit burst"):
        BurstGraph(dec, ladder=True, device_exit=True)
    with pytest.raises(TypeError, match="ladder must be a bool"):
        BurstGraph(dec, ladder="yes")
    graph = BurstGraph(dec, ladder=True, device_exit="auto")  # numpy: the WHILE loop runs, no ladder
    assert graph.device_exit and not graph.ladder and graph.rungs == (4,)


@pytest.mark.parametrize("backend", [pytest.param("cupy", marks=gpu)])
def test_torch_model_ladder_on_the_gpu(backend):
    """The tiny random Llama pair, each rung captured by torch: the tokens equal its full-recompute greedy."""
    pytest.importorskip("torch")
    from graphburst.models.checkpoint import tiny_random_pair

    target, draft = tiny_random_pair(batch=2, capacity=160, backend=backend)
    dec = SpecDecoder(target, draft, k=3, m_rounds=8)
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    dec.prefill(prompts)
    graph = BurstGraph(dec, ladder=True, gapless=True)
    out = [[] for _ in prompts]
    for r in (1, 8, 3, 2, 5, 1):
        graph.replay(rounds=r)
        for b, t in enumerate(graph.drain()):
            out[b] += t.tolist()
    cpu, _ = tiny_random_pair(batch=1, capacity=160, backend="numpy")
    for b, prompt in enumerate(prompts):
        assert out[b] == cpu.module.greedy(prompt, len(out[b])), b
