"""The torch adapter with a hand-written outside model, checked against its own CPU greedy truth.

The model is a 3-gram hash written in torch ops over caller-owned KV layers laid out
``[KV, absent, KV]``: each KV layer stores tokens, and the prediction after a token
reads the previous token back from *both* layers, so a stale or un-rolled-back layer
changes the output. The reference below is plain Python over token lists.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from graphburst import SpecDecoder
from graphburst.backend import Backend
from graphburst.capture import BurstGraph
from graphburst.models.torch_model import TorchBufs
from graphburst.models.torch_adapter import TorchDraft, TorchTarget
from graphburst.buffers import StreamBufs

from marks import requires_gpu

# Tiny tensors gain nothing from intra-op threads, and CI's 2 cores are shared with pytest itself.
torch.set_num_threads(1)

VOCAB = 64
SLACK = 8


def ngram_hash(prev, cur):
    """Works on ints and int64 tensors alike."""
    return (prev * 1000003 + cur * 7919 + 12345) % (1 << 20)


def target_token(prev: int, cur: int) -> int:
    h = ngram_hash(prev, cur)
    return (h ^ (h >> 7)) % VOCAB  # what the model computes when both KV layers agree


class HashLM(torch.nn.Module):
    """3-gram hash LM over KV layers ``[KV, absent, KV]``; ``draft=True`` disagrees on some contexts."""

    def __init__(self, batch: int, capacity: int, *, draft: bool, device="cpu"):
        super().__init__()
        self.vocab, self.draft, self.rows = VOCAB, draft, capacity + SLACK
        self.kv_slack = SLACK
        self.kv = [torch.zeros(batch, self.rows, dtype=torch.int64, device=device), None,
                   torch.zeros(batch, self.rows, dtype=torch.int64, device=device)]  # [B, rows] int64 tokens

    def kv_layers(self):
        return list(self.kv)

    def forward(self, tokens, start_pos, lengths, rows=None):
        r, t = tokens.shape
        dev = tokens.device
        rows = torch.arange(r, device=dev) if rows is None else rows
        hs = []
        for store, length in zip(self.kv, lengths):
            if store is None:
                continue
            at = length.long().unsqueeze(1) + torch.arange(t, device=dev)  # [R, T]
            base = rows.unsqueeze(1) * self.rows
            store.view(-1).index_copy_(0, (base + at).reshape(-1), tokens.reshape(-1))
            prev = store.view(-1).index_select(0, (base + (at - 1).clamp(min=0)).reshape(-1)).view(r, t)
            cur = store.view(-1).index_select(0, (base + at).reshape(-1)).view(r, t)
            hs.append(ngram_hash(torch.where(at > 0, prev, 0), cur))
        pred = (hs[0] ^ (hs[1] >> 7)) % VOCAB  # [R, T]
        conf = 1.0 + (hs[0] % 7).float()  # > 0, so argmax is pred; varies, so p_min breaks happen
        if self.draft:
            pred = torch.where(hs[0] % 5 == 0, (pred + 1) % VOCAB, pred)
        logits = torch.zeros(r, t, VOCAB, device=dev)
        return logits.scatter_(2, pred.unsqueeze(-1), conf.unsqueeze(-1))


def greedy_truth(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(target_token(seq[-2] if len(seq) > 1 else 0, seq[-1]))
    return seq[len(prompt):]


def draft_guess(prev: int, cur: int) -> tuple[int, float]:
    """The draft's proposal after (prev, cur) and its softmax confidence, in plain Python."""
    h = ngram_hash(prev, cur)
    tok = target_token(prev, cur)
    tok = (tok + 1) % VOCAB if h % 5 == 0 else tok
    e = np.exp(np.float32(1 + h % 7))
    return tok, float(e / (e + VOCAB - 1))


