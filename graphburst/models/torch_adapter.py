"""Turn a PyTorch module into a graphburst draft or target (the model protocol).

The module implements two things over torch tensors:

* ``kv_layers() -> list[Tensor | None]``: its preallocated KV storage, one entry per
  layer (None for a layer without KV). Storage is the module's own; graphburst only
  records its address.
* ``forward(tokens, start_pos, lengths, rows=None) -> logits``: ``tokens [R, T] int64``
  (valid ids), ``start_pos [R]`` the position of ``tokens[:, 0]``, ``lengths`` one
  ``[R] int32`` tensor (or None) per layer: the valid KV rows before the call. It writes
  the T tokens' KV at rows ``lengths + [0, T)`` of batch rows ``rows`` (``[R] int64``,
  None = all B), attends only below, returns ``[R, T, vocab]`` logits and **never moves
  a length** (the adapter advances them). ``graphburst.models.llama.Llama`` is one. A module
  with ``accepts_logits_at = True`` also takes ``logits_at [R] int64`` and returns only
  those positions' logits ``[R, 1, vocab]``; prefill then skips the rest of the head. One
  with ``accepts_head = True`` also takes ``head=False``: write the KV, return None (a
  prompt's non-final chunk, whose logits nobody reads). One with ``accepts_fresh = True``
  also takes ``fresh=True`` when every row starts at position 0 (a prefill called with
  ``start=None``), so it may attend to the call's own tokens only.

Chunked prefill (``chunked_prefill = True``): a chunk of a longer prompt runs with
``start_pos = lengths = start``, the rows its earlier chunks wrote, so the module attends
to them as it would inside one whole-prompt forward. Rows of a chunk shorter than the
longest are padded: their tokens past the chunk write KV rows past the new length (never
read, overwritten later), which may run past ``capacity`` plus slack; a module clamps
such writes into its own storage row (``Llama`` does, in ``kv_index``).

:class:`TorchTarget` and :class:`TorchDraft` do the rest: zero-copy torch views of the
``StreamBufs`` and of the KV lengths (made once, outside capture), the ``KVCache``,
placeholder clamping, argmax and confidence, the p-min break, the verify-token writes,
the draft's extra KV append and length bookkeeping. Bound to sampling StreamBufs
(``SpecDecoder(..., sampling=True)``), the target writes ``tgt_logits`` (and, at prefill,
the logits after the prompt to ``tgt_logits[:, 0]``), the draft writes ``draft_logits``
and appends its sampled last draft in ``draft_append_last``; greedy mode is unchanged.
On the cupy backend the ops run on the stream graphburst gives (a torch ``ExternalStream``
over it); on numpy they run on CPU tensors that alias the numpy buffers, which is how CI
tests this file.

Inside ``draft_step`` and ``verify`` nothing syncs or reads a value on the host; nor does
``prefill`` when the decoder hands it the slot list (``rows``).

What the two wrappers share (the torch views :func:`as_tensor` and :class:`TorchBufs`, the
cache and lengths, binding, streams and ``prefill``) lives in
:mod:`graphburst.models.torch_model` (moved there when this file reached 453 lines); this
file keeps the contract above, :class:`TorchTarget` and :class:`TorchDraft`, and those
names stay importable from here.
"""

from __future__ import annotations

from ..backend import Backend
from ..buffers import StreamBufs
from ..validate import check_prob
from .torch_model import _TorchModel


class TorchTarget(_TorchModel):
    """A torch module as a graphburst target.

    Parameters
    ----------
    module
        ``kv_layers()`` and ``forward(tokens, start_pos, lengths, rows)`` (module docstring).
    batch, capacity : int
        Slots, and KV entries per slot graphburst may fill (the storage needs slack rows past it).
    backend : Backend or str
        cupy: the module's tensors are on that CUDA device; numpy: on CPU.
    vocab : int, optional
        Defaults to ``module.vocab``.
    prefill_graphs : bool, optional
        Replay bucketed CUDA graphs for prefills at position 0
        (:mod:`~graphburst.models.prefill_graphs`). Default: on a GPU, when the module
        can (``accepts_fresh``, ``accepts_logits_at``, ``accepts_head``). True on numpy runs
        the same buckets eagerly.
    packed_prefill : bool, optional
        With prefill graphs: lay a fresh admission's prompts end to end in one call
        (:mod:`~graphburst.models.packed_prefill`) instead of padding each to the call's
        longest. Default: where the module ``accepts_packed`` and the flash kernel serves its
        dtype on its GPU (fp16/bf16, Ampere on), and on the CPU (``prefill_graphs_for``).
    """

    _prefill_head = True  # a fresh prefill's final chunk computes the logits after the prompt

    def verify(self, bufs: StreamBufs, stream) -> None:
        """Logits at ``pos_ctr + [0, k]`` for ``vtok``; greedy tokens into ``tgt_pred [B, k+1]``."""
        t = self._views(bufs)
        with self._on(stream), self.torch.no_grad():
            logits = self._forward(self._tokens(t.vtok), t.pos_ctr)  # [B, k+1, V]
            if bufs.sampling:
                t.tgt_logits.copy_(logits)  # float32; the burst turns them into probabilities
            else:
                t.tgt_pred.copy_(logits.argmax(-1))


