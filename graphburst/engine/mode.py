"""How bursts run: one vocabulary for the decoder, the demo, the benchmarks and serving.

``graph`` and ``gapless`` replay a captured :class:`~graphburst.capture.BurstGraph`;
``pre_issued`` and ``per_round_sync`` are :meth:`SpecDecoder.enqueue_burst`'s eager modes.
"""

from __future__ import annotations

import enum

__all__ = ["EAGER_MODES", "BurstMode"]


class BurstMode(str, enum.Enum):
    """How bursts run: one vocabulary for the decoder, the demo, the benchmarks and serving.

    The value is the name commands and JSON use (``BurstMode.GRAPH == "graph"``).
    """

    GRAPH = "graph"  # one captured graph launch per burst (BurstGraph)
    GAPLESS = "gapless"  # graph, the next burst enqueued before this one is drained
    PRE_ISSUED = "pre_issued"  # eager, the whole burst enqueued before its one sync
    PER_ROUND_SYNC = "per_round_sync"  # eager, a host sync after every round

    def __str__(self) -> str:  # f-strings and messages show the value, as the commands spell it
        return self.value

    @property
    def eager(self) -> bool:
        """Run by :meth:`SpecDecoder.enqueue_burst` (no graph)."""
        return self in EAGER_MODES

    @classmethod
    def parse(cls, value, allowed=None, *, name: str = "mode") -> BurstMode:
        """``value`` (a BurstMode, its value or an old alias) as a BurstMode in ``allowed``.

        Raises
        ------
        ValueError
            Naming ``name`` and the modes allowed, for anything else.
        """
        allowed = tuple(cls) if allowed is None else tuple(allowed)
        try:
            mode = cls(value)
        except ValueError:
            mode = None
        if mode not in allowed:
            raise ValueError(f"{name} must be one of {[m.value for m in allowed]}, got {value!r}")
        return mode


EAGER_MODES = (BurstMode.PER_ROUND_SYNC, BurstMode.PRE_ISSUED)
