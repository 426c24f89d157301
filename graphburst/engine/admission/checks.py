"""Validating a prefill's arguments before anything is written: prompts, starts, limits, stop
tokens and sampling settings, and whether a request fits the KV cache.

:class:`PrefillChecks` is a mixin of :class:`~graphburst.engine.admission.slots.SlotAdmission` (the decoder owns
``batch``, ``capacity``, ``bufs``, the models and ``sampling``): :meth:`SlotAdmission.prefill` runs
these checks, and a serving loop runs :meth:`check_first_burst_fits`'s stricter twin at submission
(``serving.request.check_whole_request_fits``), then admits through the unchecked entry points.
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


class PrefillChecks:
    """The validation half of :class:`~graphburst.engine.admission.slots.SlotAdmission` (a mixin)."""

    def _check_prefill(self, prompts, start, final, max_new_tokens, eos, temperature, top_k, top_p, seed):
        """Parse: ``({slot: chunk [n] int32}, {slot: start}, {slot: budget}, {slot: stop token},
        {slot: SamplingParams})``, sentinels filled in."""
        if not isinstance(final, bool):
            raise TypeError(f"final must be a bool, got {type(final).__name__}")
        if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            prompts = list(prompts)
        if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list with one entry (token list or None) per slot ({self.batch}), "
                            f"got {type(prompts).__name__}")
        if len(prompts) != self.batch:
            raise ValueError(f"prompts must have one entry per slot ({self.batch}), got {len(prompts)}")
        slots = [b for b, p in enumerate(prompts) if p is not None]
        starts = np.zeros(self.batch, np.int32)  # [B] int32
        start_of = per_slot("start", start, self.batch)
        for b in slots:
            s = start_of[b]
            starts[b] = 0 if s is None else check_int(f"start[{b}]", s, minimum=0, maximum=self.capacity - 1)
        if slots and (starts.any() or not final):
            for role in ("target", "draft"):
                model = getattr(self, role)
                if not chunked_prefill(model):
                    raise ValueError(f"the {role} model ({type(model).__name__}) cannot continue a cached prompt "
                                     "(no chunked_prefill): prefill whole prompts (start 0, final=True)")
        if not final and any(v is not None for v in (max_new_tokens, eos, temperature, top_k, top_p, seed)):
            raise TypeError("a non-final chunk takes no limit, stop token or sampling settings: "
                            "pass them with the prompt's final chunk")
        limits = per_slot("max_new_tokens", max_new_tokens, self.batch)
        stops = per_slot("eos", eos, self.batch)
        rows = {}
        for b in slots:
            if final:
                rows[b], limits[b], stops[b] = self.check_first_burst_fits(prompts[b], limits[b], stops[b], index=b,
                                                                           start=int(starts[b]))
            else:
                rows[b] = self._check_chunk(prompts[b], int(starts[b]), b)
        settings = self._check_sampling_args(slots, temperature, top_k, top_p, seed) if final else {}
        return (rows, {b: int(starts[b]) for b in slots}, {b: limits[b] for b in slots} if final else {},
                {b: stops[b] for b in slots} if final else {}, settings)

    def _check_chunk(self, prompt, start: int, b: int) -> np.ndarray:
        """A non-final chunk: valid tokens, and room behind it for at least the prompt's last token."""
        row = check_prompt(f"prompts[{b}]", prompt, self.target.vocab)
        if start + len(row) + 1 > self.capacity:
            raise CapacityError(f"prompts[{b}]: a chunk of {len(row)} tokens at position {start} leaves no room "
                                f"for the prompt's final chunk in a cache of {self.capacity}", slots=(b,))
        return row

    def check_first_burst_fits(self, prompt, max_new_tokens=None, eos=None, *, index: int | None = None,
                               start: int = 0):
        """Validate one slot's prefill arguments without touching the device: the prompt plus
        one burst of its tokens must fit the cache (the serving loop's stricter rule, and
        why they differ: ``graphburst.serving.request.check_whole_request_fits``).

        ``start``: the position of ``prompt[0]`` (its final chunk's, for a chunked prompt).
        Returns ``(prompt [n] int32, budget, stop token)`` with the sentinels filled in
        (``UNBOUNDED_BUDGET``, ``NO_EOS``). ``index`` names the slot in messages.

        Raises
        ------
        TypeError, ValueError
            For a bad prompt, limit or stop token.
        CapacityError
            When the prompt plus one burst's worth of its tokens cannot fit the cache.
        """
        at = "" if index is None else f"[{index}]"
        row = check_prompt(f"prompts{at}", prompt, self.target.vocab)
        limit = UNBOUNDED_BUDGET if max_new_tokens is None else check_int(
            f"max_new_tokens{at}", max_new_tokens, maximum=UNBOUNDED_BUDGET - 1)
        stop = NO_EOS if eos is None else check_int(f"eos{at}", eos, minimum=0, maximum=self.target.vocab - 1)
        need = start + len(row) + min(limit, self.bufs.ring_capacity)
        if need > self.capacity:
            ahead = f" at position {start}" if start else ""
            raise CapacityError(
                f"prompts{at} of length {len(row)}{ahead} plus {min(limit, self.bufs.ring_capacity)} new tokens "
                f"needs {need} KV entries, but the cache holds {self.capacity}")
        return row, limit, stop

    def _check_sampling_args(self, slots, temperature, top_k, top_p, seed) -> dict:
        """Per-slot sampling settings of a prefill: ``slot -> SamplingParams``, validated."""
        per = [per_slot(name, v, self.batch) for name, v in
               (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed))]
        return {b: check_slot(*(p[b] for p in per), sampling=self.sampling, index=b) for b in slots}
