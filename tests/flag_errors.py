"""The one helper the command-line tests share: a command refused at its flags.

Import it with ``from flag_errors import flag_error`` (pytest puts tests/ on the path).
"""

from __future__ import annotations

import pytest

from graphburst import cli


def flag_error(capsys, *argv) -> str:
    """The one stderr line of a command refused at its flags (exit 2, nothing run)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert exc.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]
