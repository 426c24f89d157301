"""spec_probs_select on the device: ``sel_thr`` bit for bit against ``sampling_ref.select_thr``.

The select is a radix select over integer counts and masses, split over many blocks with
atomics; the numpy twin sorts. Inputs aim at every branch: rows whose first digit already
isolates the threshold, heavy ties (bf16-rounded, integer and all-equal logits: the
index bits decide), groups larger than the kernel's 2048-key list (top_k = 2100 and
3000, top-p in the bulk), -inf and -0 logits, top_k = 1 and V - 1, top_p tiny and just
below 1, temperature <= 0 and rows without filters mixed into one batch. Each case runs
twice on the same scratch, whose accumulators must come back to zero (graph replays
start clean), and once more for one row (``step``).
"""

from __future__ import annotations

import numpy as np
import pytest

from marks import gpu
from graphburst.kernels import sampling_ref as sr
from graphburst.kernels.sampling_scratch import ZEROED
from test_sampling_gpu import F32, assert_bits, dev, ops, scratch, stream  # noqa: F401 (fixtures)

pytestmark = gpu
cp = pytest.importorskip("cupy")

VOCABS = [1, 2, 7, 19, 257, 2048, 2049, 5000, 32000, 128256]
KINDS = ["normal", "bf16", "integers", "equal", "neg_inf", "peaked"]


def select_logits(rng, kind, shape):
    """[B, T, V] float32 logits of one family (see the module docstring)."""
    x = (rng.normal(size=shape) * rng.choice([0.5, 3.0, 20.0])).astype(F32)
    if kind == "bf16":  # 8 mantissa bits: thousands of exact ties in a Llama-sized row
        x = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(F32)
    elif kind == "integers":
        x = rng.integers(-3, 4, shape).astype(F32)
    elif kind == "equal":
        x = np.full(shape, F32(rng.normal()), F32)
    elif kind == "neg_inf":
        x[..., : shape[-1] // 2] = -np.inf
        x[..., 1::7] = -0.0
    elif kind == "peaked":  # one token holds almost all the mass
        x[..., shape[-1] // 3] = 60.0
    return x


def select_settings(rng, batch, vocab):
    """Per-row settings mixing every filter combination, greedy rows and rows without filters."""
    temp = rng.choice(np.array([0, -1, 0.25, 1, 2.5], F32), batch)
    top_k = rng.choice(np.array([0, 1, 2, 50, 2100, 3000, max(vocab - 1, 0), vocab], np.int64), batch)
    top_p = rng.choice(np.array([1, 0.9, 0.5, 1e-6, 0.99999994, np.nan], F32), batch)
    return temp, top_k.astype(np.int32), top_p


def run_select(ops, stream, logits, temp, top_k, top_p, sc, step=None):  # noqa: F811
    d = dev(logits, temp, top_k, top_p)
    ops.probs_select(*d, sc, step=step, stream=stream)
    stream.synchronize()
    return cp.asnumpy(sc.sel_thr)


def assert_clean(sc, what):
    for name in ZEROED:
        assert not bool(cp.any(getattr(sc, name))), f"{what}: {name} not re-zeroed"


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("kind", KINDS)
def test_select_thr_matches_reference(rng, ops, stream, vocab, kind):  # noqa: F811
    batch, rows = (16, 5) if vocab <= 32000 else (4, 3)
    logits = select_logits(rng, kind, (batch, rows, vocab))
    temp, top_k, top_p = select_settings(rng, batch, vocab)
    temp[:2], top_k[:2], top_p[:2] = 1, [50, 0], [0.9, 0.9]  # the benchmark's setting and top-p alone, always
    flat = logits.reshape(batch * rows, vocab)
    rep = lambda a: np.repeat(a, rows)  # noqa: E731 (per sequence -> per row)
    want = sr.select_thr(flat, rep(temp), rep(top_k), rep(top_p)).reshape(batch, rows)
    sc = scratch(batch, rows + 1, vocab)  # sel_thr and sel_part poisoned
    sc.sel_part.fill(np.uint64(0xFFFFFFFFFFFFFFF0))
    for attempt in ("first call", "second call on the same scratch"):
        got = run_select(ops, stream, logits, temp, top_k, top_p, sc)
        assert_bits(got[:, :rows], want, f"sel_thr, {attempt}")
        assert_clean(sc, attempt)
    sc.sel_thr.fill(np.uint64(0xFFFFFFFFFFFFFFF0))
    got = run_select(ops, stream, logits, temp, top_k, top_p, sc, step=rows - 1)
    assert_bits(got[:, rows - 1], want[:, rows - 1], "sel_thr, step")
    assert bool(np.all(got[:, : rows - 1] == np.uint64(0xFFFFFFFFFFFFFFF0))), "step wrote other rows"
    assert_clean(sc, "step")


@pytest.mark.parametrize("vocab", [7, 2049, 128256])
def test_select_edge_settings(rng, ops, stream, vocab):  # noqa: F811
    """top_k = 1 and V - 1, top_p tiny and the float just below 1, each alone and together."""
    settings = [(1, 1.0), (vocab - 1, 1.0), (0, 1e-30), (0, 0.99999994), (1, 1e-30), (vocab - 1, 0.99999994),
                (vocab - 1, 1e-30), (1, 0.99999994)]
    batch = len(settings)
    logits = select_logits(rng, "normal", (batch, 1, vocab))
    logits[1::2, 0, 3 % vocab] = logits[1::2, 0].max(axis=-1)  # a tie at the maximum
    temp = np.ones(batch, F32)
    top_k = np.array([k for k, _ in settings], np.int32)
    top_p = np.array([p for _, p in settings], F32)
    want = sr.select_thr(logits[:, 0], temp, top_k, top_p)
    sc = scratch(batch, 1, vocab)
    got = run_select(ops, stream, logits, temp, top_k, top_p, sc)
    assert_bits(got[:, 0], want, "sel_thr")
    assert_clean(sc, "edge settings")
