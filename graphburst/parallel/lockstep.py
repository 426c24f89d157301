"""Tensor-parallel serving: rank 0 serves, every rank steps the same ServeLoop in lockstep.

``torchrun --nproc_per_node 2 -m graphburst serve --tp 2 --model ... [--http ...]``

Every rank builds the same :class:`LockstepLoop`: a :class:`~graphburst.serving.loop.ServeLoop`
it owns, built with a :class:`LockstepPolicy` (its
:class:`~graphburst.serving.policy.LoopPolicy`: a :class:`~.runner.ParallelDecoder`, a
:class:`~.runner.CheckedGraph`, and no choice that would follow one rank's own timings), and
the plan broadcast around that loop's steps. Only rank 0 has requests: the HTTP server or
the JSONL reader submits and cancels there. The loop's device work (which slots are
admitted with which prompts, when bursts are launched and drained) is a deterministic
function of its submit/cancel history and of the drained tokens, which the collectives make
identical on every rank. So rank 0 records its
submits and cancels in order and, at the start of every ``step()``, broadcasts them to
the other ranks as the step's **plan**; each follower applies the plan to its own loop
and takes the same step. Per step, one broadcast of a small int64 header over a
host-side gloo group (the common case: no new request), plus one broadcast of the ops'
JSON when there are some; no device sync.

The header also carries rank 0's schedule fingerprint (bursts drained, bursts in flight,
active slots, queued requests, tokens delivered) as of its previous step; a follower
whose own differs raises :class:`~.check.RankDivergence` before any collective of the
step. The in-graph rank check compares the burst state at every drain, as in the demo.

An idle rank 0 still sends an empty plan every ``heartbeat_s`` (a quarter of the group
timeout, at most 1 s), so a follower waiting for the next plan never hits the group
timeout, and a dead rank 0 is noticed within that timeout. Shutdown: rank 0's server
stops (SIGTERM/SIGINT, or the end of the JSONL input), then rank 0 sends a stop plan;
every rank drains the bursts still in flight, tears the group down and exits 0.
Followers ignore SIGTERM/SIGINT (torchrun forwards its own to every rank) and leave on
rank 0's stop.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import threading
import time

import numpy as np

from ..serving.request import Request, RequestState
from ..serving.loop import ServeLoop
from ..serving.pipeline import graph_of
from .dist import Context, ParallelError

# .runner and .check import torch: imported where used, so `serve --tp` flag errors stay fast.

#: header of a plan: [kind, payload bytes, *fingerprint] int64
PLAN, STOP = 0, 1
HEADER_LEN = 7
MAX_HEARTBEAT_S = 1.0
WIRE_FIELDS = ("id", "prompt", "max_new_tokens", "eos", "options", "temperature", "top_k", "top_p", "seed")


class PlanChannel:
    """Rank 0's per-step plan to the other ranks, over a gloo group of its own (host memory only).

    Parameters
    ----------
    ctx : Context
    timeout_s : float, optional
        Of the gloo group (a follower waits this long for a plan); default ``ctx.timeout_s``.
    """

    def __init__(self, ctx: Context, timeout_s: float | None = None):
        import torch.distributed as dist

        self.ctx = ctx
        self.timeout_s = float(ctx.timeout_s if timeout_s is None else timeout_s)
        self.heartbeat_s = min(MAX_HEARTBEAT_S, self.timeout_s / 4)
        # Every rank calls new_group (a collective); plans never share a queue with model collectives.
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        self.sent = 0

    def _bcast(self, tensor) -> None:
        import torch.distributed as dist

        try:
            dist.broadcast(tensor, src=0, group=self.group)
        except RuntimeError as exc:
            who = "rank 0 probably failed or stopped sending" if self.ctx.rank else "a follower probably failed"
            raise ParallelError(f"rank {self.ctx.rank}: the lockstep plan broadcast failed; {who} "
                                f"({str(exc).splitlines()[0][:300]})") from exc

    def send(self, kind: int, ops: list, fingerprint: tuple) -> None:
        """Rank 0: one header broadcast, plus the ops' JSON when there are any."""
        import torch

        payload = json.dumps(ops).encode() if ops else b""
        self._bcast(torch.tensor([kind, len(payload), *fingerprint], dtype=torch.int64))
        if payload:
            self._bcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.sent += 1

    def receive(self) -> tuple[int, list, tuple]:
        """A follower: ``(kind, ops, rank 0's fingerprint)``."""
        import torch

        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self._bcast(header)
        kind, n, *fingerprint = header.tolist()
        ops = []
        if n:
            buf = torch.empty(n, dtype=torch.uint8)
            self._bcast(buf)
            ops = json.loads(buf.numpy().tobytes())
        return kind, ops, tuple(fingerprint)


