"""Pipeline-parallel targets: a Llama split into stages, one per rank (docs/parallel.md).

Stage s of S owns layers ``[s*L/S, (s+1)*L/S)`` and their KV; stage 0 also runs the
embedding, the last stage the final norm and head. In verify, stage s receives the
hidden states ``[B, k+1, d]`` from s-1 (NCCL recv), runs its layers and sends them on;
the last stage computes ``tgt_pred [B, k+1] int32`` and sends it back to every other
stage. Every stage then runs the same replicated epilogue over its own StreamBufs, so
all stages hold identical bookkeeping, and each rolls back only its own layers through
a stage-local table (:func:`stage_table`, built on ``kv_len_ptr_table_range``).

The draft is replicated on every stage: it is small, it needs no transfer of its
proposals (every stage computes the same ``vtok``), and the later stages would
otherwise idle while stage 0 drafts.
"""

from __future__ import annotations

import torch
from torch import nn

from ..buffers import PtrTable, StreamBufs, kv_len_ptr_table, kv_len_ptr_table_range
from ..models.llama import Llama
from ..models.torch_adapter import TorchTarget
from ..models.torch_model import as_tensor
from .dist import Context, Layout, check_layout


def stage_layers(n_layers: int, stages: int, stage: int) -> range:
    """The dense range of layers that ``stage`` owns."""
    per = n_layers // stages
    return range(stage * per, (stage + 1) * per)


class StageLlama(nn.Module):
    """Stage ``ctx.rank``'s layers of ``full`` (plus embedding on the first, norm and head on the last).

    ``kv_layers()`` lists every layer of the whole model, None for layers another stage
    owns, so layer indices stay global and the rollback table can take a stage's range.
    """

    def __init__(self, full: Llama, ctx: Context, *, batch: int, capacity: int, dtype=None):
        super().__init__()
        cfg = full.cfg
        check_layout(cfg, Layout(pp=ctx.world))
        dtype = dtype or full.embed_tokens.weight.dtype
        self.ctx, self.cfg, self.vocab = ctx, cfg, cfg.vocab_size
        self.stage, self.stages = ctx.rank, ctx.world
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.own = stage_layers(cfg.num_hidden_layers, self.stages, self.stage)
        self.inner = Llama(cfg.replace(num_hidden_layers=len(self.own)), batch=batch, capacity=capacity, dtype=dtype,
                           device=ctx.device)
        self.batch, self.capacity, self.kv_slack = batch, capacity, self.inner.kv_slack
        src = dict(full.named_parameters())
        with torch.no_grad():
            for name, p in self.inner.named_parameters():
                if name.startswith("layers."):
                    _, i, rest = name.split(".", 2)
                    name = f"layers.{self.own.start + int(i)}.{rest}"
                p.copy_(src[name])

    def kv_layers(self):
        n = self.cfg.num_hidden_layers
        own = self.inner.kv_layers()
        return [own[i - self.own.start] if i in self.own else None for i in range(n)]

    def run_layers(self, x, start_pos, lengths, rows):
        """This stage's blocks over hidden states ``x [R, T, d]`` (lengths: the global list)."""
        inner = self.inner
        r, t = x.shape[:2]
        every = torch.arange(r, device=x.device) if rows is None else rows  # [R] int64
        own = [lengths[self.own.start + i] for i in range(len(inner.layers))]
        # Rotations, KV rows and masks once per forward for the whole stage, as Llama.forward does.
        for i, (layer, index) in enumerate(zip(inner.layers, inner.layer_inputs(start_pos, own, every, t, x.dtype))):
            x = layer(x, None, None, inner.kv[i], own[i], rows, index)  # rows None: the whole batch, no KV gather
        return x

    def head(self, x):
        """``[R, T, vocab] float32`` logits (the last stage)."""
        return nn.functional.linear(self.inner.norm(x), self.inner.head_weight()).float()

    def embed(self, tokens):
        return self.inner.embed_tokens(tokens)

    def send(self, x, dst: int) -> None:
        self.ctx.send(x, dst)

    def recv(self, out, src: int) -> None:
        self.ctx.recv(out, src)

    def pipeline(self, tokens, start_pos, lengths, rows, hidden_buf, logits_at=None):
        """Run this stage's part; returns ``[R, T', vocab]`` logits on the last stage, else None.

        ``hidden_buf [R, T, d]`` receives the previous stage's output (not on stage 0).
        """
        if self.first:
            x = self.embed(tokens)
        else:
            self.recv(hidden_buf, self.stage - 1)
            x = hidden_buf
        x = self.run_layers(x, start_pos, lengths, rows)
        if not self.last:
            self.send(x, self.stage + 1)
            return None
        if logits_at is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logits_at].unsqueeze(1)
        return self.head(x)

    def spread_from_last(self, pred) -> None:
        """The last stage's int tensor ``pred`` reaches every stage (in place)."""
        if self.last:
            for s in range(self.stages - 1):
                self.send(pred, s)
        else:
            self.recv(pred, self.stages - 1)


