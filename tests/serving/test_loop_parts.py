"""The serving loop's parts and its hook protocol: each part reads only what it defines or is
given (no attribute of another class through ``self``), and a loop's policy is checked when the
loop is built and decides what it says it decides."""

from __future__ import annotations

import ast
import inspect
import types

import pytest

from graphburst import greedy_reference, stub_pair
from graphburst.serving import admit, delivery, first_tokens, loop as loop_module, slot_table
from graphburst.serving.events import LoopRecord
from graphburst.serving.loop import ServeLoop
from graphburst.serving.policy import LocalPolicy, LoopPolicy
from graphburst.serving.request import Request

VOCAB = 997
PART_MODULES = (admit, delivery, first_tokens, loop_module, slot_table)


def _defined(cls) -> set:
    """Names a class defines for ``self``: its members (those of its bases too), ``__slots__``,
    and every ``self.X = ...`` (plain, tuple or augmented) in its methods."""
    names = {n for klass in cls.__mro__ for n in vars(klass)} | set(getattr(cls, "__slots__", ()))
    tree = ast.parse(inspect.getsource(cls))
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    names.add(leaf.attr)
    return names


def _read(cls) -> set:
    """Every ``self.X`` a class's methods read."""
    tree = ast.parse(inspect.getsource(cls))
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "self" and isinstance(node.ctx, ast.Load)}


def _classes():
    return [cls for module in PART_MODULES for _, cls in inspect.getmembers(module, inspect.isclass)
            if cls.__module__ == module.__name__]


@pytest.mark.parametrize("cls", _classes(), ids=lambda cls: cls.__qualname__)
def test_a_part_reads_only_what_it_defines_through_self(cls):
    # A mixin that reads what another class sets on ``self`` fails here: its reads are not its own.
    foreign = _read(cls) - _defined(cls)
    assert not foreign, f"{cls.__qualname__} reads {sorted(foreign)} through self, defined by no code of its own"


def test_the_parts_share_one_slot_table_and_one_record():
    target, draft = stub_pair(2, VOCAB, 2, 1, 64, backend="numpy")
    loop = ServeLoop(target, draft, k=3, m_rounds=2)
    for part in (loop.boundary, loop.first_tokens, loop.delivery):
        assert part.table is loop.table
    assert loop.boundary.record is loop.first_tokens.record is loop.delivery.record is loop.record
    assert isinstance(loop.record, LoopRecord) and isinstance(loop.policy, LocalPolicy)
    loop.log = events = []
    state = loop.submit(Request([3, 1], 9))
    loop.run_until_idle()
    assert loop.record.log is events and events  # the parts appended to the consumer's list
    assert loop.bursts == loop.record.bursts > 0 and loop.tokens_out == 9
    assert state.tokens == greedy_reference([3, 1], 9, VOCAB)


def test_a_plain_loop_has_no_heartbeat():
    target, draft = stub_pair(2, VOCAB, 2, 1, 64, backend="numpy")
    assert ServeLoop(target, draft, k=3, m_rounds=2).heartbeat_s is None


def test_a_policy_is_checked_when_the_loop_is_built():
    target, draft = stub_pair(2, VOCAB, 2, 1, 64, backend="numpy")
    with pytest.raises(TypeError, match=r"policy must be a LoopPolicy, got SimpleNamespace \(it lacks .*make_graph"):
        ServeLoop(target, draft, k=3, m_rounds=2, policy=types.SimpleNamespace(heartbeat_s=None))
    beating = type("Beating", (LocalPolicy,), {"heartbeat_s": 0.0})()
    with pytest.raises(ValueError, match="policy.heartbeat_s must be None or > 0, got 0.0"):
        ServeLoop(target, draft, k=3, m_rounds=2, policy=beating)
    assert isinstance(LocalPolicy(), LoopPolicy)


class _NoLocalTiming(LocalPolicy):
    local_timing = False
    early_first_tokens = False
    heartbeat_s = 0.25


def test_a_policy_without_local_timing_admits_late_and_never_defers():
    target, draft = stub_pair(2, VOCAB, 2, 1, 64, backend="numpy")
    with pytest.raises(ValueError, match="admission='early' needs a loop whose admission may follow its own timings"):
        ServeLoop(target, draft, k=3, m_rounds=2, admission="early", policy=_NoLocalTiming())
    loop = ServeLoop(target, draft, k=3, m_rounds=2, depth=3, policy=_NoLocalTiming())
    assert loop.schedule.mode == "late" and loop.heartbeat_s == 0.25
    schedule = loop.schedule
    for _ in range(admit.COALESCE_AFTER):
        schedule.note_admission(0.3)
    schedule.admitted_at = loop.pipeline.launched
    loop.pipeline.burst_ms = 0.1  # host-bound: a local loop would defer (test_coalesce.py)
    assert not schedule.defer_boundary() and not schedule.admit_early()
    loop.pipeline.burst_ms = 1e9  # bursts far longer than admissions: a local loop would admit early
    assert not schedule.admit_early() and not schedule.copy_first_tokens()
    states = [loop.submit(Request([4 + i], 12)) for i in range(3)]
    loop.run_until_idle()
    for s in states:
        assert s.tokens == greedy_reference(s.request.prompt, 12, VOCAB)
        assert s.deliveries[0][1] > 1  # no early first token: it came with the first burst


class _Unrecoverable(LocalPolicy):
    def costs_only_its_requests(self, exc):
        return False


def test_a_failure_the_policy_will_not_recover_from_is_raised_after_freeing_its_requests():
    target, draft = stub_pair(2, VOCAB, 2, 1, 64, backend="numpy")
    loop = ServeLoop(target, draft, k=3, m_rounds=2, policy=_Unrecoverable())

    def broken(*a, **kw):
        raise RuntimeError("injected prefill failure")

    loop.dec.prefill_slots = broken
    state = loop.submit(Request([5], 6))
    with pytest.raises(RuntimeError, match="injected prefill failure"):
        loop.step()
    assert state.done and state.error == "RuntimeError: injected prefill failure" and loop.errors == 1
    assert loop.active == 0 and loop.table.n_stale == 0
    # a local loop recovers from the same failure: the request fails, the loop serves on
    target, draft = stub_pair(2, VOCAB, 2, 1, 64, backend="numpy")
    plain = ServeLoop(target, draft, k=3, m_rounds=2)
    plain.dec.prefill_slots = broken
    failed = plain.submit(Request([5], 6))
    assert plain.step() == 0 and failed.error == "RuntimeError: injected prefill failure"


def test_a_loop_is_freed_by_reference_counting():
    """No cycle among the loop and its parts: a dead loop's graphs must not wait for the cyclic
    collector, which could free them inside a later loop's capture."""
    import gc
    import weakref

    target, draft = stub_pair(2, VOCAB, 2, 1, 64, backend="numpy")
    enabled = gc.isenabled()
    gc.disable()
    try:
        loop = ServeLoop(target, draft, k=3, m_rounds=2)
        loop.log = []
        loop.submit(Request([3, 1], 9))
        loop.run_until_idle()
        refs = [weakref.ref(obj) for obj in (loop, loop.dec, loop.graph, loop.boundary, loop.delivery)]
        del loop
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        if enabled:
            gc.enable()
