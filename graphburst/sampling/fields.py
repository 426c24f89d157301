"""Per-request logits processing on the device, inside the burst: the "fields".

``logit_bias``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``min_p``,
``min_tokens`` and ``ignore_eos``, as vLLM applies them (``kernels/fields_ref.py`` has the exact
rules and order). A sampling decoder built with ``fields=True`` holds one :class:`SlotFields`
(``dec.fields``) and runs, per round::

    target.verify(bufs)                 tgt_logits [B, k+1, V]
    apply_fields(all rows)              tgt_logits processed in place; row j sees the generated
                                        tokens' counts plus the drafts vtok[:, 1..j]
    probs_from_logits(..., min_p=)      min-p with top-k/top-p, in the select
    accept_sample, ring_commit
    fields_commit                       counts += the round's committed drafts and new pending token
    rollback_stream

so every verify row is processed with exactly the history a one-token-at-a-time decoder would
have, and the accept compares the processed ``p`` with the draft's (unprocessed) ``q``:
speculation stays lossless. The first token gets the same processing at admission, with an
empty history. ``ignore_eos`` is the host's: the slot's stop token becomes ``NO_EOS`` (the
ring never stops on it, and ``min_tokens`` has nothing to mask), as in vLLM, where EOS is
then no stop token.

Admission, on the decoder's stream and in its order (no host sync, no allocation): a chunk
that starts a prompt zeroes its slot's ``counts`` and ``prompt_seen``; every chunk marks its
tokens in ``prompt_seen``; a final chunk uploads the slot's settings and, after the first
token is drawn, counts it.
"""

from __future__ import annotations

import functools

import numpy as np

from ..constants import MAX_LOGIT_BIAS, NO_EOS

#: name -> (shape as a function of (B, V), dtype, fill) of the device buffers.
LAYOUT = {
    "counts": (lambda b, v: (b, v), np.int32, 0),  # [B, V] generated tokens up to the pending one
    "prompt_seen": (lambda b, v: (b, v), np.uint8, 0),  # [B, V] 1 for the prompt's tokens
    "prompt_len": (lambda b, v: (b,), np.int32, 0),  # [B] the prompt's length P
    "stop": (lambda b, v: (b,), np.int32, NO_EOS),  # [B] the stop token min_tokens masks (NO_EOS: none)
    "min_tokens": (lambda b, v: (b,), np.int32, 0),  # [B]
    "presence": (lambda b, v: (b,), np.float32, 0.0),  # [B] presence_penalty
    "frequency": (lambda b, v: (b,), np.float32, 0.0),  # [B] frequency_penalty
    "repetition": (lambda b, v: (b,), np.float32, 1.0),  # [B] repetition_penalty
    "min_p": (lambda b, v: (b,), np.float32, 0.0),  # [B]
    "n_bias": (lambda b, v: (b,), np.int32, 0),  # [B] logit_bias entries in use
    "bias_ids": (lambda b, v: (b, MAX_LOGIT_BIAS), np.int32, 0),  # [B, MAX_LOGIT_BIAS]
    "bias_val": (lambda b, v: (b, MAX_LOGIT_BIAS), np.float32, 0.0),  # [B, MAX_LOGIT_BIAS]
}
#: The [B] settings uploaded whole at each final admission (the device never changes them).
SETTINGS = ("prompt_len", "stop", "min_tokens", "presence", "frequency", "repetition", "min_p", "n_bias")