class StageTarget(TorchTarget):
    """A pipeline stage as a graphburst target (same protocol, collectives inside)."""

    chunked_prefill = False  # prefill below hands whole prompts down the pipeline

    def __init__(self, module: StageLlama, *, batch: int, capacity: int, backend):
        super().__init__(module, batch=batch, capacity=capacity, backend=backend)
        self._hidden = None  # [B, k+1, d] receive buffer, made in bind (outside capture)
        self._pred = None  # [B, k+1] int64 predictions as they cross the link

    def bind(self, bufs: StreamBufs) -> None:
        super().bind(bufs)
        m = self.module
        w = m.inner.embed_tokens.weight
        self._hidden = torch.zeros((bufs.batch, bufs.k + 1, m.cfg.hidden_size), dtype=w.dtype, device=w.device)
        self._pred = torch.zeros((bufs.batch, bufs.k + 1), dtype=torch.int64, device=w.device)
        self._settle()

    def graph_buffers(self) -> dict:
        out = super().graph_buffers()
        if self._hidden is not None:
            out.update({"pp.hidden": self._hidden, "pp.pred": self._pred})
        return out

    def verify(self, bufs: StreamBufs, stream) -> None:
        """Hidden states down the pipeline, ``tgt_pred`` back from the last stage."""
        t = self._views(bufs)
        m = self.module
        with self._on(stream), torch.no_grad():
            logits = m.pipeline(self._tokens(t.vtok), t.pos_ctr, self._lengths, None, self._hidden)
            for length in self._lengths:
                if length is not None:
                    length.add_(t.vtok.shape[1])
            if m.last:
                self._pred.copy_(logits.argmax(-1))
            m.spread_from_last(self._pred)
            t.tgt_pred.copy_(self._pred)

    def prefill(self, prompt, prompt_len, pos_ctr, pend, stream, *, start=None, rows=None) -> None:
        """Eager: every stage picks the same rows from the same prompts, so shapes agree.

        Whole prompts only (``chunked_prefill`` is False): a chunk's head-less pass and
        the stages' hand-offs are not written for it.
        """
        if start is not None:
            raise ValueError("a pipeline stage prefills whole prompts only (chunked_prefill = False): got start")
        m = self.module
        with self._on(stream), torch.no_grad():
            tok_all, plen_all = as_tensor(prompt), as_tensor(prompt_len)
            rows = self._prefill_rows(plen_all, rows)  # [R] int64
            if rows is None:
                return
            plen = plen_all[rows]
            start = torch.zeros_like(plen)
            lengths = [None if ln is None else start for ln in self._lengths]
            tokens = self._tokens(tok_all[rows])
            w = m.inner.embed_tokens.weight
            hidden = torch.empty((*tokens.shape, m.cfg.hidden_size), dtype=w.dtype, device=w.device)
            last = (plen.long() - 1).clamp(min=0)
            logits = m.pipeline(tokens, start, lengths, rows, hidden, logits_at=last)
            pred = logits[:, 0].argmax(-1) if m.last else torch.empty(rows.numel(), dtype=torch.int64,
                                                                       device=w.device)
            m.spread_from_last(pred)
            for ln in self._lengths:
                if ln is not None:
                    ln[rows] = plen
            as_tensor(pos_ctr)[rows] = plen
            as_tensor(pend)[rows] = pred.to(torch.int32)


def stage_table(target, draft, pos_ctr, stream) -> PtrTable:
    """The stage's rollback table: its own target layers, every draft layer, then ``pos_ctr``.

    Built from two ``kv_len_ptr_table_range`` tables so the stage never names a length
    another stage owns (those layers are absent here, so they would be 0 entries anyway;
    the range keeps the table dense and the rollback launch small). ``stream``: the decoder's,
    which the rollback reads the table on.
    """
    own = kv_len_ptr_table_range(target.cache, target.module.own, stream=stream)
    rest = kv_len_ptr_table(draft.cache, pos_ctr=pos_ctr, stream=stream)
    return PtrTable(own.targets + rest.targets, target.cache.backend, stream=stream)
