"""The burst program: a round as a list of bound kernel calls, in stream order.

A :class:`Call` binds one kernel op (or a model hook) to its buffers, so running the
round is ``for call in calls: call(stream)``. The eager modes of
:class:`~graphburst.engine.decoder.SpecDecoder` run these lists and :mod:`graphburst.capture`
captures the same lists. The builders here need only the ops namespace, the buffers,
the rollback table and the models, never a decoder's host state.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..buffers import StreamBufs
from ..sampling.mode import draft_sample_calls, verify_sample_calls


@dataclass(frozen=True)
class Call:
    """One bound kernel call of a round: ``fn(stream=...)`` enqueues it."""

    name: str
    fn: functools.partial

    def __call__(self, stream) -> None:
        self.fn(stream=stream)


def round_calls(ops, bufs: StreamBufs, table, target, draft, *, k: int, fused: bool, assemble: bool, sampling: bool,
                first_round: bool, fields=None, caps=None) -> list[Call]:
    """The bound kernel calls of one round, in stream order.

    Fused rounds are seeded by the previous round's epilogue (or the burst's head
    seed), so they start at the draft chain. ``fields``: a sampling decoder's
    :class:`~graphburst.sampling.fields.SlotFields`, or None. ``caps``: the decoder's
    :class:`~graphburst.engine.draft_caps.DraftCaps` (its launch follows the draft chain), or None.
    """
    calls = [] if fused else [seed_call(ops, bufs, reset_ring=first_round)]
    if sampling:
        return calls + sampling_round_calls(ops, bufs, table, target, draft, k=k, fields=fields, caps=caps)
    calls += [Call(f"draft_step[{j}]", functools.partial(draft.draft_step, bufs, j)) for j in range(k)]
    if caps is not None:
        calls.append(caps.call(ops, bufs))
    if assemble:
        calls.append(assemble_call(ops, bufs))
    calls.append(Call("verify", functools.partial(target.verify, bufs)))
    if fused:
        return calls + [epilogue_call(ops, bufs, table)]
    return calls + separate_tail_calls(ops, bufs, table)


def sampling_round_calls(ops, bufs: StreamBufs, table, target, draft, *, k: int, fields=None,
                         caps=None) -> list[Call]:
    """A sampling round after its seed (the program is in :mod:`graphburst.sampling.mode`; with
    ``fields``, :mod:`graphburst.sampling.fields`). The caps' launch comes before
    ``draft_append_last``: a capped chain counts as broken, and its last draft is never committed."""
    calls = []
    for j in range(k):
        calls.append(Call(f"draft_step[{j}]", functools.partial(draft.draft_step, bufs, j)))
        calls += [Call(name, fn) for name, fn in draft_sample_calls(ops, bufs, j)]
    if caps is not None:
        calls.append(caps.call(ops, bufs))
    calls.append(Call("draft_append_last", functools.partial(draft.draft_append_last, bufs)))
    calls += [assemble_call(ops, bufs), Call("verify", functools.partial(target.verify, bufs))]
    calls += [Call(name, fn) for name, fn in verify_sample_calls(ops, bufs, fields)]
    commit, rollback = separate_tail_calls(ops, bufs, table)[1:]  # accept_sample replaced accept_greedy
    counted = [] if fields is None else [Call("fields_commit", fields.commit_call(ops, bufs))]
    return calls + [commit] + counted + [rollback]


# The generic bookkeeping calls, shared by the decoder's program and the capture warm-up.


def seed_call(ops, bufs: StreamBufs, reset_ring: bool) -> Call:
    return Call("seed_gather", functools.partial(ops.seed_gather, bufs.pend, bufs.pos_ctr, bufs.vtok, bufs.pos_start,
                                                 bufs.brk, bufs.ring, reset_ring=reset_ring))


def assemble_call(ops, bufs: StreamBufs) -> Call:
    return Call("assemble_verify", functools.partial(ops.assemble_verify, bufs.pend, bufs.draft_tok, bufs.brk,
                                                     bufs.vtok))


def epilogue_call(ops, bufs: StreamBufs, table) -> Call:
    return Call("epilogue", functools.partial(ops.epilogue, bufs.tgt_pred, bufs.eos, bufs.vtok, bufs.brk, bufs.n_acc,
                                              bufs.last_pred, bufs.budget, bufs.ring, bufs.pend, bufs.acc,
                                              bufs.n_commit, bufs.pos_start, bufs.pos_ctr, table))


def separate_tail_calls(ops, bufs: StreamBufs, table) -> list[Call]:
    """Accept, commit and rollback as three kernels (the unfused round's tail)."""
    return [
        Call("accept_greedy", functools.partial(ops.accept_greedy, bufs.vtok, bufs.tgt_pred, bufs.brk, bufs.n_acc,
                                                bufs.last_pred)),
        Call("ring_commit", functools.partial(ops.ring_commit, bufs.vtok, bufs.n_acc, bufs.last_pred, bufs.eos,
                                              bufs.budget, bufs.ring, bufs.pend, bufs.acc, bufs.n_commit)),
        Call("rollback_stream", functools.partial(ops.rollback_stream, table, bufs.pos_start, bufs.n_commit)),
    ]


class CallCache:
    """Bound calls built once and dropped when anything they bind may have moved.

    Register it with the ``watch`` of every object whose attributes the calls bind (the
    decoder, for its rollback table; its StreamBufs): rebinding a watched attribute calls
    :meth:`invalidate`, as it does for a captured graph's guard (:mod:`graphburst.guard`).
    ``key`` holds the plain settings the calls were built with (flags, the ops
    namespace); a different key means a rebuild too.
    """

    def __init__(self):
        self.calls = None
        self.key = None

    def get(self, key):
        """The cached calls if they were built with ``key`` and nothing moved since, else None."""
        return self.calls if self.calls is not None and self.key == key else None

    def put(self, key, calls):
        self.key, self.calls = key, calls
        return calls

    def invalidate(self, what: str = "") -> None:
        self.calls = None