class SlotFields:
    """The fields' device buffers (:data:`LAYOUT`, fixed addresses for the decoder's life) and the
    host mirrors of the per-slot settings.

    Parameters
    ----------
    batch, vocab : int
    backend
        Allocates the buffers (on the current stream: build it under the decoder's).
    """

    def __init__(self, batch: int, vocab: int, backend):
        self.batch, self.vocab = batch, vocab
        # The [B] settings are the rows of one block of 4-byte words, each viewed as its dtype, on the
        # device and in the host mirror alike: an admission uploads them in one copy.
        self.host_block = np.zeros((len(SETTINGS), batch), np.int32)  # [len(SETTINGS), B] 4-byte words
        self.host = {}
        for i, name in enumerate(SETTINGS):
            _, dtype, fill = LAYOUT[name]
            assert np.dtype(dtype).itemsize == 4, name
            self.host[name] = self.host_block[i].view(dtype)
            self.host[name][...] = fill
        self.settings_block = backend.to_device(self.host_block, backend.current_stream())  # [len(SETTINGS), B]
        for i, name in enumerate(SETTINGS):
            setattr(self, name, self.settings_block[i].view(LAYOUT[name][1]))  # [B]
        for name, (shape, dtype, fill) in LAYOUT.items():
            if name not in SETTINGS:
                setattr(self, name, backend.full(shape(batch, vocab), fill, dtype))

    @staticmethod
    def layout_nbytes(batch: int, vocab: int) -> int:
        """Device bytes of :data:`LAYOUT` for ``batch`` slots of ``vocab`` tokens."""
        return sum(int(np.prod(shape(batch, vocab))) * np.dtype(dtype).itemsize
                   for shape, dtype, _ in LAYOUT.values())

    def graph_buffers(self) -> dict:
        """name -> device buffer, for the address guard."""
        return {name: getattr(self, name) for name in LAYOUT}

    # ------------------------------------------------------------------ the round's calls

    def apply_call(self, ops, bufs, *, step=None):
        """``apply_fields`` of ``bufs.tgt_logits`` bound to these buffers (``pos`` = ``pos_start``)."""
        return functools.partial(ops.apply_fields, bufs.tgt_logits, bufs.vtok, bufs.pos_start, self.counts,
                                 self.prompt_seen, self.prompt_len, self.stop, self.min_tokens, self.presence,
                                 self.frequency, self.repetition, self.bias_ids, self.bias_val, self.n_bias, step=step)

    def commit_call(self, ops, bufs):
        """``fields_commit`` after ``ring_commit``."""
        return functools.partial(ops.fields_commit, bufs.vtok, bufs.n_acc, bufs.n_commit, bufs.budget, bufs.pend,
                                 self.counts)

    # ------------------------------------------------------------------ admission

    def admit_chunks(self, ops, staging, chunks, stream) -> None:
        """Reset the rows of slots whose staged chunk starts a prompt, then mark every staged
        chunk's tokens as prompt tokens (``chunks``: the staging's ``[B, P_max]`` view)."""
        ops.fields_reset(staging.lengths, staging.starts, self.counts, self.prompt_seen, stream=stream)
        ops.fields_prompt(staging.lengths, chunks, self.prompt_seen, stream=stream)

    def set(self, settings: dict, ends: dict, stops: dict) -> None:
        """Host mirrors of final chunks' slots: ``settings`` slot -> SamplingParams, ``ends`` slot ->
        the prompt's length, ``stops`` slot -> its stop token (``NO_EOS`` already for ignore_eos)."""
        h = self.host
        for b, p in settings.items():
            h["prompt_len"][b] = ends[b]
            h["stop"][b] = stops[b]
            h["min_tokens"][b] = p.min_tokens
            h["presence"][b] = p.presence_penalty
            h["frequency"][b] = p.frequency_penalty
            h["repetition"][b] = p.repetition_penalty
            h["min_p"][b] = p.min_p
            h["n_bias"][b] = len(p.logit_bias)

    def upload(self, backend, settings: dict, stream) -> None:
        """The [B] settings whole (one copy of their block), and the logit_bias rows of the slots in
        ``settings`` that have one: one copy per run of consecutive such slots (the rows of a run are
        contiguous)."""
        backend.upload(self.settings_block, self.host_block, stream)
        biased = sorted(b for b, p in settings.items() if p.logit_bias)
        i = 0
        while i < len(biased):
            j = i + 1
            while j < len(biased) and biased[j] == biased[j - 1] + 1:
                j += 1
            b0, b1 = biased[i], biased[j - 1] + 1
            ids = np.zeros((b1 - b0, MAX_LOGIT_BIAS), np.int32)
            val = np.zeros((b1 - b0, MAX_LOGIT_BIAS), np.float32)
            for r, b in enumerate(range(b0, b1)):
                pairs = settings[b].logit_bias
                ids[r, :len(pairs)] = [t for t, _ in pairs]
                val[r, :len(pairs)] = [v for _, v in pairs]
            backend.upload(self.bias_ids[b0:b1], ids, stream)
            backend.upload(self.bias_val[b0:b1], val, stream)
            i = j

    def first_token(self, ops, bufs, stream) -> None:
        """Process the prefill's first-token logits (``tgt_logits[:, 0]``; ``pos_start = P - 1``
        uploaded already, so nothing counts as generated; row 0 reads no drafts)."""
        self.apply_call(ops, bufs, step=0)(stream=stream)

    def count_first(self, ops, bufs, lengths, stream) -> None:
        """Count each prefilled slot's first token (``pend``, drawn already)."""
        ops.fields_first(lengths, bufs.pend, self.counts, stream=stream)
