"""The engines ``graphburst bench real`` compares, all greedy, all over one set of weights.

Every engine has ``prefill(prompts)`` (reset its state to the prompts) and
``run(rounds, tokens)`` -> :class:`Run`. The three torch loops and graphburst call the
same :class:`~graphburst.models.llama.Llama` forward with the same shapes, so their kernels
are the same and their tokens must be identical; they differ only in bookkeeping and in
how often the host waits:

* :class:`TorchLoop` ``graphs=False`` (**eager**, gpt-fast style without compile): draft
  k steps, verify, accept on the device, one ``.tolist()`` per round.
* :class:`TorchLoop` ``graphs=True`` (**vllm-style**): the same round, each forward a
  captured CUDA graph (one per draft step, one verify), accept in eager torch ops, one
  sync per round. Its graphs also give the floor: the round's forwards alone.
* :class:`Burst` (**graphburst**): ``SpecDecoder`` + ``BurstGraph``, one sync per burst.
* :class:`HFAssisted`: transformers ``generate(assistant_model=...)``, batch 1.
* ``TorchLoop`` with ``compile_forward=True`` (**gpt-fast anchor**): the vllm-style loop
  with every forward through ``torch.compile`` (inductor, over the SDPA forward, as
  gpt-fast compiles its model) and captured in our own CUDA graphs (optional; its
  kernels differ). On CUDA ``graphburst bench real`` first builds it in a child process
  (:mod:`graphburst.bench.compile_probe`), so a compiler crash costs only the engine.

A draft step proposes ``softmax(logits).max()``'s token, as graphburst's ``TorchDraft``
does (not ``argmax``, whose tie-breaking could differ), and after the k-th proposal one
more draft forward appends its KV, so a round is k + 1 draft forwards and one verify.
On the CPU "graphs" are plain calls: the same bookkeeping runs, only uncaptured.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..engine.decoder import SpecDecoder
from ..capture import BurstGraph
from ..models.llama import Llama
from ..models.torch_adapter import TorchDraft, TorchTarget
from .graph_timing import Timer
from .real_models import draft_instance, hf_draft_twin, hf_twin, instance, set_assistant


@dataclasses.dataclass
class Run:
    """What one engine did in one run."""

    tokens: list  # [B] lists of committed tokens (pending token first, as graphburst commits them)
    rounds: int  # rounds per sequence
    accepted: int  # accepted drafts, whole batch
    syncs: int | None  # host syncs (None: not counted)


def accepted_drafts(tokens: list, rounds: int) -> int:
    """Accepted drafts of a run with no token budget: every round commits 1 + its accepted drafts."""
    return sum(len(t) for t in tokens) - rounds * len(tokens)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class TorchLoop:
    """Speculative rounds in torch ops over graphburst's Llama, one host sync per round.

    Parameters
    ----------
    src : Llama
        The target whose tensors this engine shares (it gets its own KV caches).
    draft_layers : int or Llama
        The target's first ``draft_layers`` blocks, or a draft of its own (``real_models.draft_instance``).
    batch, k : int
    graphs : bool
        Capture each forward (draft step j, verify) as a CUDA graph (vllm-style).
    compile_forward : bool
        Run forwards through ``torch.compile`` (default mode: inductor kernels, no
        cudagraph trees) and, on CUDA, capture them as the vllm-style graphs. Every
        compile happens in the warm-up before capture, with one fixed-address input per
        forward shape (draft steps copy their token in), so dynamo sees two shapes per
        module and nothing recompiles at replay (a recompile during the capture raises,
        so the bench reports the engine ``not run`` instead of capturing a half-compiled forward).
    compile_backend : str
        ``torch.compile``'s backend (default inductor). Dynamo's guards, hence its
        recompiles, do not depend on it: the CPU test counts them under ``"eager"``.
    """

    same_kernels = True

    def __init__(self, src, *, draft_layers: int | Llama, batch: int, k: int, graphs: bool = False,
                 compile_forward: bool = False, compile_backend: str = "inductor"):
        self.k, self.batch = k, batch
        self.target, self.draft = instance(src, batch=batch), draft_instance(src, draft_layers, batch=batch)
        self.device = self.target.kv[0].device
        self.cuda = self.device.type == "cuda"
        dev = self.device
        # Both caches' lengths equal the pending token's position at a round's start, so one
        # [B] int32 tensor is every layer's length and the start position (one op rolls back).
        self.pos = torch.zeros(batch, dtype=torch.int32, device=dev)  # [B] int32
        self.vtok = torch.zeros(batch, k + 1, dtype=torch.int64, device=dev)  # [B, k+1]: pending, k proposals
        self.tgt = torch.zeros(batch, k + 1, dtype=torch.int64, device=dev)  # [B, k+1] target greedy tokens
        self.tok1 = torch.zeros(batch, 1, dtype=torch.int64, device=dev)  # [B, 1] a draft step's input
        self.pos1 = torch.zeros(batch, dtype=torch.int32, device=dev)  # [B] int32 a compiled draft step's position
        self._fwd_t, self._fwd_d = self.target, self.draft
        self.compiled = compile_forward
        if compile_forward:
            self.same_kernels = False  # inductor fuses: other kernels, other bf16 rounding
            # gpt-fast compiles its SDPA forward; dynamo need not trace the Triton decode kernels.
            self.target.decode_ops = self.draft.decode_ops = None
            # The default mode: "reduce-overhead" adds cudagraph trees, which crashed (rc 139)
            # beside the other engines' graphs; the forwards are captured below instead.
            # Dynamo's cache of Llama.forward is shared by every module and keeps the entries of
            # engines built before this one, freed or not; they count toward its recompile limit
            # (8), past which it runs the forward uncompiled: start this engine from a clean cache.
            torch._dynamo.reset()
            self._fwd_t = torch.compile(self.target, dynamic=False, backend=compile_backend)
            self._fwd_d = torch.compile(self.draft, dynamic=False, backend=compile_backend)
        self.steps = [lambda j=j: self._draft_step(j) for j in range(k + 1)] + [self._verify]
        self.graphed = (graphs or compile_forward) and self.cuda
        if self.graphed:
            self._capture()
        elif self.compiled:
            self._warm_up()  # the CPU: every compile now, under the same rules

    # ---------------------------------------------------------------- one round's pieces

    @torch.no_grad()
    def _draft_step(self, j: int) -> None:
        """Forward ``vtok[:, j]`` at ``pos + j``; for j < k propose ``vtok[:, j + 1]``."""
        p = self.pos + j  # [B] int32: position and draft length
        tok = self.vtok[:, j: j + 1]  # [B, 1]
        if self.compiled:  # one input tensor for every step: dynamo compiles the draft once
            tok = self.tok1.copy_(tok)
            # The same position tensor too: Llama keys its per-forward mask on id(length), so
            # dynamo guards on the tensor's identity, and a fresh ``pos + j`` per step made every
            # step a recompile (its old tensor freed) until the recompile limit (8) was hit.
            p = self.pos1.copy_(p)
        logits = self._fwd_d(tok, p, [p] * len(self.draft.layers), None)[:, -1]  # [B, V]
        if j < self.k:
            self.vtok[:, j + 1].copy_(torch.softmax(logits, dim=-1).max(dim=-1).indices)

    @torch.no_grad()
    def _verify(self) -> None:
        logits = self._fwd_t(self.vtok, self.pos, [self.pos] * len(self.target.layers), None)  # [B, k+1, V]
        self.tgt.copy_(logits.argmax(-1))

    @torch.no_grad()
    def _accept(self) -> torch.Tensor:
        """Greedy accept on the device; returns ``[B, k + 2]``: vtok, then n accepted (read by the host)."""
        k = self.k
        n = (self.vtok[:, 1:] == self.tgt[:, :k]).int().cumprod(dim=1).sum(dim=1)  # [B] int64
        record = torch.cat((self.vtok, n.unsqueeze(1)), dim=1)  # [B, k+2]; commits vtok[b, :n+1]
        self.vtok[:, 0].copy_(self.tgt.gather(1, n.unsqueeze(1)).squeeze(1))  # the bonus is the next pending
        self.pos.add_((n + 1).int())
        return record

    def _warm_up(self) -> None:
        """Run every step twice (library handles, kernel selection, every compile; clobbers state).

        A compiled engine that hits dynamo's recompile limit raises here instead of running
        its forwards uncompiled under the compile engine's name."""
        limit = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True) if self.compiled \
            else contextlib.nullcontext()
        with limit:
            for _ in range(2):
                for step in self.steps:
                    step()

    def _capture(self) -> None:
        # Warm up on a side stream, then capture each forward; the graphs share one pool and
        # replay in capture order.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._warm_up()
        torch.cuda.current_stream(self.device).wait_stream(side)
        sync(self.device)
        pool = torch.cuda.graph_pool_handle()
        self.graphs = []
        # Compiling belongs to the warm-up above; a recompile inside a capture would trace into
        # the graph (or crash it), so it raises instead (the bench reports the engine not run).
        stance = torch.compiler.set_stance("fail_on_recompile") if self.compiled else contextlib.nullcontext()
        with stance:
            for step in self.steps:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    step()
                self.graphs.append(g)
        sync(self.device)

    def _forwards(self) -> None:
        """The round's k + 1 draft forwards and the verify, without bookkeeping."""
        if self.graphed:
            for g in self.graphs:
                g.replay()
        else:
            for step in self.steps:
                step()

    # ---------------------------------------------------------------- the engine face

    @torch.no_grad()
    def prefill(self, prompts: list) -> None:
        """Write the prompts' KV into both caches; pending = the target's greedy next token."""
        tok = torch.tensor(prompts, dtype=torch.int64, device=self.device)  # [B, P]
        b, p = tok.shape
        zero = torch.zeros(b, dtype=torch.int32, device=self.device)
        last = torch.full((b,), p - 1, dtype=torch.int64, device=self.device)
        # rows None: every slot in order, so attention reads the caches without a gather
        logits = self.target(tok, zero, [zero] * len(self.target.layers), None, logits_at=last)[:, 0]
        self.draft(tok, zero, [zero] * len(self.draft.layers), None, logits_at=last)
        self.vtok[:, 0].copy_(logits.argmax(-1))
        self.pos.fill_(p)

    def run(self, rounds: int, tokens=None) -> Run:
        out = [[] for _ in range(self.batch)]
        for _ in range(rounds):
            self._forwards()
            for b, row in enumerate(self._accept().tolist()):  # the round's one host sync
                out[b] += row[: row[-1] + 1]
        return Run(out, rounds, accepted_drafts(out, rounds), rounds)

    def floor_us(self, n: int) -> float:
        """Device time of the round's forwards alone, replayed back to back (clobbers state: prefill after)."""
        return Timer(self.device).measure(self._forwards, n)

    def verify_us(self, n: int) -> float:
        """Device time of one verify forward (its graph on a GPU)."""
        return Timer(self.device).measure(self.graphs[-1].replay if self.graphed else self._verify, n)


