"""Shared GPU checks of the prefill graphs' tests: a fresh prefill (optionally under torch's
sync-debug "error" mode) and the decoded tokens against the target module's own greedy."""

from __future__ import annotations

import torch


def prefill_fresh(dec, prompts: dict, new_tokens: int, *, no_sync: bool) -> None:
    """``prefill_checked`` of ``prompts`` (slot -> [n] int32) at position 0, ``new_tokens`` each;
    with ``no_sync`` any host sync inside raises (a replay of a captured bucket never syncs)."""
    if no_sync:
        torch.cuda.set_sync_debug_mode("error")
    try:
        dec.prefill_checked(prompts, {b: 0 for b in prompts}, limits={b: new_tokens for b in prompts})
    finally:
        torch.cuda.set_sync_debug_mode("default")


def assert_decodes_greedy(dec, prompts: dict, new_tokens: int, *, scratch_row: int, label: str) -> None:
    """Run bursts until the slots of ``prompts`` finish; their tokens must be the target's greedy
    continuation (``module.greedy``, which overwrites KV row ``scratch_row``)."""
    got = {b: [] for b in prompts}
    while any(dec.host_left[b] > 0 for b in prompts):
        tokens = dec.run_burst()
        for b in prompts:
            got[b] += tokens[b].tolist()
    for b, p in prompts.items():
        assert got[b] == dec.target.module.greedy(p.tolist(), new_tokens, row=scratch_row), f"{label}, slot {b}"
