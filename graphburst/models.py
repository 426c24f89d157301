"""Compatibility re-exports only (no logic): the protocol lives in :mod:`graphburst.protocol`,
the stubs in :mod:`graphburst.stubs`. Kept while serve.py, serve_cli.py and cli.py import
from here; new code imports from those two modules."""

from .protocol import DraftModel, TargetModel, check_pair
from .stubs import StubDraft, StubTarget, normalize_layout, stub_pair

__all__ = ["DraftModel", "StubDraft", "StubTarget", "TargetModel", "check_pair", "normalize_layout", "stub_pair"]
