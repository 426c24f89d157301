"""The logits processing fields through the serving loop (``ServeLoop(..., sampling=True, fields=True)``):
requests carry them as Request fields (or JSONL keys), slots are reused, and the tokens are a host
loop of transformers' processors; a loop without the fields refuses them at submission."""

from __future__ import annotations

import pytest

from fields_reference import PEAK, VOCAB, host_decode
from graphburst.models.stubs import stub_pair
from graphburst.serving.jsonl_input import parse_line
from graphburst.serving.loop import ServeLoop
from graphburst.serving.request import Request


def make_loop(batch=2, *, fields=True, backend="numpy"):
    target, draft = stub_pair(batch, VOCAB, [True, False], [True], 256, accept_prob=0.6, p_min=0.2, seed=2,
                              backend=backend, logit_peak=PEAK)
    return ServeLoop(target, draft, k=3, m_rounds=2, sampling=True, fields=fields)


REQUESTS = [
    ([1, 2, 3], 14, None, {"repetition_penalty": 1.7, "logit_bias": {"4": 2.0}}),
    ([9, 9], 10, None, {"frequency_penalty": 0.6, "presence_penalty": 0.2}),
    ([5, 6, 7, 8], 12, None, {}),
    ([3, 1], 9, None, {"presence_penalty": 1.5, "repetition_penalty": 1.1}),
]


def test_served_tokens_follow_the_fields_across_reused_slots(backend):
    loop = make_loop(2, backend=backend)
    states = [loop.submit(Request(p, n, eos=e, **f)) for p, n, e, f in REQUESTS]  # 4 requests, 2 slots
    loop.run_until_idle()
    for s, (p, n, e, f) in zip(states, REQUESTS):
        assert s.tokens == host_decode(p, n, f, e), f


def test_min_tokens_and_ignore_eos(backend):
    prompt = [2, 4, 6]
    plain = host_decode(prompt, 12, None)
    eos = plain[2]  # greedy decoding would stop at its third token
    loop = make_loop(3, backend=backend)
    stop = loop.submit(Request(prompt, 12, eos=eos))
    late = loop.submit(Request(prompt, 12, eos=eos, min_tokens=6))
    never = loop.submit(Request(prompt, 12, eos=eos, ignore_eos=True))
    loop.run_until_idle()
    assert stop.tokens == plain[:3] and stop.finish_reason == "eos"
    assert late.tokens == host_decode(prompt, 12, {"min_tokens": 6}, eos) and len(late.tokens) > 3
    assert eos not in late.tokens[:6]
    assert never.tokens == plain and never.finish_reason == "length"


def test_a_loop_without_fields_refuses_them_and_jsonl_keys_are_fields():
    loop = make_loop(1, fields=False)
    with pytest.raises(ValueError, match="min_p = 0.1 needs logits processing"):
        loop.submit(Request([1], 4, min_p=0.1))
    with pytest.raises(ValueError, match="logit_bias token id"):
        make_loop(1).submit(Request([1], 4, logit_bias={VOCAB: 1.0}))
    req = parse_line('{"prompt": [1], "max_new_tokens": 3, "repetition_penalty": 1.2, "logit_bias": {"3": -1}}')
    assert req.repetition_penalty == 1.2 and req.logit_bias == {"3": -1} and req.options is None
