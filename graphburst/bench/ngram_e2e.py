"""Prompt lookup end to end: acceptance and tokens/s against two baselines on the same weights.

Engines (all greedy, one target, every forward over the same tensors):

* ``graphburst-ngram``: ``SpecDecoder(TorchTarget, NgramDraft)`` in one ``BurstGraph``:
  M rounds of search + verify per replay, one host sync per burst.
* ``graphburst-ngram-sync``: the same decoder run eagerly with a host sync after every round
  (``BurstMode.PER_ROUND_SYNC``), as engines that read the accepted count each round do: what
  one graph per burst buys on the same lookup.
* ``graphburst-plain``: the same decoder with no draft (``k = 0``): one token a round, M rounds
  a replay, as ``graphburst serve --model`` decodes a checkpoint given no draft.
* ``plain``: the same target's plain greedy decoding, one token per forward; on the GPU
  ``steps`` forwards and their argmax are captured into one torch CUDA graph (one host
  sync per graph), so the baseline is as free of the host as a burst is.
* ``hf-lookup``: transformers ``generate(prompt_lookup_num_tokens=k,
  max_matching_ngram_size=n_max)`` over the same tensors (batch 1 only), and
  ``hf-plain`` (its plain ``generate``) for scale.

Workloads of a trained model with a tokenizer (``--model smollm2-135m``): the text classes of
:mod:`.text_prompts` (editing code or prose, quoting a document, continuing a list; open
questions as the control), each a chat request through the model's own template.

Workloads of token ids, built so that outputs may repeat inputs; whether a random-weight model
copies is measured, not assumed (they are close to bigram models):

* ``random``: uniform random prompts (the control: only the model's own loops repeat);
* ``repeat``: a random segment repeated four times (does the model continue the pattern?);
* ``echo``: a seed s, the target's own greedy continuation g of s, then s again: a
  near-bigram model that saw s -> g tends to produce g again (an edit-style workload
  built from the model itself, not planted in its weights).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..engine.decoder import SpecDecoder
from ..engine.mode import BurstMode
from ..capture import BurstGraph
from ..models.ngram import NgramDraft
from ..models.torch_adapter import TorchTarget
from .real_engines import sync
from .real_models import hf_twin, instance
from .text_prompts import CLASSES, text_workload

WORKLOADS = ("random", "repeat", "echo")  # token-id workloads; a model with a tokenizer adds TEXT_WORKLOADS
TEXT_WORKLOADS = tuple(CLASSES)


class PlainLoop:
    """Plain greedy decoding of ``src`` for ``batch`` equal-length prompts, ``steps`` tokens a call."""

    def __init__(self, src, *, batch: int, steps: int):
        self.model = instance(src, batch=batch)
        self.device = self.model.kv[0].device
        self.batch, self.steps = batch, steps
        dev = self.device
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)  # [B, 1] the last token
        self.length = torch.zeros(batch, dtype=torch.int32, device=dev)  # [B] position = every layer's length
        self.lengths = [self.length for _ in self.model.layers]
        self.out = torch.zeros(batch, steps, dtype=torch.long, device=dev)  # [B, steps]
        self.graph = None
        if dev.type == "cuda":
            self.prefill([[0]] * batch)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                self._steps()  # warm-up outside the capture (cuBLAS handles, workspaces)
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._steps()

    @torch.no_grad()
    def _steps(self) -> None:
        for i in range(self.steps):
            logits = self.model(self.tok, self.length, self.lengths, None)  # [B, 1, V]
            self.tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
            self.out[:, i] = self.tok[:, 0]
            self.length.add_(1)

    @torch.no_grad()
    def prefill(self, prompts: list) -> None:
        """Every prompt's KV and first token: one forward per distinct prompt length (its rows
        together), so a batch of text prompts, which repeats a class's few prompts, costs a few
        batched forwards, as a serving engine's prefill would, not one forward per row."""
        by_len: dict = {}
        for b, prompt in enumerate(prompts):
            by_len.setdefault(len(prompt), []).append(b)
        for length, rows in by_len.items():
            ids = torch.tensor([prompts[b] for b in rows], dtype=torch.long, device=self.device)  # [R, P]
            zero = torch.zeros(len(rows), dtype=torch.int32, device=self.device)  # [R]
            idx = torch.tensor(rows, dtype=torch.long, device=self.device)  # [R]
            logits = self.model(ids, zero, [zero] * len(self.model.layers), idx)
            self.tok[idx] = logits[:, -1].argmax(-1, keepdim=True)
            self.length[idx] = length

    def generate(self, prompts: list, n: int) -> tuple[list, dict]:
        """``n`` greedy tokens per prompt (the token after the prompt first, as a burst commits)."""
        self.prefill(prompts)
        out = [[int(t)] for t in self.tok[:, 0].tolist()]
        while len(out[0]) < n:
            self.graph.replay() if self.graph is not None else self._steps()
            for b, row in enumerate(self.out.tolist()):
                out[b] += row
        return [o[:n] for o in out], dict(forwards=1 + -(-(n - 1) // self.steps) * self.steps)


class NgramBurst:
    """graphburst with the prompt-lookup draft over ``src``: one graph per burst, or ``mode`` an eager
    mode (``PER_ROUND_SYNC``: a host sync after every round); ``k = 0``: no draft, plain decoding."""

    def __init__(self, src, *, batch: int, k: int, m: int, n_min: int, n_max: int, backend,
                 mode: BurstMode = BurstMode.GRAPH):
        cap = src.capacity
        target = TorchTarget(instance(src, batch=batch), batch=batch, capacity=cap, backend=backend)
        self.draft = NgramDraft(batch, src.vocab, cap, n_min=n_min, n_max=n_max, backend=backend) if k else None
        self.dec = SpecDecoder(target, self.draft, k=k, m_rounds=m)
        self.device = next(src.parameters()).device
        self.mode = mode
        self.dec.prefill([[0]] * batch)  # a live state to capture over
        self.run = BurstGraph(self.dec).run if mode is BurstMode.GRAPH else lambda: self.dec.run_burst(mode=mode)

    def generate(self, prompts: list, n: int) -> tuple[list, dict]:
        self.dec.prefill([list(p) for p in prompts], max_new_tokens=n)
        out = [[] for _ in prompts]
        bursts, syncs = self.dec.bursts, self.dec.host_syncs
        while self.dec.host_left.any():
            for b, t in enumerate(self.run()):
                out[b] += t.tolist()
        acc = self.dec.accept_counters()
        # rounds the GPU ran per host sync: M per drained burst in a graph, M / (M + 1) synced each round
        run = (self.dec.bursts - bursts) * self.dec.m_rounds
        return out, dict(accepted=int(acc[:, 0].sum()), rounds=int(acc[:, 1].sum()),
                         rounds_per_sync=run / max(1, self.dec.host_syncs - syncs))


class HFGenerate:
    """transformers ``generate`` over ``src``'s tensors, batch 1; ``lookup`` k > 0 for prompt lookup."""

    def __init__(self, src, *, lookup: int, n_max: int):
        self.hf = hf_twin(src)
        self.lookup, self.n_max = lookup, n_max
        self.device = next(src.parameters()).device
        self.calls = 0
        self.hf.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1

    @torch.no_grad()
    def generate(self, prompts: list, n: int) -> tuple[list, dict]:
        if len(prompts) != 1:
            raise ValueError(f"transformers prompt lookup runs batch 1 only, got {len(prompts)} prompts")
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        kw = dict(prompt_lookup_num_tokens=self.lookup, max_matching_ngram_size=self.n_max) if self.lookup else {}
        before = self.calls
        out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                               min_new_tokens=n, **kw)
        return [out[0, ids.shape[1]:].tolist()], dict(forwards=self.calls - before)


def workload(name: str, src, *, batch: int, prompt_len: int, seed: int, tokenizer=None) -> list:
    """``batch`` prompts (see the module docstring): ``prompt_len`` tokens each, or a text class's
    rendered prompts (``tokenizer`` needed)."""
    if name in TEXT_WORKLOADS:
        if tokenizer is None:
            raise ValueError(f"workload {name!r} is text: it needs a model with a tokenizer")
        return text_workload(tokenizer, name, batch)
    rng = np.random.default_rng(seed)
    vocab = src.vocab
    if name == "random":
        return rng.integers(0, vocab, (batch, prompt_len)).tolist()
    if name == "repeat":
        seg = rng.integers(0, vocab, (batch, -(-prompt_len // 4)))
        return np.tile(seg, 4)[:, :prompt_len].tolist()
    if name == "echo":
        s = max(1, prompt_len // 4)
        seed_toks = rng.integers(0, vocab, (batch, s)).tolist()
        g_len = prompt_len - 2 * s
        gen = PlainLoop(src, batch=batch, steps=max(1, g_len)).generate(seed_toks, g_len)[0] if g_len > 0 else \
            [[] for _ in range(batch)]
        return [(seed_toks[b] + gen[b] + seed_toks[b])[:prompt_len] for b in range(batch)]
    raise ValueError(f"workload must be one of {WORKLOADS + TEXT_WORKLOADS}, got {name!r}")


def timed(engine, prompts: list, n: int) -> tuple[list, dict, float]:
    """(tokens, counters, seconds) of one generation; syncs before and after the clock."""
    dev = engine.device
    if dev is not None:
        sync(dev)
    t0 = time.perf_counter()
    tokens, info = engine.generate(prompts, n)
    if dev is not None:
        sync(dev)
    return tokens, info, time.perf_counter() - t0
