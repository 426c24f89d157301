"""The drafter's cost per round: ``ngram_search`` against batch and history length.

Each config fills ``B`` histories of ``H`` tokens (pending token last) from a small
alphabet, so nearly every history position starts a candidate match and the kernel walks
its worst case; then it **checks** the device's proposals, breaks and history writes
against the numpy twin, and only then **times**: ``N`` searches captured into one CUDA
graph (the search is one node of a burst round), replayed with CUDA events around each
replay, median over replays, divided by N. On the numpy backend the twin is timed with
``perf_counter`` and labelled as a CPU reference.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..buffers import StreamBufs
from ..constants import UNBOUNDED_BUDGET
from ..kernels import reference
from ..models.ngram import NgramDraft

SEARCHES_PER_GRAPH = 50
ALPHABET = 64  # tokens drawn from this many ids: many candidate ends, so the scan never gets an easy row


def setup(backend, batch: int, history: int, stream, *, k: int, n_min: int, n_max: int, seed: int = 0):
    """A drafter and burst buffers holding ``batch`` random histories of ``history`` tokens
    (positions ``[0, history - 1)`` in ``hist``, the pending token in ``vtok[:, 0]``), uploaded
    on ``stream``, the one the search runs on (after the buffers' fills on the current stream)."""
    rng = np.random.default_rng(seed)
    vocab = 128256
    draft = NgramDraft(batch, vocab, history + k + 1, n_min=n_min, n_max=n_max, backend=backend)
    bufs = StreamBufs(batch, k, 1, backend)
    backend.order_after_current(stream)  # the fills above ran on the current stream
    hist = rng.integers(0, ALPHABET, (batch, draft.capacity)).astype(np.int32)
    backend.upload(draft.hist, hist, stream)
    backend.upload(bufs.pos_ctr, np.full(batch, history - 1, np.int32), stream)
    backend.upload(bufs.budget, np.full(batch, UNBOUNDED_BUDGET, np.int32), stream)
    vtok = np.full((batch, k + 1), -1, np.int32)
    vtok[:, 0] = rng.integers(0, ALPHABET, batch)
    backend.upload(bufs.vtok, vtok, stream)
    draft.bind(bufs)
    return draft, bufs


def _args(draft, bufs):
    return (bufs.vtok, bufs.pos_ctr, bufs.budget, draft.n_min, draft.n_max, draft.hist, draft.hist_len,
            bufs.draft_tok, bufs.draft_conf, bufs.brk)


def check(backend, draft, bufs, stream) -> tuple[int, float]:
    """Run the search on the backend and the twin on host copies; raise AssertionError on any
    difference. Returns (drafts proposed over the batch, the twin's host µs)."""
    host = [backend.to_host(a, stream) for a in _args(draft, bufs)]
    backend.ops.ngram_search(*_args(draft, bufs), write_vtok=True, stream=stream)
    t0 = time.perf_counter()
    reference.ngram_search(*host, write_vtok=True)
    twin_us = (time.perf_counter() - t0) * 1e6
    names = ("vtok", "pos_ctr", "budget", "n_min", "n_max", "hist", "hist_len", "draft_tok", "draft_conf", "brk")
    for name, want, got in zip(names, host, (backend.to_host(a, stream) for a in _args(draft, bufs))):
        if not np.array_equal(want, got):
            raise AssertionError(f"ngram_search: {name} differs from the numpy twin")
    return int(host[-1][:, 0].sum()), twin_us


def time_search(backend, draft, bufs, stream, *, reps: int) -> list[float]:
    """Per-search µs of each of ``reps`` measurements (graph replays on the GPU)."""
    run = lambda: backend.ops.ngram_search(*_args(draft, bufs), write_vtok=True, stream=stream)  # noqa: E731
    if not backend.is_gpu:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            out.append((time.perf_counter() - t0) * 1e6)
        return out
    cp = backend.xp
    with backend.device():
        run()  # compiled and loaded before capture
        stream.synchronize()
        stream.begin_capture()
        for _ in range(SEARCHES_PER_GRAPH):
            run()
        graph = stream.end_capture()
        graph.upload(stream)
        for _ in range(3):
            graph.launch(stream)  # warm-up
        out = []
        for _ in range(reps):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            out.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / SEARCHES_PER_GRAPH)
    return out


def run_search_bench(backend, *, batches, histories, k: int, n_min: int, n_max: int, reps: int, progress=None):
    """One result row per (B, H): checked, then timed."""
    rows = []
    for batch in batches:
        for history in histories:
            stream = backend.new_stream()
            draft, bufs = setup(backend, batch, history, stream, k=k, n_min=n_min, n_max=n_max)
            drafts, twin_us = check(backend, draft, bufs, stream)
            times = time_search(backend, draft, bufs, stream, reps=reps)
            rows.append(dict(batch=batch, history=history, k=k, n_min=n_min, n_max=n_max, checked=True,
                             drafts_proposed=drafts, us_median=statistics.median(times), us_min=min(times),
                             host_twin_us=twin_us, reps=reps,
                             searches_per_graph=SEARCHES_PER_GRAPH if backend.is_gpu else 1))
            if progress is not None:
                progress(rows[-1])
    return rows
