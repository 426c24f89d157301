"""Sampling mode of a :class:`~graphburst.engine.decoder.SpecDecoder`: its round calls, per-slot
settings and first tokens.

A decoder built with ``sampling=True`` allocates the buffers of
``StreamBufs.SAMPLING_LAYOUT`` and runs this round program (no fused epilogue: that one
is greedy only)::

    seed_gather                                   vtok[:, 0] = pend, pos_start = pos_ctr, brk = [k, 0]
    for j in 0 .. k-1:
        draft.draft_step(bufs, j)                 draft_logits[:, j]  (and its input's KV)
        draft_probs_sample(step=j)                draft_logits[:, j] <- q in place; draft_tok[:, j] ~ q,
                                                  draft_conf[:, j] = q(token)
    draft.draft_append_last(bufs)                 KV of the sampled last draft (protocol rule 2)
    assemble_verify                               vtok = [pend, drafts before the break, -1 ...]
    target.verify(bufs)                           tgt_logits [B, k+1, V]
    probs_from_logits(all rows)                   tgt_logits <- p, in place
    accept_sample                                 n_acc, last_pred (Leviathan / Chen rule)
    ring_commit, rollback_stream

Randomness is Philox keyed by (``seed[b]``, absolute position of the token decided, draw
index): a sequence's tokens depend on nothing the host holds, nor on its batch slot. A
slot at temperature 0 (or top_k = 1) gets one-hot distributions, so it decodes exactly
the greedy tokens. The functions here return ``(name, fn)`` pairs that :mod:`graphburst.engine.program` wraps
as its ``Call`` objects.
"""

from __future__ import annotations

import functools

import numpy as np

from ..buffers import StreamBufs
from ..constants import GREEDY_TEMPERATURE, NO_PREFILL, SEED_LIMIT, TOP_K_OFF, TOP_P_OFF
from .params import SamplingParams, check_sampling

GREEDY = SamplingParams()


def draft_sample_calls(ops, bufs: StreamBufs, j: int) -> list:
    """Draft step j's distribution and its sample (after ``draft_step(j)``), fused: the
    proposal's race runs inside the probability kernels (``bufs`` is also their scratch)."""
    return [
        (f"draft_probs_sample[{j}]", functools.partial(ops.draft_probs_sample, bufs.draft_logits, bufs.temperature,
                                                       bufs.top_k, bufs.top_p, bufs.seed, bufs.pos_start,
                                                       bufs.draft_logits, bufs.draft_tok, bufs.draft_conf, bufs,
                                                       step=j)),
    ]


def verify_sample_calls(ops, bufs: StreamBufs, fields=None) -> list:
    """The target's distributions and the lossless accept (after ``verify``); with ``fields`` (a
    :class:`~graphburst.sampling.fields.SlotFields`) the logits are processed first and min-p
    joins the filters."""
    head = [] if fields is None else [("apply_fields", fields.apply_call(ops, bufs))]
    return head + [
        ("target_probs", functools.partial(ops.probs_from_logits, bufs.tgt_logits, bufs.temperature, bufs.top_k,
                                           bufs.top_p, bufs.tgt_logits, bufs,
                                           min_p=None if fields is None else fields.min_p)),
        ("accept_sample", functools.partial(ops.accept_sample, bufs.vtok, bufs.tgt_logits, bufs.draft_logits,
                                            bufs.brk, bufs.seed, bufs.pos_start, bufs.n_acc, bufs.last_pred, bufs)),
    ]


def check_slot(temperature=None, top_k=None, top_p=None, seed=None, *, sampling: bool,
               index: int | None = None, fields: dict | None = None, with_fields: bool = False,
               vocab: int | None = None) -> SamplingParams:
    """One slot's settings (None: the greedy defaults), validated; ``index`` names the slot.

    ``fields``: the logits processing fields (``params.check_fields``' names), or None; any
    field that is not at its default needs ``with_fields`` (a decoder built with ``fields=True``).
    ``vocab`` bounds ``logit_bias``'s ids.

    Raises
    ------
    TypeError, ValueError
        Naming the field and its value; also for ``temperature > 0`` on a greedy decoder.
    """
    at = "" if index is None else f"[{index}]"
    kw = {name: value for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                                          ("seed", seed)) if value is not None}
    if fields is not None and not isinstance(fields, dict):
        raise TypeError(f"fields{at} must be a dict of logits processing fields or None, got {type(fields).__name__}")
    try:
        params = check_sampling(**kw, **(fields or {}), vocab=vocab)
    except (TypeError, ValueError) as exc:
        if not at:
            raise
        raise type(exc)(f"{exc} (slot {index})") from None
    if params.temperature > 0 and not sampling:
        raise ValueError(f"temperature{at} = {params.temperature} needs sampling: build the decoder with "
                         f"sampling=True (temperature 0 is greedy decoding)")
    check_fields_enabled(params, with_fields, at)
    return params