def accepted_truth(prompt, k, p_min, rounds) -> int:
    """Drafts a correct draft KV accepts over ``rounds`` rounds (bad draft KV lowers it)."""
    seq = list(prompt) + greedy_truth(prompt, rounds * (k + 1) + 1)
    p, total = len(prompt), 0  # seq[p] is the round's anchor token (pend)
    for _ in range(rounds):
        n = 0
        while n < k:
            tok, conf = draft_guess(seq[p + n - 1] if p + n > 0 else 0, seq[p + n])
            if conf < p_min or tok != seq[p + n + 1]:
                break
            n += 1
        total += n
        p += n + 1
    return total


def make_pair(batch, capacity, backend, *, p_min, writes_verify_tokens=True):
    dev = "cpu" if not backend.is_gpu else f"cuda:{backend.device_id}"
    target = TorchTarget(HashLM(batch, capacity, draft=False, device=dev), batch=batch, capacity=capacity,
                         backend=backend)
    draft = TorchDraft(HashLM(batch, capacity, draft=True, device=dev), batch=batch, capacity=capacity,
                       backend=backend, p_min=p_min, writes_verify_tokens=writes_verify_tokens)
    return target, draft


def run_bursts(dec, runner, n_bursts, churn=None):
    got = [[] for _ in range(dec.batch)]
    for _ in range(n_bursts):
        tokens = runner()
        for b in range(dec.batch):
            got[b] += tokens[b].tolist()
        if churn is not None:
            churn()
    return got


@pytest.mark.parametrize("mode", ["per_round_sync", "pre_issued", "graph"])
@pytest.mark.parametrize("writes_verify_tokens,p_min", [(True, 0.3), (False, 0.3), (True, 0.0)])
def test_outside_model_matches_greedy_truth(mode, writes_verify_tokens, p_min, rng):
    backend = Backend("numpy")
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 1, 9)]
    target, draft = make_pair(3, 1024, backend, p_min=p_min, writes_verify_tokens=writes_verify_tokens)
    assert target.cache.n_layers == 3 and target.cache.n_kv_layers == 2
    dec = SpecDecoder(target, draft, k=4, m_rounds=3)
    dec.prefill(prompts)
    runner = BurstGraph(dec).run if mode == "graph" else (lambda: dec.run_burst(mode=mode))
    got = run_bursts(dec, runner, 50)
    for b, prompt in enumerate(prompts):
        assert got[b] == greedy_truth(prompt, len(got[b]))
        assert len(got[b]) >= 50  # at least one token per round
    acc = dec.accept_counters()
    assert (acc[:, 1] == 150).all()
    # Acceptance catches what tokens cannot: a draft KV entry missing after an all-accepted chain.
    assert acc[:, 0].tolist() == [accepted_truth(p, 4, p_min, 150) for p in prompts]
    assert 0 < acc[:, 0].sum() < 150 * 3 * 4
    lengths = dec.target.cache.lengths(dec.stream)
    assert (lengths[[0, 2]] == dec.positions()).all() and (lengths[1] == -1).all()


def test_torch_views_alias_the_buffers():
    bufs = StreamBufs(2, 3, 2, "numpy")
    views = TorchBufs(bufs)
    views.vtok[1, 2] = 7
    views.draft_conf[0, 1] = 0.5
    views.ring[0, 0] = 3  # ring is a view of out_block
    assert bufs.vtok[1, 2] == 7 and bufs.draft_conf[0, 1] == 0.5 and bufs.out_block[0] == 3
    for name in bufs.LAYOUT:
        assert getattr(views, name).data_ptr() == bufs.arrays()[name].ctypes.data


def test_backend_accepts_torch_tensors():
    backend = Backend("numpy")
    t = torch.zeros(4, 5, dtype=torch.int32)
    assert backend.address(t) == t.data_ptr()
    backend.check_device("storage", t)  # a CPU tensor is fine on numpy
    assert backend.address(np.zeros(3)) > 0  # numpy arrays unchanged
    meta = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match="storage is a torch tensor on meta"):
        backend.check_device("storage", meta)


