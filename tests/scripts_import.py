"""Import a module of ``scripts/`` (not a package) in a test: the tests of the profiling and
benchmark scripts share this. ``from scripts_import import import_script`` (pytest puts tests/
on the path)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def import_script(name: str):
    """``scripts/<name>.py`` as a module; scripts/ is on the path only while it imports (a script
    may import its siblings, as profile_forward imports tp_floor)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPTS))
