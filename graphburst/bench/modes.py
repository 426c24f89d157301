"""The ways of running bursts that ``graphburst bench latency`` compares.

Each mode has ``enqueue()`` (start one burst) and ``finish()`` (its tokens, or None
for a timing-only mode). Tables label modes by letter; code names them.
"""

from __future__ import annotations

import enum

from ..engine.mode import BurstMode
from ..engine.decoder import SpecDecoder
from ..capture import BurstGraph
from ..protocol import hook


class Mode(str, enum.Enum):
    """Benchmark modes; the value is the letter the tables and JSON use.

    The first four are the engine's :class:`~graphburst.engine.mode.BurstMode` (``burst_mode``);
    the rest are references the benchmark adds.
    """

    PER_ROUND_SYNC = "a"  # eager, a host sync after every round
    PRE_ISSUED = "b"  # eager, the whole burst enqueued before one sync
    GRAPH = "c"  # one graph launch per burst
    GAPLESS = "d"  # graph, next burst enqueued before this one is drained
    TORCH_PEER = "e"  # the bookkeeping in torch ops, captured with torch.cuda.graph
    FLOOR = "f"  # as many dependent empty kernel nodes as GRAPH has
    GRAPH_EMPTY_MODELS = "g"  # GRAPH with every model call an empty node


    @property
    def burst_mode(self) -> BurstMode | None:
        """The engine's mode this benchmark mode runs (None for the references)."""
        return BurstMode[self.name] if self.name in BurstMode.__members__ else None


LABELS = {Mode.PER_ROUND_SYNC: "eager, sync every round", Mode.PRE_ISSUED: "eager, pre-issued",
          Mode.GRAPH: "graph replay", Mode.GAPLESS: "graph, gapless drain",
          Mode.TORCH_PEER: "torch-ops peer (graph)", Mode.FLOOR: "floor: empty nodes",
          Mode.GRAPH_EMPTY_MODELS: "graph, model calls as empty nodes"}
TIMING_ONLY = (Mode.FLOOR, Mode.GRAPH_EMPTY_MODELS)  # their tokens are not meaningful


class Runner:
    """One way of running bursts: ``enqueue()`` starts one, ``finish()`` returns its tokens (or None)."""

    launches = 1
    syncs = 1
    pipelined = False

    def __init__(self, backend):
        self.backend = backend
        self.stream = None

    def enqueue(self):
        raise NotImplementedError

    def finish(self):
        raise NotImplementedError

    def prepare(self) -> None:
        """Anything to do once before the first burst (the torch peer captures here)."""


def burst_runner(dec: SpecDecoder, mode: BurstMode) -> Runner:
    """The runner of one of the engine's burst modes over ``dec``."""
    mode = BurstMode.parse(mode)
    return Eager(dec, mode) if mode.eager else Graph(dec, gapless=mode is BurstMode.GAPLESS)


class Eager(Runner):
    def __init__(self, dec: SpecDecoder, mode: BurstMode):
        super().__init__(dec.backend)
        self.dec, self.stream = dec, dec.stream
        self.mode = BurstMode.parse(mode, (BurstMode.PER_ROUND_SYNC, BurstMode.PRE_ISSUED))
        self.launches = len(dec.burst_calls())
        self.syncs = dec.m_rounds + 1 if self.mode is BurstMode.PER_ROUND_SYNC else 1

    def enqueue(self):
        self.dec.enqueue_burst(mode=self.mode)

    def finish(self):
        return self.dec.drain()


class Graph(Runner):
    def __init__(self, dec: SpecDecoder, gapless: bool):
        super().__init__(dec.backend)
        self.graph, self.stream = BurstGraph(dec, gapless=gapless), dec.stream
        self.pipelined = gapless

    def enqueue(self):
        self.graph.replay()

    def finish(self):
        return self.graph.drain()


class Peer(Runner):
    """The torch-ops peer: its first burst runs eagerly, then it is captured."""

    def __init__(self, dec: SpecDecoder):
        from .torch_peer import TorchPeer

        super().__init__(dec.backend)
        self.peer = TorchPeer(dec)
        self.stream = self.peer.cp_stream
        self.captured = False

    def enqueue(self):
        self.peer.enqueue()

    def finish(self):
        tokens = self.peer.drain()
        if not self.captured:  # the eager warm-up burst has run: capture now
            self.peer.capture()
            self.captured = True
        return tokens


class Floor(Runner):
    """A graph of ``n_nodes`` dependent empty kernels; it commits no tokens."""

    syncs = 0

    def __init__(self, backend, n_nodes: int):
        super().__init__(backend)
        self.stream = backend.new_stream()
        rt = backend.xp.cuda.runtime
        backend.ops.empty_node(stream=self.stream)
        self.stream.synchronize()
        self.stream.begin_capture(mode=rt.streamCaptureModeGlobal)
        for _ in range(n_nodes):
            backend.ops.empty_node(stream=self.stream)
        self.graph = self.stream.end_capture()
        self.graph.upload(self.stream)

    def enqueue(self):
        self.graph.launch(self.stream)

    def finish(self):
        return None


class EmptyModel:
    """Timing-only stand-in: one empty kernel per model call, over a stub's cache.

    Replacing the stub models by empty nodes isolates what the bookkeeping kernels cost
    against the floor of the same node count.
    """

    def __init__(self, inner):
        self.inner, self.cache, self.vocab, self.backend = inner, inner.cache, inner.vocab, inner.backend
        self.writes_verify_tokens = hook(inner, "writes_verify_tokens")  # same node count as GRAPH

    def prefill(self, *args) -> None:
        self.inner.prefill(*args)

    def draft_step(self, bufs, step, stream):
        self.backend.ops.empty_node(stream=stream)

    def verify(self, bufs, stream):
        self.backend.ops.empty_node(stream=stream)