def test_capacity_past_the_modules_own_is_refused():
    from graphburst.models.checkpoint import tiny_random_pair

    target, _ = tiny_random_pair(batch=1, capacity=32, backend="numpy")
    with pytest.raises(ValueError, match="capacity 64 exceeds the module's own KV capacity 32"):
        TorchTarget(target.module, batch=1, capacity=64, backend="numpy")


def test_kv_slack_too_small_for_k_is_refused():
    target, draft = make_pair(1, 64, Backend("numpy"), p_min=0.0)
    with pytest.raises(ValueError, match="kv_slack 8 must be >= k \\+ 2 = 9"):
        SpecDecoder(target, draft, k=7, m_rounds=1)


def test_an_adapter_serves_one_decoder():
    # A second decoder over the same adapters would share their KV caches and lengths.
    target, draft = make_pair(1, 64, Backend("numpy"), p_min=0.0)
    dec = SpecDecoder(target, draft, k=4, m_rounds=1)
    with pytest.raises(ValueError, match="TorchTarget is already bound to another decoder's buffers"):
        SpecDecoder(target, draft, k=4, m_rounds=1)
    with pytest.raises(ValueError, match="TorchDraft was called with buffers it is not bound to"):
        draft.draft_step(StreamBufs(1, 4, 1, "numpy"), 0, None)
    dec.prefill([[1, 2, 3]])
    assert dec.run_burst(mode="per_round_sync")[0].size > 0  # the first decoder still runs
    del dec
    gc.collect()
    SpecDecoder(target, draft, k=4, m_rounds=1)  # a dropped decoder's buffers hold nothing live


def test_a_failed_construction_leaves_the_adapters_free():
    # The target binds, then the draft refuses (its kv_slack is too small for k): a retry
    # with a k that fits must not find the target "bound to another decoder".
    target, draft = make_pair(1, 64, Backend("numpy"), p_min=0.0)
    draft.module.kv_slack = 4
    with pytest.raises(ValueError, match="kv_slack 4 must be >= k \\+ 2 = 6"):
        SpecDecoder(target, draft, k=4, m_rounds=1)
    dec = SpecDecoder(target, draft, k=2, m_rounds=1)
    dec.prefill([[1, 2, 3]])
    assert dec.run_burst(mode="per_round_sync")[0].size > 0


def _tiny_llama_decoder(target, draft, prompts):
    dec = SpecDecoder(target, draft, k=3, m_rounds=2)
    dec.prefill(prompts)
    return dec


def test_a_module_serves_one_live_decoder():
    # The KV storage lives in the torch module: a second decoder over new adapters of the
    # same modules would prefill into the first one's KV rows, and every sequence of the
    # first decoder would then decode wrong tokens. It is refused, naming the module.
    from graphburst.models.checkpoint import tiny_random_pair

    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9]]
    target, draft = tiny_random_pair(batch=2, capacity=64, backend="numpy")
    dec1 = _tiny_llama_decoder(target, draft, prompts)
    out = [t.tolist() for t in dec1.run_burst(mode="pre_issued")]
    kw = dict(batch=2, capacity=64, backend="numpy")
    with pytest.raises(ValueError, match=r"the torch module Llama at 0x[0-9a-f]+ already serves a live SpecDecoder"):
        _tiny_llama_decoder(TorchTarget(target.module, **kw), TorchDraft(draft.module, **kw), [[8] * 9, [2] * 7])
    for b, t in enumerate(dec1.run_burst(mode="pre_issued")):  # the first decoder's tokens stay right
        out[b] += t.tolist()
    for b, prompt in enumerate(prompts):
        assert out[b] == target.module.greedy(prompt, len(out[b]), row=b), f"sequence {b}"


