"""Chunked prefill through the torch adapter: a tiny fp32 Llama pair prefilled in ragged
chunks holds the KV a whole prefill holds, the same first pending token, and then decodes
the same greedy tokens through SpecDecoder bursts (checked against ``Llama.greedy``, which
re-runs the whole prefix for every token). Given the host slot list (``rows``), the
adapter's prefill reads nothing back from the device.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from graphburst import SpecDecoder
from graphburst.backend import Backend
from graphburst.constants import PLACEHOLDER_TOKEN
from graphburst.models.checkpoint import tiny_random_pair

from marks import BACKENDS, requires_gpu
from test_chunked_prefill import chunk_calls, whole_call

torch.set_num_threads(1)  # tiny tensors; CI's 2 cores are shared with pytest itself

BATCH, CAPACITY, VOCAB = 5, 320, 512
LENGTHS = {0: 19, 1: 257, 2: 7, 3: 1}  # slot 4 is never prefilled
# Call 0 finishes no slot (the target gets no pend, so runs no head); slot 0 sits call 1 out.
SCHEDULE = {0: [7, 0, 12], 1: [19, 237, 1], 2: [1, 6, 0], 3: [0, 1, 0]}


class NoHostReads(TorchFunctionMode):
    """Raise on any torch call that reads a tensor's value on the host (a sync on a GPU):
    nonzero, item, bool-mask indexing and their kin."""

    READS = {torch.nonzero, torch.Tensor.nonzero, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
             torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy,
             torch.Tensor.cpu, torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.argwhere}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise AssertionError(f"host read: {func.__name__}")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                raise AssertionError("host read: boolean-mask indexing")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads(backend):
    """On a GPU torch's own sync detector, else :class:`NoHostReads`."""
    if not backend.is_gpu:
        with NoHostReads():
            yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def poison(backend, target, draft, pos, pend, seed: int) -> None:
    """Finite garbage in every KV row (NaN would leak through masked attention), lengths and counters."""
    gen = torch.Generator().manual_seed(seed)
    for model in (target, draft):
        for kv in model.module.kv:
            kv.copy_(torch.randn(kv.shape, generator=gen) * 3)
        model._length.fill_(123)
    pos[...] = PLACEHOLDER_TOKEN
    pend[...] = PLACEHOLDER_TOKEN
    if backend.is_gpu:
        torch.cuda.synchronize()


def snapshot(backend, target, draft, pos, pend, stream):
    stream.synchronize()  # the prefill ran there; torch reads below on its own stream
    host = [backend.to_host(a, stream) for a in (pos, pend)]
    return dict(kv=[kv.detach().cpu().clone() for m in (target, draft) for kv in m.module.kv],
                lengths=[m._length.cpu().clone() for m in (target, draft)], pos=host[0], pend=host[1])


def upload(backend, stream, call: dict, names):
    out = [backend.to_device(call[n], stream) for n in names]
    backend.order_after_current(stream)  # the counters' and models' fills ran on the current stream
    return out


def whole_prefill(backend, dec, prompts):
    """The old positional call, every prompt in one piece (what any model accepts)."""
    stage, lens = upload(backend, dec.stream, whole_call(prompts, BATCH), ("stage", "lens"))
    dec.target.prefill(stage, lens, dec.bufs.pos_ctr, dec.bufs.pend, dec.stream)
    dec.draft.prefill(stage, lens, None, None, dec.stream)


def chunked_prefill(backend, dec, prompts):
    """The decoder's chunk calls (target pend only when a slot finishes), checked for host reads."""
    for call in chunk_calls(prompts, SCHEDULE, BATCH):
        stage, lens, start = upload(backend, dec.stream, call, ("stage", "lens", "start"))
        pend = dec.bufs.pend if call["final"] else None
        with no_host_reads(backend):
            dec.target.prefill(stage, lens, dec.bufs.pos_ctr, pend, dec.stream, start=start, rows=call["rows"])
            dec.draft.prefill(stage, lens, None, None, dec.stream, start=start, rows=call["rows"])


def decoder(backend, prompts, prefill):
    """A SpecDecoder admitted as usual, whose models' state is then poisoned and prefilled
    again by ``prefill``: only that call decides what the bursts see."""
    target, draft = tiny_random_pair(batch=BATCH, capacity=CAPACITY, backend=backend, vocab=VOCAB)
    dec = SpecDecoder(target, draft, k=3, m_rounds=2)
    dec.prefill([prompts[b].tolist() if b in prompts else None for b in range(BATCH)])
    dec.stream.synchronize()
    poison(backend, target, draft, dec.bufs.pos_ctr, dec.bufs.pend, seed=5)
    prefill(backend, dec, prompts)
    return dec, snapshot(backend, target, draft, dec.bufs.pos_ctr, dec.bufs.pend, dec.stream)