@dataclasses.dataclass(frozen=True)
class LockstepPolicy:
    """The :class:`~graphburst.serving.policy.LoopPolicy` of one rank's loop.

    Every rank's loop must take the same steps, so none of its choices may follow this rank's
    own timings (``local_timing``: admission always after the refill, a due boundary always
    runs; its prefill holds collectives), first tokens come with the first burst
    (``early_first_tokens``: a rank waits for a first-token copy with no time limit, where its
    drains are bounded by :class:`~.runner.CheckedGraph`, so a peer dying mid-prefill would hang
    it instead of failing the loop), and only a bad request's failure is recovered from
    (:meth:`costs_only_its_requests`).

    Parameters
    ----------
    ctx : Context
    heartbeat_s : float or None
        Rank 0: how often a driver steps an idle loop (the plan channel's); None on the others.
    drain_timeout_s : float, optional
        Bound of the drain's event wait (:class:`~.runner.CheckedGraph`); default the group timeout.
    """

    ctx: Context
    heartbeat_s: float | None = None
    drain_timeout_s: float | None = None
    early_first_tokens: bool = False
    local_timing: bool = False

    @property
    def replays_ids(self) -> bool:
        """A follower submits rank 0's requests, made-up ids included."""
        return self.ctx.rank != 0

    def make_decoder(self, target, draft, **kw):
        from .runner import ParallelDecoder

        return ParallelDecoder(target, draft, self.ctx, **kw)

    def make_graph(self, dec, *, depth: int):
        from .runner import CheckedGraph

        return graph_of(dec, depth=depth, graph_cls=CheckedGraph, drain_timeout_s=self.drain_timeout_s)

    def costs_only_its_requests(self, exc: Exception) -> bool:
        # A bad request (ValueError: CapacityError, a refused prefill) fails the same way on
        # every rank, so every rank recovers the same way. Anything else (a peer died, a
        # collective timed out) cannot be recovered in lockstep: it stops the loop.
        return isinstance(exc, (ValueError, TypeError)) and not isinstance(exc, ParallelError)