class TorchDraft(_TorchModel):
    """A torch module as a graphburst draft (greedy proposals, softmax confidence).

    Parameters
    ----------
    module, batch, capacity, backend, vocab, prefill_graphs, packed_prefill
        As for :class:`TorchTarget`.
    p_min : float
        A proposal whose probability is below this breaks the chain (0: never).
    writes_verify_tokens : bool
        Also write usable proposals into ``vtok[:, 1 + step]`` so the burst skips its
        assemble launch.
    """

    _prefill_head = False  # a draft's prefill writes only the KV

    def __init__(self, module, *, batch: int, capacity: int, backend: Backend | str = "auto", vocab: int | None = None,
                 p_min: float = 0.0, writes_verify_tokens: bool = True, prefill_graphs: bool | None = None,
                 packed_prefill: bool | None = None):
        super().__init__(module, batch=batch, capacity=capacity, backend=backend, vocab=vocab,
                         prefill_graphs=prefill_graphs, packed_prefill=packed_prefill)
        self.p_min = check_prob("p_min", p_min)
        self.writes_verify_tokens = bool(writes_verify_tokens)

    def draft_step(self, bufs: StreamBufs, step: int, stream) -> None:
        """Propose ``draft_tok[:, step]`` from the previous token at ``pos_ctr + step``."""
        torch, t, k = self.torch, self._views(bufs), bufs.k
        with self._on(stream), torch.no_grad():
            prev = t.vtok[:, :1] if step == 0 else t.draft_tok[:, step - 1: step]  # [B, 1] int32
            logits = self._forward(self._tokens(prev), t.pos_ctr + step)[:, -1]  # [B, V]
            if bufs.sampling:
                # The decoder samples draft_tok[:, step] from these, before step + 1 reads it.
                t.draft_logits[:, step].copy_(logits)
                if self.p_min > 0.0:
                    self._break(t, step, torch.softmax(logits.float(), dim=-1).amax(dim=-1))
                return
            conf, tok = torch.softmax(logits, dim=-1).max(dim=-1)  # [B] float32, [B] int64
            t.draft_tok[:, step].copy_(tok)
            t.draft_conf[:, step].copy_(conf)
            if self.p_min > 0.0:
                self._break(t, step, conf)
            if self.writes_verify_tokens:
                usable = t.brk[:, 1] == 0
                t.vtok[:, 1 + step].copy_(torch.where(usable, tok.to(torch.int32), t.vtok[:, 1 + step]))
            if step == k - 1:
                # All k accepted keeps anchor + k + 1 entries: append the last proposal's KV too.
                self._forward(tok.unsqueeze(1), t.pos_ctr + k)

    def _break(self, t, step: int, conf) -> None:
        """First low-confidence step of a still-unbroken row: ``brk = [step, 1]`` (n_valid = step)."""
        torch = self.torch
        newly = (t.brk[:, 1] == 0) & (conf < self.p_min)
        t.brk[:, 0].copy_(torch.where(newly, step, t.brk[:, 0]))
        t.brk[:, 1].copy_(torch.where(newly, 1, t.brk[:, 1]))

    def draft_append_last(self, bufs: StreamBufs, stream) -> None:
        """Sampling mode: the sampled last draft's KV at ``pos_ctr + k`` (protocol rule 2)."""
        t, k = self._views(bufs), bufs.k
        with self._on(stream), self.torch.no_grad():
            self._forward(self._tokens(t.draft_tok[:, k - 1:k]), t.pos_ctr + k)
