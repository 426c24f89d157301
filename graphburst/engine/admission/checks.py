"""Validating a prefill's arguments before anything is written: prompts, starts, limits, stop
tokens and sampling settings, and whether a request fits the KV cache.

Plain functions of the sizes they check against (batch, capacity, vocabulary, ring):
:meth:`Admission.prefill <graphburst.engine.admission.slots.Admission.prefill>`, the one
validated entry point, runs :func:`check_prefill`; a serving loop runs
:func:`check_first_burst_fits`'s stricter twin at submission
(``serving.request.check_whole_request_fits``), then admits through the unchecked
``prefill_slots``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...constants import NO_EOS, UNBOUNDED_BUDGET
from ...sampling.mode import check_slot
from ...validate import check_int, check_prompt, per_slot


class CapacityError(ValueError):
    """A request or burst would write past a KV cache's capacity.

    Attributes
    ----------
    slots : tuple of int
        The batch slots that would overflow (empty when not tied to slots).
    """

    def __init__(self, message: str, slots=()):
        super().__init__(message)
        self.slots = tuple(int(b) for b in slots)


def chunked_prefill(model) -> bool:
    """Whether a model's ``prefill`` takes ``start=`` and ``rows=`` (continues a cached prefix)."""
    return bool(getattr(model, "chunked_prefill", False))


def check_prefill(prompts, start, final, max_new_tokens, eos, temperature, top_k, top_p, seed, *, batch: int,
                  capacity: int, ring_capacity: int, target, draft, sampling: bool, fields=None,
                  with_fields: bool = False) -> tuple:
    """Parse a prefill's arguments (``Admission.prefill``'s) into ``prefill_slots``' lists, sentinels
    filled in: ``(slots ascending, chunks [n] int32, starts, budgets, stop tokens, SamplingParams)``,
    one entry per slot; the last three None for a non-final chunk. ``target``, ``draft``: the
    models (a chunk past position 0 or not final needs both to declare ``chunked_prefill``);
    ``sampling``: the decoder samples (else a temperature > 0 is refused); ``fields``: the logits
    processing fields (a dict for every slot, or one dict or None per slot), which need
    ``with_fields`` (a decoder built with ``fields=True``)."""
    if not isinstance(final, bool):
        raise TypeError(f"final must be a bool, got {type(final).__name__}")
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list with one entry (token list or None) per slot ({batch}), "
                        f"got {type(prompts).__name__}")
    if len(prompts) != batch:
        raise ValueError(f"prompts must have one entry per slot ({batch}), got {len(prompts)}")
    slots = [b for b, p in enumerate(prompts) if p is not None]
    starts = np.zeros(batch, np.int32)  # [B] int32
    start_of = per_slot("start", start, batch)
    for b in slots:
        s = start_of[b]
        starts[b] = 0 if s is None else check_int(f"start[{b}]", s, minimum=0, maximum=capacity - 1)
    if slots and (starts.any() or not final):
        for role, model in (("target", target), ("draft", draft)):
            if not chunked_prefill(model):
                raise ValueError(f"the {role} model ({type(model).__name__}) cannot continue a cached prompt "
                                 "(no chunked_prefill): prefill whole prompts (start 0, final=True)")
    if not final and any(v is not None for v in (max_new_tokens, eos, temperature, top_k, top_p, seed, fields)):
        raise TypeError("a non-final chunk takes no limit, stop token or sampling settings: "
                        "pass them with the prompt's final chunk")
    limits = per_slot("max_new_tokens", max_new_tokens, batch)
    stops = per_slot("eos", eos, batch)
    rows = []
    for b in slots:
        if final:
            row, limits[b], stops[b] = check_first_burst_fits(
                prompts[b], limits[b], stops[b], vocab=target.vocab, capacity=capacity, ring_capacity=ring_capacity,
                index=b, start=int(starts[b]))
        else:
            row = check_chunk(prompts[b], int(starts[b]), b, vocab=target.vocab, capacity=capacity)
        rows.append(row)
    if not final:
        return slots, rows, [int(starts[b]) for b in slots], None, None, None
    settings = check_sampling_args(slots, temperature, top_k, top_p, seed, batch=batch, sampling=sampling,
                                   fields=fields, with_fields=with_fields, vocab=target.vocab)
    return (slots, rows, [int(starts[b]) for b in slots], [limits[b] for b in slots], [stops[b] for b in slots],
            [settings[b] for b in slots])


def check_chunk(prompt, start: int, b: int, *, vocab: int, capacity: int) -> np.ndarray:
    """A non-final chunk of slot ``b`` at position ``start``: valid tokens, and room behind it for
    at least the prompt's last token. Returns it as ``[n] int32``."""
    row = check_prompt(f"prompts[{b}]", prompt, vocab)
    if start + len(row) + 1 > capacity:
        raise CapacityError(f"prompts[{b}]: a chunk of {len(row)} tokens at position {start} leaves no room "
                            f"for the prompt's final chunk in a cache of {capacity}", slots=(b,))
    return row


def check_first_burst_fits(prompt, max_new_tokens=None, eos=None, *, vocab: int, capacity: int, ring_capacity: int,
                           index: int | None = None, start: int = 0):
    """Validate one slot's prefill arguments without touching the device: the prompt plus
    one burst of its tokens must fit the cache (the serving loop's stricter rule, and
    why they differ: ``graphburst.serving.request.check_whole_request_fits``).

    ``start``: the position of ``prompt[0]`` (its final chunk's, for a chunked prompt);
    ``vocab``: the target's; ``capacity``: the decoder's KV capacity; ``ring_capacity``: the
    most tokens one burst commits for a slot. Returns ``(prompt [n] int32, budget, stop token)``
    with the sentinels filled in (``UNBOUNDED_BUDGET``, ``NO_EOS``). ``index`` names the slot in
    messages.

    Raises
    ------
    TypeError, ValueError
        For a bad prompt, limit or stop token.
    CapacityError
        When the prompt plus one burst's worth of its tokens cannot fit the cache.
    """
    at = "" if index is None else f"[{index}]"
    row = check_prompt(f"prompts{at}", prompt, vocab)
    limit = UNBOUNDED_BUDGET if max_new_tokens is None else check_int(
        f"max_new_tokens{at}", max_new_tokens, maximum=UNBOUNDED_BUDGET - 1)
    stop = NO_EOS if eos is None else check_int(f"eos{at}", eos, minimum=0, maximum=vocab - 1)
    need = start + len(row) + min(limit, ring_capacity)
    if need > capacity:
        ahead = f" at position {start}" if start else ""
        raise CapacityError(
            f"prompts{at} of length {len(row)}{ahead} plus {min(limit, ring_capacity)} new tokens "
            f"needs {need} KV entries, but the cache holds {capacity}")
    return row, limit, stop


def check_sampling_args(slots, temperature, top_k, top_p, seed, *, batch: int, sampling: bool, fields=None,
                        with_fields: bool = False, vocab: int | None = None) -> dict:
    """Per-slot sampling settings of a prefill: ``slot -> SamplingParams``, validated
    (``sampling``: the decoder samples, else only greedy settings pass; ``fields``: None, a dict
    for every slot or a sequence of one dict or None per slot, allowed only ``with_fields``)."""
    per = [per_slot(name, v, batch) for name, v in
           (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed))]
    if fields is None or isinstance(fields, dict):
        per_fields = [fields] * batch
    else:
        per_fields = per_slot("fields", fields, batch)
    return {b: check_slot(*(p[b] for p in per), sampling=sampling, index=b, fields=per_fields[b],
                          with_fields=with_fields, vocab=vocab) for b in slots}