def test_a_module_rebinds_once_its_decoder_is_gone():
    from graphburst.models.checkpoint import tiny_random_pair

    target, draft = tiny_random_pair(batch=1, capacity=64, backend="numpy")
    dec1 = _tiny_llama_decoder(target, draft, [[1, 2, 3]])
    dec1.run_burst(mode="pre_issued")
    del dec1
    gc.collect()
    kw = dict(batch=1, capacity=64, backend="numpy")
    new_target, new_draft = TorchTarget(target.module, **kw), TorchDraft(draft.module, **kw)
    # A construction that fails after the target bound (the draft's slack is too small
    # for k) leaves the modules free.
    slack, draft.module.kv_slack = draft.module.kv_slack, 4
    with pytest.raises(ValueError, match="kv_slack 4 must be >= k"):
        SpecDecoder(new_target, new_draft, k=3, m_rounds=1)
    draft.module.kv_slack = slack
    dec2 = _tiny_llama_decoder(TorchTarget(target.module, **kw), TorchDraft(draft.module, **kw), [[4, 4, 2]])
    got = dec2.run_burst(mode="pre_issued")[0].tolist()
    assert got == target.module.greedy([4, 4, 2], len(got))


@pytest.mark.parametrize("gapless", [False, True])
@pytest.mark.gpu
@requires_gpu
def test_outside_model_graph_on_gpu_50_bursts(gapless, rng):
    backend = Backend("cupy")
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 1, 9, 3)]
    target, draft = make_pair(4, 1024, backend, p_min=0.3)
    dec = SpecDecoder(target, draft, k=4, m_rounds=3)
    dec.prefill(prompts)
    graph = BurstGraph(dec, gapless=gapless)
    scratch = []

    def churn():  # torch allocations and frees between replays must not touch the graph's memory
        scratch.append(torch.randn(1 << 16, device="cuda"))
        if len(scratch) > 3:
            scratch.pop(0)

    got = run_bursts(dec, graph.run, 50, churn)
    for b, prompt in enumerate(prompts):
        assert got[b] == greedy_truth(prompt, len(got[b]))


@pytest.mark.gpu
@requires_gpu
def test_bursts_under_another_current_torch_stream(rng):
    # docs/models.md, "Streams": every burst runs on the decoder's stream whatever torch's
    # current stream is, and drain()/run() return with the tokens on the host.
    backend = Backend("cupy")
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 1, 9, 3)]
    other = torch.cuda.Stream()
    for engine in ("pre_issued", "per_round_sync", "graph", "gapless"):
        target, draft = make_pair(4, 1024, backend, p_min=0.3)
        dec = SpecDecoder(target, draft, k=4, m_rounds=3)
        with torch.cuda.stream(other):
            dec.prefill(prompts)
            if engine in ("graph", "gapless"):
                graph = BurstGraph(dec, gapless=engine == "gapless")
                got = run_bursts(dec, graph.run, 10)
            else:
                got = run_bursts(dec, lambda: dec.run_burst(mode=engine), 10)
        for b, prompt in enumerate(prompts):
            assert got[b] == greedy_truth(prompt, len(got[b])), f"{engine}, sequence {b}"


def test_graphburst_imports_without_torch():
    """``import graphburst`` (and the torch modules' import) never needs torch; using them says how to get it."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import graphburst\n"
            "assert 'graphburst.models.torch_adapter' not in sys.modules  # loaded on first use\n"
            "from graphburst.capture import BurstGraph\n"
            "assert graphburst.BurstGraph is BurstGraph\n"
            "import graphburst.models.torch_adapter, graphburst.models.checkpoint\n"
            "assert graphburst.TorchTarget is graphburst.models.torch_adapter.TorchTarget\n"
            "assert graphburst.TorchDraft is graphburst.models.torch_adapter.TorchDraft\n"
            "try:\n    graphburst.models.torch_adapter.TorchTarget(None, batch=1, capacity=1, backend='numpy')\n"
            "except ImportError as e:\n    print('ImportError:', e)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert "pip install 'graphburst[torch]'" in out.stdout


def test_batch_past_the_modules_own_is_refused():
    from graphburst.models.checkpoint import tiny_random_pair

    target, _ = tiny_random_pair(batch=2, capacity=32, backend="numpy")
    with pytest.raises(ValueError, match="batch 3 exceeds the module's own KV batch 2"):
        TorchTarget(target.module, batch=3, capacity=32, backend="numpy")