class Burst:
    """graphburst: ``SpecDecoder`` over ``TorchTarget``/``TorchDraft``, one ``BurstGraph``.

    Parameters
    ----------
    src : Llama
    draft_layers : int or Llama
        As in :class:`TorchLoop`.
    batch, k, m : int
    backend : Backend
        cupy with CUDA tensors, numpy with CPU tensors (a recorded program stands in for the graph).
    gapless : bool
        Enqueue burst n + 1 before draining burst n.
    """

    same_kernels = True

    def __init__(self, src, *, draft_layers: int | Llama, batch: int, k: int, m: int, backend, gapless: bool = False,
                 warm_prompt=None):
        tgt, dft = instance(src, batch=batch), draft_instance(src, draft_layers, batch=batch)
        cap = src.capacity
        self.dec = SpecDecoder(TorchTarget(tgt, batch=batch, capacity=cap, backend=backend),
                               TorchDraft(dft, batch=batch, capacity=cap, backend=backend), k=k, m_rounds=m)
        self.m, self.batch, self.gapless = m, batch, gapless
        self.dec.prefill([warm_prompt or [0]] * batch)  # a live state to capture over
        self.graph = BurstGraph(self.dec, gapless=gapless)

    def prefill(self, prompts: list) -> None:
        self.dec.prefill([list(p) for p in prompts])

    def run(self, rounds: int, tokens=None) -> Run:
        if rounds % self.m:
            raise ValueError(f"rounds {rounds} must be a multiple of M = {self.m}")
        bursts = rounds // self.m
        out = [[] for _ in range(self.batch)]

        def take(burst):
            for b, t in enumerate(burst):
                out[b] += t.tolist()

        g = self.graph
        if self.gapless:
            g.replay()
            for _ in range(bursts - 1):
                g.replay()
                take(g.drain())
            take(g.drain())
        else:
            for _ in range(bursts):
                take(g.run())
        return Run(out, rounds, accepted_drafts(out, rounds), bursts)


    def graph_us_per_round(self, prompts: list, rounds: int) -> float | None:
        """Median device time of one burst graph / M (CUDA events around each replay; None on the CPU).

        Set against the floor, this separates the bookkeeping inside the graph from the
        host's drain-and-relaunch gap between bursts.
        """
        backend = self.dec.backend
        if not backend.is_gpu:
            return None
        self.prefill(prompts)
        times = []
        with backend.device():
            for _ in range(rounds // self.m):
                events = (backend.xp.cuda.Event(), backend.xp.cuda.Event())
                self.graph.replay(timing_events=events)
                self.graph.drain()
                times.append(backend.xp.cuda.get_elapsed_time(*events) * 1e3)
        return sorted(times)[len(times) // 2] / self.m


class HFAssisted:
    """transformers assisted generation over the same tensors (batch 1 only).

    Rounds are counted as target forward calls (HF's first call verifies the prompt and
    the first drafts together, so there is no separate prefill call).
    """

    same_kernels = False

    def __init__(self, src, *, draft_layers: int | Llama, k: int):
        self.target, self.draft = hf_twin(src), hf_draft_twin(src, draft_layers)
        set_assistant(self.draft, k)
        self.k = k
        self.device = next(src.parameters()).device
        self.calls = 0
        self.target.register_forward_pre_hook(self._count)
        self.prompt = None

    def _count(self, module, args):
        self.calls += 1

    def prefill(self, prompts: list) -> None:
        if len(prompts) != 1:
            raise ValueError(f"HF assisted generation runs batch 1 only, got {len(prompts)} prompts")
        self.prompt = torch.tensor(prompts, dtype=torch.int64, device=self.device)  # [1, P]

    @torch.no_grad()
    def generate(self, n: int) -> list:
        out = self.target.generate(self.prompt, attention_mask=torch.ones_like(self.prompt),
                                   assistant_model=self.draft, do_sample=False, max_new_tokens=n)
        return out[0, self.prompt.shape[1]:].tolist()

    def run(self, rounds: int, tokens=None) -> Run:
        """Generate ``tokens`` new tokens (what graphburst committed for sequence 0 in ``rounds``)."""
        before = self.calls
        new = self.generate(tokens)
        calls = self.calls - before
        # graphburst's tokens start with the pending token (the target's greedy token
        # after the prompt), HF's too: both are the greedy continuation.
        return Run([new], calls, max(0, len(new) - calls), None)

    @torch.no_grad()
    def logits_after(self, prefix: list) -> torch.Tensor:
        """``[V] float32`` HF logits after ``prompt + prefix`` (for the near-tie rule)."""
        ids = torch.cat((self.prompt, torch.tensor([prefix], dtype=torch.int64, device=self.device)), dim=1)
        return self.target(ids).logits[0, -1].float()
