"""The numpy backend's ``ops``: the twin of every kernel, by the name its wrapper has in ``cuda_ops``.

The twins are the executable specification: ``burst_ref`` (generic bookkeeping),
``stubs_ref`` (the stub models), ``sampling_ref`` (rejection sampling). Each updates its
output arrays in place, and ``stream`` is accepted and ignored.
"""

from __future__ import annotations

from .burst_ref import (accept_greedy, admit_slots, assemble_verify, cap_drafts, epilogue, ring_commit, rollback_stream,
                        seed_gather)
from .fields_ref import apply_fields, fields_commit, fields_first, fields_prompt, fields_reset
from .round_exit_ref import round_exit
from .ngram_ref import ngram_append, ngram_onehot_logits, ngram_prefill, ngram_search
from .sampling_ref import accept_sample, draft_probs_sample, probs_from_logits, sample_draft
from .sampling_prims import ftz
from .stubs_ref import stub_prefill, stub_draft_step, stub_verify, stub_draft_append, stub_logits

__all__ = [
    "apply_fields",
    "fields_commit",
    "fields_first",
    "fields_prompt",
    "fields_reset",
    "admit_slots",
    "cap_drafts",
    "accept_greedy",
    "accept_sample",
    "assemble_verify",
    "draft_probs_sample",
    "epilogue",
    "ftz",
    "ngram_append",
    "ngram_onehot_logits",
    "ngram_prefill",
    "ngram_search",
    "probs_from_logits",
    "ring_commit",
    "round_exit",
    "rollback_stream",
    "sample_draft",
    "seed_gather",
    "stub_draft_append",
    "stub_draft_step",
    "stub_logits",
    "stub_prefill",
    "stub_verify",
]