def bursts(dec, n: int) -> list[list[int]]:
    got = [[] for _ in range(BATCH)]
    for _ in range(n):
        for b, t in enumerate(dec.run_burst(mode="pre_issued")):
            got[b] += t.tolist()
    return got


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_chunks_equal_a_whole_prefill_and_decode_the_same(rng, backend_name):
    backend = Backend(backend_name)
    prompts = {b: rng.integers(0, VOCAB, n).astype(np.int32) for b, n in LENGTHS.items()}
    whole, want = decoder(backend, prompts, whole_prefill)
    chunked, got = decoder(backend, prompts, chunked_prefill)
    for i, (g, w) in enumerate(zip(got["kv"], want["kv"])):  # [2, B, S, KV, D] per layer
        for b, p in prompts.items():
            torch.testing.assert_close(g[:, b, : len(p)], w[:, b, : len(p)], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"layer array {i}, slot {b}: {m}")
        torch.testing.assert_close(g[:, 4], w[:, 4], atol=0, rtol=0, msg="slot 4 was never prefilled")
    for g, w in zip(got["lengths"], want["lengths"]):
        assert g.tolist() == w.tolist() == [len(prompts[b]) if b in prompts else 123 for b in range(BATCH)]
    np.testing.assert_array_equal(got["pos"], want["pos"])
    np.testing.assert_array_equal(got["pend"], want["pend"])
    assert got["pend"][4] == PLACEHOLDER_TOKEN
    tokens = bursts(chunked, 3)
    assert tokens == bursts(whole, 3)
    module = chunked.target.module
    for b, p in prompts.items():
        assert len(tokens[b]) >= 6
        assert tokens[b] == module.greedy(p.tolist(), len(tokens[b]), row=b), f"slot {b}"


def test_the_host_read_check_can_fail():
    # Without rows the adapter reads the slots back from prompt_len (torch.nonzero): the
    # check above must catch that, or it proves nothing.
    target, draft = tiny_random_pair(batch=BATCH, capacity=CAPACITY, backend="numpy", vocab=VOCAB)
    call = chunk_calls({0: np.arange(9, dtype=np.int32)}, {0: [4, 5]}, BATCH)[0]
    pos, pend = np.zeros(BATCH, np.int32), np.zeros(BATCH, np.int32)
    with pytest.raises(AssertionError, match="host read: nonzero"), NoHostReads():
        target.prefill(call["stage"], call["lens"], pos, pend, None, start=call["start"])
    with NoHostReads():
        target.prefill(call["stage"], call["lens"], pos, pend, None, start=call["start"], rows=call["rows"])


@pytest.mark.gpu
@requires_gpu
def test_gpu_sync_detector_catches_a_prefill_without_rows():
    backend = Backend("cupy")
    target, draft = tiny_random_pair(batch=BATCH, capacity=CAPACITY, backend=backend, vocab=VOCAB)
    call = chunk_calls({0: np.arange(9, dtype=np.int32)}, {0: [4, 5]}, BATCH)[0]
    stream = backend.new_stream()
    stage, lens, start = upload(backend, stream, call, ("stage", "lens", "start"))
    pos, pend = backend.zeros((BATCH,), np.int32), backend.zeros((BATCH,), np.int32)
    backend.order_after_current(stream)
    with pytest.raises(RuntimeError, match="synchroniz"), no_host_reads(backend):
        target.prefill(stage, lens, pos, None, stream, start=start)
    with no_host_reads(backend):
        target.prefill(stage, lens, pos, None, stream, start=start, rows=call["rows"])
        target.prefill(stage, lens, pos, pend, stream, start=start, rows=call["rows"])
    stream.synchronize()
    assert backend.to_host(pos, stream)[0] == 4


def test_only_the_final_chunk_runs_the_head():
    # A non-final chunk (pend None) and the draft's calls need no logits: norm and head never run.
    target, draft = tiny_random_pair(batch=BATCH, capacity=CAPACITY, backend="numpy", vocab=VOCAB)
    heads = []
    for model in (target, draft):
        model.module.norm.register_forward_hook(lambda mod, args, out, m=model: heads.append(m))
    first, last = chunk_calls({0: np.arange(9, dtype=np.int32)}, {0: [4, 5]}, BATCH)
    pos, pend = np.zeros(BATCH, np.int32), np.full(BATCH, PLACEHOLDER_TOKEN, np.int32)
    for call, final in ((first, False), (last, True)):
        kw = dict(start=call["start"], rows=call["rows"])
        target.prefill(call["stage"], call["lens"], pos, pend if final else None, None, **kw)
        draft.prefill(call["stage"], call["lens"], None, None, None, **kw)
        assert heads == ([target] if final else []) and pos[0] == call["start"][0] + call["lens"][0]
    assert pend[0] == target.module.greedy(list(range(9)), 1)[0]
