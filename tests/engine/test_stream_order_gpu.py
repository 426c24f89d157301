"""Decoder initialisation is stream-ordered (GPU only).

The caller's KV caches are made with ``cupy.zeros`` on the legacy null stream, which a
non-blocking stream does not wait for. The test holds the legacy stream back on purpose
with a spin kernel, so the caches' zero-fill lands long after the decoder is built. If
the decoder's stream did not wait for it, the late zero-fill would wipe the prefilled
KV entries and the tokens (and the draft's acceptance) would change.
"""

from __future__ import annotations

import numpy as np

from marks import gpu
from graphburst import greedy_reference, stub_pair
from graphburst.engine.decoder import SpecDecoder

pytestmark = gpu

VOCAB = 5003
SPIN_NS = 50_000_000  # 50 ms: far longer than building a decoder and issuing its prefill
SPIN_SRC = r"""
extern "C" __global__ void spin(const long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)ns);
}
"""
ENGINES = ("per_round_sync", "pre_issued", "graph", "gapless")


def _spin_kernel():
    import cupy

    return cupy.RawKernel(SPIN_SRC, "spin")


def _prompts(batch: int) -> list:
    rng = np.random.default_rng(7)
    return [rng.integers(0, VOCAB, int(rng.integers(1, 20))).tolist() for _ in range(batch)]


def _run(engine: str, n_bursts: int, spin) -> list:
    """Build models on a delayed legacy stream, then a decoder; return tokens per burst per slot."""
    import cupy

    from graphburst.capture import BurstGraph

    cupy.cuda.Device().synchronize()
    batch = 8
    null = cupy.cuda.Stream.null
    with null:  # the caller's current stream: the legacy default stream
        spin((1,), (1,), (np.int64(SPIN_NS),))
        target, draft = stub_pair(batch, VOCAB, [True, False, True], [True, True], 512, accept_prob=0.7,
                                  backend="cupy")
        dec = SpecDecoder(target, draft, k=4, m_rounds=4)
        assert not null.done, "the spin kernel ended before the decoder was built; the test proves nothing"
        dec.prefill(_prompts(batch))
        bursts = []
        if engine in ("per_round_sync", "pre_issued"):
            for _ in range(n_bursts):
                bursts.append([t.tolist() for t in dec.run_burst(mode=engine)])
        else:
            graph = BurstGraph(dec, gapless=engine == "gapless")
            if engine == "gapless":
                for _ in range(n_bursts // 2):
                    graph.replay()
                    graph.replay()  # two bursts in flight
                    bursts.append([t.tolist() for t in graph.drain()])
                    bursts.append([t.tolist() for t in graph.drain()])
            else:
                for _ in range(n_bursts):
                    graph.replay()
                    bursts.append([t.tolist() for t in graph.drain()])
    cupy.cuda.Device().synchronize()
    return bursts


def test_every_engine_commits_the_same_tokens_when_the_legacy_stream_is_late():
    from graphburst.capture import BurstGraph

    spin = _spin_kernel()
    # Compile the spin kernel and warm up graph capture outside the timed region.
    spin((1,), (1,), (np.int64(1000),))
    t, d = stub_pair(1, VOCAB, 1, 1, 64, backend="cupy")
    BurstGraph(SpecDecoder(t, d, k=4, m_rounds=4))
    import cupy

    cupy.cuda.Device().synchronize()

    n_bursts = 6
    runs = {engine: _run(engine, n_bursts, spin) for engine in ENGINES}
    base = runs["per_round_sync"]
    for engine, bursts in runs.items():
        for i, (got, want) in enumerate(zip(bursts, base)):
            assert got == want, f"{engine} differs from per_round_sync at burst {i}"
    prompts = _prompts(8)
    for b, prompt in enumerate(prompts):
        seq = [tok for burst in base for tok in burst[b]]
        assert seq == greedy_reference(prompt, len(seq), VOCAB), f"slot {b}"


def test_decoder_waits_for_the_callers_stream_without_a_host_sync():
    """Building the decoder must not block the host on the delayed legacy stream."""
    import time

    import cupy

    spin = _spin_kernel()
    spin((1,), (1,), (np.int64(1000),))
    cupy.cuda.Device().synchronize()
    with cupy.cuda.Stream.null:
        spin((1,), (1,), (np.int64(SPIN_NS),))
        t, d = stub_pair(1, VOCAB, 1, 1, 64, backend="cupy")
        t0 = time.perf_counter()
        dec = SpecDecoder(t, d, k=4, m_rounds=4)
        built = time.perf_counter() - t0
        still_running = not cupy.cuda.Stream.null.done
    assert still_running and built < SPIN_NS * 1e-9, f"construction took {built * 1e3:.1f} ms: a host sync?"
    dec.prefill([[1, 2, 3]])
    tokens = dec.run_burst(mode="pre_issued")[0].tolist()
    assert tokens and tokens == greedy_reference([1, 2, 3], len(tokens), VOCAB)


def test_uploads_tables_and_reads_on_a_stream_ignore_a_late_legacy_stream():
    """Arrays and pointer tables copied on a stream, a kernel through the table on it, and the read
    back on it, all while the legacy stream is held: the kernel sees the uploads, and nothing waited
    for the legacy stream (it is still spinning)."""
    import cupy

    from graphburst.backend import Backend
    from graphburst.buffers import PtrTable

    be = Backend("cupy")
    spin = _spin_kernel()
    spin((1,), (1,), (np.int64(1000),))
    warm = be.new_stream()  # the rollback kernel compiled and loaded outside the timed region
    one = be.to_device(np.zeros(1, np.int32), warm)
    be.ops.rollback_stream(PtrTable([one], be, stream=warm), one, one, stream=warm)
    cupy.cuda.Device().synchronize()
    rng = np.random.default_rng(3)
    batch, n_layers = 257, 4
    long_spin = 20 * SPIN_NS  # 1 s: a dozen small copies stay inside it even behind another process's copies
    lengths = [rng.integers(0, 100, batch).astype(np.int32) for _ in range(n_layers)]
    pos_start = rng.integers(0, 1000, batch).astype(np.int32)
    n_commit = rng.integers(0, 9, batch).astype(np.int32)
    stream = be.new_stream()
    with cupy.cuda.Stream.null:
        spin((1,), (1,), (np.int64(long_spin),))
        dev = [be.to_device(x, stream) for x in lengths]
        table = PtrTable(dev, be, stream=stream)
        resolved = table.resolve()  # the addresses, read back on the table's stream
        assert len(resolved) == n_layers and all(r is d for r, d in zip(resolved, dev))
        start, commit = be.to_device(pos_start, stream), be.to_device(n_commit, stream)
        be.ops.rollback_stream(table, start, commit, stream=stream)
        got = [be.to_host(x, stream) for x in dev]
        still_running = not cupy.cuda.Stream.null.done
    assert still_running, "the spin kernel ended first: the test proves nothing (or something waited for it)"
    for g in got:
        np.testing.assert_array_equal(g, pos_start + n_commit)
    cupy.cuda.Device().synchronize()


def test_a_transfer_without_its_stream_is_refused():
    import pytest

    from graphburst.backend import Backend

    be = Backend("cupy")
    arr = be.zeros((4,), np.int32)
    for call in (lambda: be.to_host(arr, None), lambda: be.upload(arr, np.ones(4, np.int32), None),
                 lambda: be.to_device(np.ones(4, np.int32), None), lambda: be.scatter(arr, [1], 2, None)):
        with pytest.raises(ValueError, match="needs the stream that orders it"):
            call()
