"""Import a module of ``scripts/`` or ``tools/`` (folders, not packages) in a test: the tests of the
benchmark scripts and the maintainers' tools share this. ``from scripts_import import import_script``
(pytest puts tests/ on the path)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_script(name: str, folder: str = "scripts"):
    """``<folder>/<name>.py`` as a module; the folder is on the path only while it imports (a script
    may import its siblings)."""
    where = str(ROOT / folder)
    sys.path.insert(0, where)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(where)
