"""Torch-driven capture: a torch model inside the burst graph, mixed pairs, failed captures.

On numpy the "graph" is a recorded program, so these run in CI with CPU torch; the
cupy variants run on a GPU, where torch.cuda.graph owns the capture.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphburst import SpecDecoder
from graphburst.backend import Backend
from graphburst.capture import BurstGraph, CaptureError
from graphburst.models.checkpoint import tiny_random_pair
from graphburst.models.stubs import stub_pair
from graphburst.models.torch_adapter import TorchTarget

torch.set_num_threads(1)  # tiny tensors; CI's two cores are shared with pytest

BACKENDS = ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)]
PROMPTS = [[3, 1, 4, 1, 5], [9, 2], list(range(100, 117))]
NEW = 24


def full_recompute_greedy(module, prompt, n):
    """The target's greedy continuation by re-running the whole prefix each token (no cache reuse)."""
    seq = list(prompt)
    layers = len(module.kv)
    with torch.no_grad():
        for _ in range(n):
            zero = torch.zeros(1, dtype=torch.int32)
            seq.append(int(module(torch.tensor([seq]), zero, [zero] * layers)[0, -1].argmax()))
    return seq[len(prompt):]


def run_to_end(dec, runner):
    got = [[] for _ in range(dec.batch)]
    while dec.host_left.any():
        tokens = runner()
        for b in range(dec.batch):
            got[b] += tokens[b].tolist()
    return got


def mixed_pair(backend, seed=3):
    """A torch (Llama) target with a CuPy/numpy stub draft of the same vocabulary."""
    target, _ = tiny_random_pair(batch=len(PROMPTS), capacity=128, backend=backend, seed=seed)
    _, draft = stub_pair(len(PROMPTS), target.vocab, 2, 1, 128, accept_prob=0.0, backend=backend)
    return target, draft


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("gapless", [False, True])
def test_mixed_pair_graph_equals_eager_and_greedy(backend_name, gapless):
    """A stub draft proposes, the torch target decides: tokens are the target's greedy ones."""
    backend = Backend(backend_name)
    runs = {}
    for mode in ("eager", "graph"):
        target, draft = mixed_pair(backend)
        dec = SpecDecoder(target, draft, k=3, m_rounds=2)
        dec.prefill(PROMPTS, max_new_tokens=NEW)
        if mode == "graph":
            graph = BurstGraph(dec, gapless=gapless)
            assert graph.info()["capture_api"] == "torch"
            runs[mode] = run_to_end(dec, graph.run)
        else:
            runs[mode] = run_to_end(dec, dec.run_burst)
    assert runs["graph"] == runs["eager"]
    reference, _ = tiny_random_pair(batch=1, capacity=128, backend="numpy", seed=3)
    for b, prompt in enumerate(PROMPTS):
        assert runs["graph"][b] == full_recompute_greedy(reference.module, prompt, NEW), b


def test_stub_pair_keeps_the_cupy_capture_path():
    target, draft = stub_pair(2, 64, 2, 1, 64, backend="numpy")
    dec = SpecDecoder(target, draft, k=2, m_rounds=2)
    dec.prefill([[1], [2]])
    assert BurstGraph(dec).info()["capture_api"] == "cupy"
    assert dec.torch_stream is None


class SyncingTarget(TorchTarget):
    """Reads a device value on the host inside verify: forbidden in a captured region."""

    def verify(self, bufs, stream) -> None:
        super().verify(bufs, stream)
        self._views(bufs).tgt_pred.sum().item()


@pytest.mark.gpu
def test_failed_torch_capture_leaves_the_process_usable():
    backend = Backend("cupy")
    target, draft = tiny_random_pair(batch=2, capacity=64, backend=backend, seed=1)
    bad = SyncingTarget(target.module, batch=2, capacity=64, backend=backend)
    dec = SpecDecoder(bad, draft, k=2, m_rounds=2)
    dec.prefill([[1, 2, 3], [4]], max_new_tokens=8)
    with pytest.raises(CaptureError, match="verify"):
        BurstGraph(dec)
    eager = run_to_end(dec, dec.run_burst)  # the stream left capture: eager work still runs
    assert [len(t) for t in eager] == [8, 8]
    torch.randn(1024, device="cuda").sum().item()  # and so does ordinary torch work

    target2, draft2 = tiny_random_pair(batch=2, capacity=64, backend=backend, seed=1)
    dec2 = SpecDecoder(target2, draft2, k=2, m_rounds=2)
    dec2.prefill([[1, 2, 3], [4]], max_new_tokens=8)
    assert run_to_end(dec2, BurstGraph(dec2).run) == eager


@pytest.mark.gpu
def test_torch_graph_info_and_node_count():
    target, draft = tiny_random_pair(batch=2, capacity=64, backend=Backend("cupy"), seed=2)
    dec = SpecDecoder(target, draft, k=2, m_rounds=3)
    dec.prefill([[1, 2], [3]])
    graph = BurstGraph(dec, gapless=True)
    info = graph.info()
    assert info["capture_api"] == "torch"
    nodes = info["graph_nodes_confirmed"]
    # Torch emits many kernels per forward; the burst must hold at least every model call.
    assert nodes is None or nodes >= info["nodes_total"]
    before = np.asarray(dec.positions()).copy()
    graph.run()
    graph.run()
    assert (np.asarray(dec.positions()) > before).all()
