"""Shared parts of the prefill graphs' tests: a tiny random target/draft adapter pair, a fresh
prefill (optionally under torch's sync-debug "error" mode), the decoded tokens against the
target module's own greedy, and poisoned caches whose readable rows a warm-up must leave alone."""

from __future__ import annotations

import torch

from graphburst.models.checkpoint import tiny_random_configs
from graphburst.models.llama import Llama
from graphburst.models.torch_adapter import TorchDraft, TorchTarget


def tiny_adapters(backend, *, batch: int, capacity: int, graphs: bool = True, packed: bool = False, seed: int = 3):
    """The tiny random target (seed) and draft (seed + 1) as adapters on ``backend``, with prefill
    graphs unless ``graphs`` is False, packed when ``packed`` (without graphs: the plain prefill)."""
    cfg, draft_cfg = tiny_random_configs()
    dev = "cuda" if backend.is_gpu else "cpu"
    t = Llama(cfg, batch=batch, capacity=capacity, device=dev).init_random_(seed)
    d = Llama(draft_cfg, batch=batch, capacity=capacity, device=dev).init_random_(seed + 1)
    kw = dict(batch=batch, capacity=capacity, backend=backend, prefill_graphs=graphs,
              packed_prefill=packed and graphs)
    return TorchTarget(t, **kw), TorchDraft(d, **kw)


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


def poison(models) -> list:
    """Fill every KV storage of ``models`` (torch adapters) with finite garbage; returns CPU copies."""
    gen = torch.Generator().manual_seed(9)
    for m in models:
        for kv in m.module.kv:
            kv.copy_(torch.randn(kv.shape, generator=gen))
    if models[0].backend.is_gpu:
        torch.cuda.synchronize()
    return [kv.detach().cpu().clone() for m in models for kv in m.module.kv]


def check_untouched(models, before) -> None:
    """After a warm-up: every row a slot can read (below S - 1) bit for bit as ``before`` (:func:`poison`'s),
    and row S - 1 of slot 0 written (the forwards ran)."""
    after = [kv.detach().cpu().clone() for m in models for kv in m.module.kv]
    s = after[0].shape[2]
    for i, (old, new) in enumerate(zip(before, after)):
        assert torch.equal(new[:, :, : s - 1], old[:, :, : s - 1]), f"kv {i}: a readable row moved"
        assert torch.equal(new[:, 1:], old[:, 1:]), f"kv {i}: a slot past 0 moved"
        assert not torch.equal(new[:, 0, s - 1], old[:, 0, s - 1]), f"kv {i}: the warm-up wrote nothing"
