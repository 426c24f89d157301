"""The parallel decoder and burst: the single-GPU program on every rank, plus collectives.

Every rank builds a :class:`ParallelDecoder` over its own models and StreamBufs and
captures one :class:`~graphburst.capture.BurstGraph`; the bursts are SPMD: the same
program, the same replay count, in lockstep through the collectives inside the graphs.
One graph replay per burst per GPU, one host sync per burst (the drain's event wait,
which also covers the rank check's copy).
"""

from __future__ import annotations

import contextlib
import functools

from ..engine.program import Call
from ..engine.decoder import SpecDecoder
from ..capture import BurstGraph
from ..models.torch_adapter import TorchDraft, TorchTarget
from .check import MAX_GRAPHS, RankCheck
from .dist import Context, Layout, ParallelError, wait_until
from .models import self_draft
from .pp import StageLlama, StageTarget, stage_table
from .tp import TPLlama

#: under TP, the draft sharded like the target (the default) or whole on every rank
DRAFT_MODES = ("sharded", "replicated")


class ParallelDecoder(SpecDecoder):
    """A :class:`SpecDecoder` whose burst ends with the rank-agreement call.

    A pipeline stage's target (:class:`StageTarget`) gets the stage-local rollback table.
    """

    def __init__(self, target, draft, ctx: Context, **kw):
        super().__init__(target, draft, **kw)
        self.ctx = ctx
        self._use_stage_table()
        self.check = RankCheck(ctx, self.bufs, self.backend)

    def _use_stage_table(self) -> None:
        if isinstance(self.target, StageTarget):
            self.table = stage_table(self.target, self.draft, self.bufs.pos_ctr, self.stream)

    def refresh_tables(self) -> None:
        super().refresh_tables()
        self._use_stage_table()

    def burst_calls(self, rounds: int | None = None) -> list[Call]:
        return super().burst_calls(rounds) + [Call("rank_check", self.check)]


class CheckedGraph(BurstGraph):
    """The :class:`BurstGraph` of a :class:`ParallelDecoder`: bounded drain, rank check verified.

    Each captured graph (two with ``gapless``) ends its rank check with a copy into its
    own pinned vector (``RankCheck.hosts[graph_index]``). :meth:`drain` waits for the burst's
    event by polling it for at most ``drain_timeout_s`` (:func:`dist.wait_until`: a peer
    that died mid-graph leaves the replayed collectives waiting forever, unseen by the
    NCCL watchdog), then drains and compares the ranks' checksums.

    Parameters
    ----------
    dec : ParallelDecoder
    gapless : bool
        As :class:`BurstGraph` (the serving loop keeps two bursts in flight).
    depth : int, optional
        As :class:`BurstGraph`, at most ``check.MAX_GRAPHS`` (one pinned check vector per graph).
    drain_timeout_s : float, optional
        Default: the group's timeout (``--dist-timeout``).
    """

    def __init__(self, dec: ParallelDecoder, *, gapless: bool = False, depth: int | None = None,
                 drain_timeout_s: float | None = None):
        if not isinstance(dec, ParallelDecoder):
            raise TypeError(f"dec must be a ParallelDecoder, got {type(dec).__name__}")
        if isinstance(depth, int) and depth > MAX_GRAPHS:
            raise ValueError(f"depth={depth!r}: a tensor-parallel burst graph keeps at most {MAX_GRAPHS} bursts in "
                             "flight (one pinned rank-check vector each)")
        timeout = dec.ctx.timeout_s if drain_timeout_s is None else drain_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"drain_timeout_s must be a number > 0, got {drain_timeout_s!r}")
        self.drain_timeout_s = float(timeout)
        super().__init__(dec, gapless=gapless, depth=depth)

    def _program(self, graph_index: int, rounds: int | None = None) -> list[Call]:
        program = super()._program(graph_index, rounds)
        check = self.dec.check
        # The check call of graph ``graph_index`` copies into that graph's own host vector.
        return [Call(c.name, functools.partial(check, graph_index=graph_index)) if c.name == "rank_check" else c
                for c in program]

    def drain(self):
        if self._pending and self.backend.is_gpu:
            event = self._events[self._pending[0]]
            wait_until(lambda: event.done, self.drain_timeout_s,
                       f"rank {self.dec.ctx.rank}: burst {self.dec.bursts + 1} (waiting at drain for its graph)")
        graph_index = self._pending[0] if self._pending else 0
        tokens = super().drain()
        self.dec.check.verify(self.dec.bursts, graph_index=graph_index)
        return tokens


