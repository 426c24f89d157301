"""The text of ``kernels.cu`` as it is compiled: needs no cupy, so CPU tests read it too."""

from __future__ import annotations

import re
from pathlib import Path

KERNEL_SOURCE = Path(__file__).parents[1] / "kernels.cu"
_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.M)


def kernel_source(path: Path = KERNEL_SOURCE) -> str:
    """``kernels.cu`` with its local ``#include "..."`` sections inlined, each once.

    NVRTC could follow the includes itself (``-I``), but CuPy's compile cache keys on the
    source text and options only: a changed section would then reuse a stale binary.
    Inlining makes the key cover every line that is compiled.
    """
    seen: set[Path] = set()

    def expand(p: Path) -> str:
        def inline(m):
            inc = (p.parent / m.group(1)).resolve()
            if inc in seen:  # what #pragma once does for nvcc
                return ""
            seen.add(inc)
            return expand(inc)

        return _INCLUDE.sub(inline, p.read_text()).replace("#pragma once\n", "")

    return expand(path)
