"""The cupy backend's ``ops``: every kernel wrapper, by the name its numpy twin has in ``reference``.

The wrappers live beside their sections of ``kernels.cu``: ``burst_cuda`` (generic
bookkeeping), ``stubs_cuda`` (the stub models), ``sampling_cuda`` (rejection sampling);
``launch`` holds the memoized module and launch helpers.
"""

from __future__ import annotations

from .burst_cuda import (
    admit_slots,
    cap_drafts,
    seed_gather,
    assemble_verify,
    accept_greedy,
    ring_commit,
    rollback_stream,
    epilogue,
    empty_node,
)
from .fields_cuda import apply_fields, fields_commit, fields_first, fields_prompt, fields_reset
from .launch import KERNEL_NAMES, kernel, warm_up
from .round_exit_cuda import round_exit
from .ngram_cuda import ngram_append, ngram_onehot_logits, ngram_prefill, ngram_search
from .sampling_cuda import (
    accept_pick,
    accept_sample,
    accept_tiles,
    draft_probs_sample,
    probs_from_logits,
    probs_normalize,
    probs_select,
    probs_tiles,
    race_pick,
    race_tiles,
    sample_draft,
)
from .stubs_cuda import (
    stub_prefill,
    stub_draft_step,
    stub_verify,
    stub_draft_append,
    stub_logits,
)

__all__ = [
    "apply_fields",
    "fields_commit",
    "fields_first",
    "fields_prompt",
    "fields_reset",
    "admit_slots",
    "cap_drafts",
    "KERNEL_NAMES",
    "accept_greedy",
    "accept_pick",
    "accept_sample",
    "accept_tiles",
    "assemble_verify",
    "draft_probs_sample",
    "empty_node",
    "epilogue",
    "kernel",
    "ngram_append",
    "ngram_onehot_logits",
    "ngram_prefill",
    "ngram_search",
    "probs_from_logits",
    "probs_normalize",
    "probs_select",
    "probs_tiles",
    "race_pick",
    "race_tiles",
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
    "warm_up",
]
