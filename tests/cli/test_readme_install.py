"""The README's CPU torch install works on an ordinary machine: PyPI has no ``+cpu`` build, so the command
names PyTorch's CPU index and a version that index serves, the same in the prose, the test command and
``.ci/run``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def _torch_installs(text: str) -> list[str]:
    """Every ``pip install ... torch==...`` command in ``text`` (one per line, up to its ``&&`` or backtick)."""
    return [m.group(0) for m in re.finditer(r"pip install [^`&\n]*\"torch==[^\"]+\"", text)]


def test_the_readme_cpu_torch_installs_name_the_cpu_index_and_one_version():
    readme = (ROOT / "README.md").read_text()
    installs = _torch_installs(readme)
    assert len(installs) == 2, installs  # the prose line and the test command
    for cmd in installs:
        assert CPU_INDEX in cmd, cmd  # the public index has no torch+cpu: a bare pin fails there
        assert "+cpu" not in cmd, cmd  # the CPU index's Linux wheels are +cpu, its macOS ones plain: "==X" finds both
        assert "--no-deps" in cmd, cmd  # one look-up of the CPU index; the dependencies come with the next install
    versions = {re.search(r"torch==([^\"]+)", c).group(1) for c in installs}
    (version,) = versions
    fresh = [x for x in readme.splitlines() if x.startswith("python3 -m venv")]
    assert any(_torch_installs(x) and 'pip install ".[test]"' in x for x in fresh), fresh
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"\"torch=={re.escape(version)}(\+cpu)?\"", ci), "the CI installs another torch"