class ParallelBurst:
    """A captured parallel burst: :meth:`run` = one replay and one drain, checked across ranks."""

    def __init__(self, dec: ParallelDecoder, *, drain_timeout_s: float | None = None):
        if not isinstance(dec, ParallelDecoder):
            raise TypeError(f"dec must be a ParallelDecoder, got {type(dec).__name__}")
        self.dec = dec
        self.graph = CheckedGraph(dec, drain_timeout_s=drain_timeout_s)

    def replay(self) -> None:
        with peer_errors(self.dec):
            self.graph.replay()

    def drain(self):
        with peer_errors(self.dec):
            return self.graph.drain()

    def run(self):
        self.replay()
        return self.drain()

    def close(self) -> None:
        """Drop the graphs (they hold NCCL work) before the process group goes."""
        drop_graphs(self.graph)


def drop_graphs(graph: BurstGraph) -> None:
    """Release a graph's captured executables (they hold NCCL work) before the process group goes.

    Only after a clean run: with a collective still hung on the device, freeing the
    graph's memory pool could wait on it.
    """
    graph._graphs = []


@contextlib.contextmanager
def peer_errors(dec: ParallelDecoder):
    """A collective that fails (a peer died, a timeout) becomes one clear ParallelError."""
    try:
        yield
    except ParallelError:
        raise
    except RuntimeError as exc:
        raise ParallelError(f"rank {dec.ctx.rank}: burst {dec.bursts + 1} failed in a collective; "
                            f"another rank probably failed or timed out ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:300]})") from exc


def build_pair(full_target, full_draft, ctx: Context, layout: Layout, *, batch: int, capacity: int, backend,
               p_min: float = 0.0, draft_mode: str = "sharded"):
    """This rank's (target, draft) of a layout, from whole models (read, not kept).

    Parameters
    ----------
    full_target, full_draft : graphburst.models.llama.Llama
        Identical on every rank (``ctx.agree_on`` checks the config; the weights come
        from the same checkpoint or seed).
    layout : Layout
        ``tp = world`` (sharded target) or ``pp = world`` (stages).
    draft_mode : {"sharded", "replicated"}
        Under TP: sharded like the target (every rank-local result passes through a
        collective before it decides a token, so the ranks agree by construction), or the
        whole draft on every rank (no collectives in the chain; agreement then rests on
        bitwise-identical kernels on every GPU: its attention is deterministic, and the
        rank check verifies every burst). Under PP the draft is always replicated.
    """
    if draft_mode not in DRAFT_MODES:
        raise ValueError(f"draft_mode must be one of {DRAFT_MODES}, got {draft_mode!r}")
    kw = {"batch": batch, "capacity": capacity}
    if layout.tp > 1:
        t_mod = TPLlama(full_target, ctx, **kw)
        target = TorchTarget(t_mod, backend=backend, **kw)
    else:
        t_mod = StageLlama(full_target, ctx, **kw)
        target = StageTarget(t_mod, backend=backend, **kw)
    if layout.tp > 1 and draft_mode == "sharded":
        d_mod = TPLlama(full_draft, ctx, **kw)
    else:
        # A copy with its own KV: the whole draft on this rank, never shared with a caller's decoder.
        # Every rank computes it alone and must propose the same tokens: deterministic attention.
        d_mod = self_draft(full_draft, full_draft.cfg.num_hidden_layers, batch=batch, capacity=capacity,
                           deterministic_attention=True)
    draft = TorchDraft(d_mod, backend=backend, p_min=p_min, **kw)
    return target, draft


def hash_parts(full_target, full_draft, layout: Layout, **flags) -> tuple:
    """What every rank must share, for ``ctx.agree_on`` (configs, layout, flags, a weight probe)."""
    import dataclasses

    def probe(m):  # a few weight values: a different checkpoint or seed changes them
        w = m.embed_tokens.weight.detach()
        return [float(x) for x in w.reshape(-1)[:: max(1, w.numel() // 8)][:8].float().cpu()]
    return (dataclasses.asdict(full_target.cfg), dataclasses.asdict(full_draft.cfg), dataclasses.asdict(layout),
            flags, probe(full_target), probe(full_draft))