def check_fields_enabled(params: SamplingParams, with_fields: bool, at: str = "") -> None:
    """ValueError naming the first logits processing field set on a decoder (or loop) without fields."""
    used = params.fields
    if used and not with_fields:
        name = next(iter(used))
        raise ValueError(f"{name}{at} = {used[name]!r} needs logits processing on the device: build the decoder "
                         f"with SpecDecoder(..., sampling=True, fields=True)")


class SlotSampling:
    """Host mirrors of the per-slot settings; admission uploads all four (plain writes: the
    device never changes them, so a whole-array upload behind bursts in flight loses nothing).

    Parameters
    ----------
    batch : int
    """

    def __init__(self, batch: int):
        self.temperature = np.full(batch, GREEDY_TEMPERATURE, np.float32)  # [B]
        self.top_k = np.full(batch, TOP_K_OFF, np.int32)  # [B]
        self.top_p = np.full(batch, TOP_P_OFF, np.float32)  # [B]
        self.seed = np.zeros(batch, np.uint64)  # [B]

    def set(self, settings: dict) -> None:
        """``slot -> SamplingParams`` (validated)."""
        for b, p in settings.items():
            assert 0 <= p.seed < SEED_LIMIT
            self.temperature[b], self.top_k[b], self.top_p[b], self.seed[b] = p.temperature, p.top_k, p.top_p, p.seed

    def upload(self, backend, bufs: StreamBufs, stream) -> None:
        for name in ("temperature", "top_k", "top_p", "seed"):
            backend.upload(getattr(bufs, name), getattr(self, name), stream)


def sample_first_tokens(ops, backend, bufs: StreamBufs, prompt_end: np.ndarray, stream, fields=None,
                        lengths=None) -> None:
    """``pend[b]`` <- a draw from the target's distribution after the prompt, for prefilled slots.

    The target's prefill wrote that row's logits to ``tgt_logits[:, 0]``. The draw is
    ``accept_sample`` with no drafts (``brk = [0, 0]``) at ``pos = P - 1``: one draw of
    ``DRAW_RESAMPLE`` for the token at position P from ``p`` row 0, keyed like every later
    token. ``brk``, ``pos_start``, ``n_acc`` and ``last_pred`` are per-round scratch
    (every sampling round reseeds them), so other slots lose nothing; the draws reach
    ``pend`` only for the prefilled slots, by a device-side row copy: no host sync, so
    admission may be enqueued behind bursts still in flight.

    Parameters
    ----------
    prompt_end : [B] int32 host array: P, the whole prompt's length (a chunked prompt's
        end, not its last chunk's), ``NO_PREFILL`` for slots left alone
    fields : SlotFields or None
        The decoder's logits processing: row 0 is processed (empty history) before its
        distribution, with min-p, and each drawn first token is counted.
    lengths : [B] int32 device array, ``NO_PREFILL`` for slots left alone (the staging's; with ``fields``)
    """
    slots = np.flatnonzero(prompt_end != NO_PREFILL)
    if len(slots) == 0:
        return
    pos = np.where(prompt_end != NO_PREFILL, prompt_end.astype(np.int64) - 1, 0).astype(np.int32)
    backend.upload(bufs.brk, np.zeros((bufs.batch, 2), np.int32), stream)
    backend.upload(bufs.pos_start, pos, stream)
    if fields is not None:
        fields.first_token(ops, bufs, stream)
    ops.probs_from_logits(bufs.tgt_logits, bufs.temperature, bufs.top_k, bufs.top_p, bufs.tgt_logits, bufs, step=0,
                          min_p=None if fields is None else fields.min_p, stream=stream)
    ops.accept_sample(bufs.vtok, bufs.tgt_logits, bufs.draft_logits, bufs.brk, bufs.seed, bufs.pos_start, bufs.n_acc,
                      bufs.last_pred, bufs, stream=stream)
    backend.copy_rows(bufs.pend, bufs.last_pred, slots, stream)
    if fields is not None:
        fields.count_first(ops, bufs, lengths, stream)