class LockstepLoop:
    """One rank of a tensor-parallel group serving in lockstep; rank 0 leads, the others follow.

    It owns a :class:`~graphburst.serving.loop.ServeLoop` (``loop``, built with a
    :class:`LockstepPolicy`) and steps it between plans: rank 0 records its submits and
    cancels and sends them before each step; a follower applies rank 0's plan to its loop and
    takes the same step. Drivers (the JSONL reader, the HTTP engine thread) use it as they use
    a ServeLoop: :meth:`submit`, :meth:`cancel`, :meth:`step`, :attr:`idle`, :attr:`heartbeat_s`,
    :attr:`log`, :meth:`stats`, and the loop's ``intake``, ``dec``, ``pipeline``, ``graph``,
    ``vocab`` and ``sampling``.

    Parameters
    ----------
    target, draft : this rank's models (:func:`.runner.build_pair`)
    ctx : Context
    channel : PlanChannel
    drain_timeout_s : float, optional
        Bound of the drain's event wait (:class:`CheckedGraph`); default the group timeout.
    **kw
        As :class:`ServeLoop` (``k``, ``m_rounds``, ``pipelined``, ``depth``, ``sampling``); the
        engine is always ``"graph"``.
    """

    def __init__(self, target, draft, ctx: Context, channel: PlanChannel, *, drain_timeout_s: float | None = None,
                 **kw):
        self.ctx, self.channel = ctx, channel
        #: drivers of an idle loop call step() at least this often (rank 0 only)
        self.heartbeat_s = channel.heartbeat_s if ctx.rank == 0 else None
        self.policy = LockstepPolicy(ctx, heartbeat_s=self.heartbeat_s, drain_timeout_s=drain_timeout_s)
        self._ops: list = []  # rank 0: submits and cancels since the last plan, in order
        self._last_sent = time.monotonic()
        self.steps = 0
        self.idle_steps = 0  # steps with nothing to run: rank 0's heartbeats while idle
        self._stepping = threading.Lock()  # held by step(): finish() must not run beside it
        self.fatal: str | None = None  # why the loop stopped for good (a peer failed)
        self.on_fatal = None  # rank 0: called once, on the engine thread, when ``fatal`` is set
        self.loop = ServeLoop(target, draft, engine="graph", policy=self.policy, **kw)
        self._after_step = self.fingerprint()  # rank 0: sent with the next plan

    @property
    def leader(self) -> bool:
        return self.ctx.rank == 0

    # ------------------------------------------------------------------ the loop, as drivers see it

    @property
    def log(self) -> list | None:
        return self.loop.log

    @log.setter
    def log(self, events: list | None) -> None:
        self.loop.log = events

    @property
    def intake(self):
        return self.loop.intake

    @property
    def dec(self):
        return self.loop.dec

    @property
    def pipeline(self):
        return self.loop.pipeline

    @property
    def graph(self):
        return self.loop.graph

    @property
    def vocab(self) -> int:
        return self.loop.vocab

    @property
    def sampling(self) -> bool:
        return self.loop.sampling

    @property
    def fields(self) -> bool:
        return self.loop.fields

    @property
    def active(self) -> int:
        return self.loop.active

    def stats(self) -> dict:
        return self.loop.stats()

    def _fail(self, exc: Exception):
        """Stop for good: record why, tell rank 0's server (``on_fatal``), raise a ParallelError."""
        first = self.fatal is None
        self.fatal = self.fatal or f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if first and self.on_fatal is not None:
            self.on_fatal()
        if isinstance(exc, ParallelError):
            raise exc
        raise ParallelError(f"rank {self.ctx.rank}: serving step failed: {self.fatal}") from exc

    # ------------------------------------------------------------------ rank 0

    def submit(self, req: Request, *, line: int | None = None, round_exit: bool = True) -> RequestState:
        state = self.loop.submit(req, line=line, round_exit=round_exit)
        if self.leader:
            try:
                # A snapshot now, as plain JSON values: a caller's later change to the request
                # (or its options dict) must not reach the followers, whatever rank 0 runs.
                wire = json.loads(json.dumps(_wire(state), default=_json_scalar))
            except (TypeError, ValueError) as exc:  # cannot reach the other ranks: refused like a bad field
                self.loop.withdraw(state)
                raise ValueError(f"options must be JSON values under --tp (they are sent to every rank): "
                                 f"{exc}") from None
            self._ops.append(["submit", wire])
        return state

    def request_round_exit(self) -> None:
        """:meth:`ServeLoop.request_round_exit` (the HTTP engine calls it on arrival): nothing under
        lockstep, whose loops never end bursts on the device."""
        self.loop.request_round_exit()

    def mark_intake(self) -> None:
        """:meth:`ServeLoop.mark_intake` (the HTTP engine calls it before taking arrivals): nothing
        under lockstep either."""
        self.loop.mark_intake()

    def cancel(self, state: RequestState) -> None:
        if self.leader and not state.done:
            self._ops.append(["cancel", state.request.id])
        self.loop.cancel(state)

    @property
    def idle(self) -> bool:
        """As ServeLoop's, but False on rank 0 when a heartbeat is due (the driver then steps)."""
        quiet = self.loop.idle
        if quiet and self.leader and time.monotonic() - self._last_sent >= self.heartbeat_s:
            return False
        return quiet

    def step(self) -> int:
        with self._stepping:  # finish() on another thread waits for this
            return self._step_in_lockstep()

    def _step_in_lockstep(self) -> int:
        if self.fatal is not None:
            raise ParallelError(f"rank {self.ctx.rank}: the lockstep loop stopped: {self.fatal}")
        if self.leader:
            try:
                self._send(PLAN)
            except ParallelError as exc:  # a follower is gone: nothing can run any more
                self._fail(exc)
        self.steps += 1
        if self.loop.idle:  # nothing to run: a heartbeat (the same step on every rank)
            self.idle_steps += 1
        try:
            # A failure the policy lets cost only its requests is recovered from inside; anything
            # else (one it does not, or a recovery's own failure: a prefill's collective) ends here.
            delivered = self.loop.step()
        except Exception as exc:  # noqa: BLE001 - whatever it was, the ranks may now be apart: stop
            self._fail(exc)
        self._after_step = self.fingerprint()
        return delivered

    def _send(self, kind: int) -> None:
        # The fingerprint as of the end of the last step: a follower compares it before applying these ops.
        ops, self._ops = self._ops, []
        self.channel.send(kind, ops, self._after_step)
        self._last_sent = time.monotonic()

    def fingerprint(self) -> tuple:
        """What every rank's schedule must agree on between steps."""
        loop = self.loop
        return (loop.bursts, len(loop.pipeline), loop.active, len(loop.intake), loop.tokens_out)

    def finish(self) -> None:
        """Rank 0: send the stop plan; every rank: drain the bursts still in flight (their checks included).

        Raises ParallelError if another thread is still inside :meth:`step` after the group
        timeout (rank 0's engine thread stuck on a hung peer): two threads must never drive
        the loop, its graph or the plan channel at once.
        """
        if not self._stepping.acquire(timeout=self.ctx.timeout_s):
            self._fail(RuntimeError(f"a step still runs after {self.ctx.timeout_s:g} s; not finishing"))
        try:
            if self.leader:
                self._send(STOP)
            pipeline = self.loop.pipeline
            while pipeline:
                pipeline.drain()  # runs each burst's rank check; nobody is left to hand tokens to
        finally:
            self._stepping.release()

    # ------------------------------------------------------------------ the other ranks

    def follow(self) -> None:
        """Apply rank 0's plans and step, until its stop plan; then :meth:`finish`."""
        from .check import RankDivergence

        loop = self.loop
        while True:
            kind, ops, theirs = self.channel.receive()
            ours = self.fingerprint()
            if theirs != ours:
                raise RankDivergence(f"rank {self.ctx.rank}: lockstep schedule diverged from rank 0 before step "
                                     f"{self.steps + 1}: (bursts, in flight, active, queued, tokens) = {ours}, "
                                     f"rank 0 has {theirs}")
            if kind == STOP:
                break
            for op, arg in ops:
                if op == "submit":
                    loop.submit(Request(**arg))
                elif op == "cancel":
                    state = loop.intake.lookup(arg)
                    if state is None:
                        raise RankDivergence(f"rank {self.ctx.rank}: rank 0 cancelled request {arg!r}, which is "
                                             f"not in flight here")
                    loop.cancel(state)
                else:
                    raise ParallelError(f"rank {self.ctx.rank}: unknown plan op {op!r} from rank 0")
            self.step()
        self.finish()

    def summary(self) -> str:
        s = self.stats()
        return (f"rank {self.ctx.rank}: {self.steps} steps ({self.idle_steps} idle), {s['bursts']} bursts, "
                f"{s['tokens']} tokens, rank check at {self.dec.check.bursts} drains")


def _json_scalar(value):
    """numpy scalars (valid ints and floats of a request) as Python numbers for JSON."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} {value!r} is not a JSON value")


def _wire(state) -> dict:
    """A submitted request as rank 0 sends it: ids and the drawn sampling seed filled in."""
    req = state.request
    wire = {f: getattr(req, f) for f in WIRE_FIELDS}
    wire["prompt"] = [int(t) for t in req.prompt]
    if state.sampling is not None and state.sampling.temperature > 0:
        wire["seed"] = state.sampling.seed  # drawn at random on rank 0 when the request had none
    return wire
