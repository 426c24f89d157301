"""The serving loop: mixed requests, device-side stops, cancellation, bad input, streaming."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from graphburst import greedy_reference, stub_pair
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop
from graphburst.serving.jsonl_input import parse_line
from graphburst.cli import main

VOCAB = 5003


def make_loop(backend, batch=4, k=4, m=3, accept=0.7, capacity=256, engine="graph", pipelined=True):
    target, draft = stub_pair(batch, VOCAB, [True, False, True], [True], capacity, accept_prob=accept,
                              backend=backend)
    return ServeLoop(target, draft, k=k, m_rounds=m, engine=engine, pipelined=pipelined)


def expected(req: Request) -> list:
    ref = greedy_reference(req.prompt, req.max_new_tokens, VOCAB)
    if req.eos is not None and req.eos in ref:
        ref = ref[: ref.index(req.eos) + 1]
    return ref


def random_requests(rng, n, eos_rate=0.4):
    reqs = []
    for _ in range(n):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 12))).tolist()
        limit = int(rng.integers(1, 40))
        eos = None
        if rng.random() < eos_rate:  # a stop token that really occurs, often mid-run
            eos = greedy_reference(prompt, limit, VOCAB)[int(rng.integers(0, limit))]
        options = dict(accept_prob=float(rng.choice([0.3, 0.9, 1.0])), seed=int(rng.integers(0, 1000)))
        reqs.append(Request(prompt, limit, eos=eos, options=options))
    return reqs


@pytest.mark.parametrize("engine, pipelined", [("graph", True), ("graph", False), ("per_round_sync", False)])
def test_mixed_requests_arriving_while_others_run(backend, rng, engine, pipelined):
    loop = make_loop(backend, engine=engine, pipelined=pipelined)
    reqs = random_requests(rng, 23)
    states = [loop.submit(r) for r in reqs[:6]]
    loop.step()
    loop.step()
    states += [loop.submit(r) for r in reqs[6:]]  # arrive while the first ones run
    loop.run_until_idle()
    for s in states:
        assert s.tokens == expected(s.request), s.request
        st = s.stats()
        assert s.done and st["ttft_ms"] is not None
        # its parts: the wait for a slot, then the prefill up to the first token's hand-out
        assert st["queue_ms"] >= 0 and st["prefill_ms"] >= 0
        assert st["queue_ms"] + st["prefill_ms"] == pytest.approx(st["ttft_ms"])
    assert loop.stats()["captures"] == (1 if engine == "graph" else 0)


def test_eos_in_the_middle_of_an_accepted_run_leaks_nothing(backend):
    loop = make_loop(backend, accept=1.0, k=7, m=2)
    prompt = [11, 22, 33]
    ref = greedy_reference(prompt, 40, VOCAB)
    eos = ref[3]  # every draft is accepted, so the stop falls inside a run of k + 1
    s = loop.submit(Request(prompt, 40, eos=eos))
    loop.run_until_idle()
    assert s.tokens == ref[: ref.index(eos) + 1]
    assert s.accepted <= len(s.tokens) - s.rounds  # counters stop at the stop


def test_idle_slots_emit_nothing(backend):
    loop = make_loop(backend, batch=5)
    s = loop.submit(Request([1, 2], 12))
    loop.run_until_idle()
    assert s.tokens == greedy_reference([1, 2], 12, VOCAB)
    acc = loop.dec.accept_counters()
    assert (acc[1:] == 0).all()
    assert (loop.dec.positions()[1:] == 0).all()


def test_cancellation_frees_the_slot(backend):
    loop = make_loop(backend, batch=1, m=1)
    a = loop.submit(Request([4], 200))
    waiting = loop.submit(Request([6], 10))
    b = loop.submit(Request([5], 10))
    loop.step()
    loop.cancel(a)
    loop.cancel(waiting)  # cancelled in the queue, behind a running request: never admitted
    loop.run_until_idle()
    assert a.done and a.tokens == greedy_reference([4], len(a.tokens), VOCAB) and len(a.tokens) < 200
    assert waiting.done and waiting.tokens == [] and waiting.slot is None
    assert b.tokens == greedy_reference([5], 10, VOCAB)


@pytest.mark.parametrize("req, match", [
    (Request([], 4), "non-empty"),
    (Request([VOCAB], 4), "outside the vocabulary"),
    (Request([1], 0), "max_new_tokens must be >= 1"),
    (Request([1] * 200, 100), "needs 300 KV entries"),
    (Request([1], 3, eos=VOCAB), "eos must be <="),
    (Request([1.5], 3), "prompt.0. must be an int"),
])
def test_bad_requests_are_rejected_and_the_loop_keeps_serving(backend, req, match):
    loop = make_loop(backend)
    good = loop.submit(Request([9], 5))
    with pytest.raises((ValueError, TypeError), match=match):
        loop.submit(req)
    loop.run_until_idle()
    assert good.tokens == greedy_reference([9], 5, VOCAB)


def test_generator_and_asyncio_streaming(backend):
    loop = make_loop(backend)
    s1 = loop.submit(Request([7, 8], 17))
    s2 = loop.submit(Request([9], 9))
    assert list(loop.stream(s1)) == greedy_reference([7, 8], 17, VOCAB)

    async def consume():
        return [t async for t in loop.astream(s2)]

    assert asyncio.run(consume()) == greedy_reference([9], 9, VOCAB)


def test_parse_line_errors():
    with pytest.raises(ValueError, match="bad JSON"):
        parse_line("{nope")
    with pytest.raises(ValueError, match="missing field"):
        parse_line('{"prompt": [1]}')
    with pytest.raises(TypeError, match="JSON object"):
        parse_line("[1, 2]")
    assert parse_line('{"id": 3, "prompt": [1], "max_new_tokens": 2}').id == 3  # kept as given: 3 and "3" are two ids


def test_cli_serve_writes_records_and_errors(tmp_path, capsys):
    lines = ['{"id": "r1", "prompt": [12, 7, 99], "max_new_tokens": 16, "eos": 2}', "not json",
             '{"prompt": [3], "max_new_tokens": 5}', '{"prompt": [1], "max_new_tokens": 0}']
    src = tmp_path / "req.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["serve", "--requests", str(src), "--output", str(out), "--backend", "numpy", "--batch", "2",
                 "--vocab", str(VOCAB), "--capacity", "128"]) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    errors = {r["line"]: r["error"] for r in recs if "error" in r}
    assert set(errors) == {2, 4}
    done = {r["id"]: r for r in recs if "tokens" in r}
    assert done["r1"]["tokens"] == expected(Request([12, 7, 99], 16, eos=2))
    assert [r for r in done.values() if r["id"] != "r1"][0]["tokens"] == greedy_reference([3], 5, VOCAB)


@pytest.mark.gpu
def test_soak_10000_requests_one_graph():
    import cupy

    from graphburst.backend import Backend

    loop = make_loop(Backend("cupy"), batch=64, k=4, m=4, capacity=64)
    rng = np.random.default_rng(123)
    reqs = random_requests(rng, 10_000, eos_rate=0.3)
    for r in reqs:
        r.max_new_tokens = min(r.max_new_tokens, 20)
    first = [loop.submit(r) for r in reqs[:200]]
    loop.run_until_idle()  # settle the pool before measuring
    pool = cupy.get_default_memory_pool()
    used0 = pool.used_bytes()
    states = first + [loop.submit(r) for r in reqs[200:]]
    loop.run_until_idle()
    assert pool.used_bytes() <= used0
    assert loop.graph.captures == 1
    bad = [s.request.id for s in states if s.tokens != expected(s.request)]
    assert not bad, bad[:5]


def test_request_options_reach_the_models_and_unknown_keys_are_refused():
    """Per-request model options go through the protocol hook; a key no model claims is an error."""
    loop = make_loop("numpy", batch=2, accept=0.5)
    prompt = [1, 2, 3]
    sure = loop.submit(Request(prompt, 40, options={"accept_prob": 1.0, "seed": 1}))
    never = loop.submit(Request(prompt, 40, options={"accept_prob": 0.0}))
    loop.run_until_idle()
    assert sure.tokens == never.tokens == expected(Request(prompt, 40))
    assert sure.accepted > 0 and never.accepted == 0  # the stub draft got each slot's own setting
    with pytest.raises(ValueError, match="unknown model option 'acept_prob'"):
        loop.submit(Request(prompt, 4, options={"acept_prob": 1.0}))
    with pytest.raises(ValueError, match="accept_prob"):
        loop.submit(Request(prompt, 4, options={"accept_prob": 1.5}))
    rec = parse_line('{"prompt": [1, 2], "max_new_tokens": 3, "accept_prob": 0.5, "seed": 4, "temperature": 0.5}')
    assert rec.options == {"accept_prob": 0.5}  # seed and temperature are the request's sampling fields
    assert (rec.seed, rec.temperature, rec.top_k, rec.top_p) == (4, 0.5, None, None)


def test_a_request_may_ask_for_fewer_drafts_and_a_batch_limit_turns_speculation_off():
    """The option "k" (0 to the loop's k) caps one request's drafts; the tokens stay greedy. With
    spec_max_batch 1 two requests decoding together accept no draft until one of them ends."""
    loop = make_loop("numpy", batch=3, accept=1.0)
    prompt = [1, 2, 3]
    full, one, plain = (loop.submit(Request(prompt, 30, options=o)) for o in (None, {"k": 1}, {"k": 0}))
    loop.run_until_idle()
    assert full.tokens == one.tokens == plain.tokens == expected(Request(prompt, 30))
    assert full.accepted > one.accepted > 0 and plain.accepted == 0
    assert plain.rounds == 30  # one token a round
    with pytest.raises(ValueError, match=r"option 'k'.*\[0, 4\].*got 5"):
        loop.submit(Request(prompt, 4, options={"k": 5}))
    assert parse_line('{"prompt": [1], "max_new_tokens": 2, "k": 0}').options == {"k": 0}  # a JSONL line's "k"
    target, draft = stub_pair(2, VOCAB, [True, False, True], [True], 256, accept_prob=1.0, backend="numpy")
    loop = ServeLoop(target, draft, k=4, m_rounds=3, spec_max_batch=1)
    short, long_ = loop.submit(Request(prompt, 6)), loop.submit(Request([4, 5], 60))
    loop.run_until_idle()
    assert short.tokens == expected(Request(prompt, 6)) and long_.tokens == expected(Request([4, 5], 60))
    assert short.accepted == 0  # it decoded beside the other request only: speculation off
    assert long_.accepted > 0  # alone after the short one ended: on again


@pytest.mark.parametrize("pipelined", [True, False])
def test_token_rows_while_running_and_after_cancel(rng, pipelined):
    """Tokens read mid-run are a growing prefix of the reference; a cancelled request never grows
    again; deliveries account for every token; a slot's row is reused clean by the next request."""
    loop = make_loop("numpy", batch=3, m=2, pipelined=pipelined)
    reqs = [Request(rng.integers(0, VOCAB, int(rng.integers(1, 8))).tolist(), int(rng.integers(5, 60)))
            for _ in range(9)]
    states = [loop.submit(r) for r in reqs]
    frozen = {}  # cancelled state -> its tokens when cancel() returned
    seen = {id(s): 0 for s in states}
    while not loop.idle:
        loop.step()
        for s in states:
            toks = s.tokens
            assert toks == greedy_reference(s.request.prompt, len(toks), VOCAB)
            assert len(toks) >= seen[id(s)] and s.n_tokens == len(toks)
            assert sum(n for _, n in s.deliveries) == len(toks)
            seen[id(s)] = len(toks)
            if not s.done and toks and rng.random() < 0.1:
                loop.cancel(s)
                frozen[s] = list(s.tokens)
        for s, toks in frozen.items():
            assert s.tokens == toks and s.finish_reason == "cancelled"
    for s in states:
        if s not in frozen:
            assert s.finish_reason == "length" and s.tokens == expected(s.request)
            assert isinstance(s.tokens, list) and json.dumps(s.tokens)
