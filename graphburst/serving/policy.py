"""What a serving loop may decide on its own, and how its decoder and graph are built.

:class:`~graphburst.serving.loop.ServeLoop` takes one :class:`LoopPolicy`. A loop in one
process uses :class:`LocalPolicy` (the default): a :class:`~graphburst.engine.decoder.SpecDecoder`,
a :class:`~graphburst.capture.BurstGraph`, admission that follows the loop's own timings, and
first tokens handed out as soon as the prefill made them. A loop that must take the same steps
as other processes (tensor-parallel serving, :mod:`graphburst.parallel.lockstep`) passes its own
policy: its decoder and graph, and none of the choices that would follow this process's timings.
This protocol is the only way such a loop changes the serving loop's behaviour.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..capture import BurstGraph
from ..engine.decoder import SpecDecoder
from .pipeline import graph_of


@runtime_checkable
class LoopPolicy(Protocol):
    """The hooks of a serving loop.

    Attributes
    ----------
    heartbeat_s : float or None
        A driver of an idle loop steps it at least this often (None: only when there is work).
        Lockstep rank 0 keeps its followers' wait for the next plan alive this way.
    replays_ids : bool
        Request ids come from a loop that made them up already (a lockstep follower): the
        intake then takes ids of the made-up form.
    early_first_tokens : bool
        Hand first tokens out after the prefill (:mod:`~graphburst.serving.first_tokens`);
        False: with the first burst.
    local_timing : bool
        Admission may follow this process's own timings (``auto``'s early or late order and its
        coalescing of boundaries, :class:`~graphburst.serving.admit.AdmissionSchedule`). False: a
        pipelined step always admits after the refill and a due boundary always runs, so every
        process that steps the same loop admits at the same steps (``admission`` is then ``late``).
    """

    heartbeat_s: float | None
    replays_ids: bool
    early_first_tokens: bool
    local_timing: bool

    def make_decoder(self, target, draft, **kw) -> SpecDecoder:
        """The loop's decoder; ``kw``: ``k``, ``m_rounds``, ``sampling``, ``draft_caps``, ``spec_max_batch``
        (and ``fields``), :class:`SpecDecoder`'s."""

    def make_graph(self, dec: SpecDecoder, *, depth: int, **kw) -> BurstGraph:
        """The graph the loop replays, keeping ``depth`` bursts in flight (gapless past 1); ``kw``
        (``device_exit``, ``hold_stops``) go to its constructor, passed only under ``local_timing``."""

    def costs_only_its_requests(self, exc: Exception) -> bool:
        """Whether a failure (of a prefill, or of a step) may end only the requests it touches,
        the loop serving on; False: the step raises it."""


class LocalPolicy:
    """The policy of a loop that answers to nobody else: :class:`LoopPolicy`'s defaults."""

    heartbeat_s = None
    replays_ids = False
    early_first_tokens = True
    local_timing = True

    def make_decoder(self, target, draft, **kw) -> SpecDecoder:
        return SpecDecoder(target, draft, **kw)

    def make_graph(self, dec: SpecDecoder, *, depth: int, **kw) -> BurstGraph:
        return graph_of(dec, depth=depth, **kw)

    def costs_only_its_requests(self, exc: Exception) -> bool:
        return True


def check_policy(policy) -> LoopPolicy:
    """``policy``: None (a :class:`LocalPolicy`) or an object with every member of :class:`LoopPolicy`."""
    if policy is None:
        return LocalPolicy()
    if not isinstance(policy, LoopPolicy):
        missing = [m for m in ("heartbeat_s", "replays_ids", "early_first_tokens", "local_timing", "make_decoder",
                               "make_graph", "costs_only_its_requests") if not hasattr(policy, m)]
        raise TypeError(f"policy must be a LoopPolicy, got {type(policy).__name__} (it lacks {', '.join(missing)})")
    if policy.heartbeat_s is not None and not policy.heartbeat_s > 0:
        raise ValueError(f"policy.heartbeat_s must be None or > 0, got {policy.heartbeat_s!r}")
    return policy
