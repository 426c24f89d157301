"""scripts/prefill_profile.py on the CPU: every case runs and checks its first tokens, and the check can fail."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scripts_import import import_script


@pytest.fixture(scope="module")
def pp():
    return import_script("prefill_profile")


def test_cases_run_checked_and_write_json(pp, tmp_path):
    out = tmp_path / "p.json"
    pp.main(["--backend", "numpy", "--model", "tiny", "--cases", "3", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["prefill"] == "eager" and res["backend"] == "numpy"  # no graphs on the CPU by default
    assert [r["case"] for r in res["results"]] == ["1 x 128", "1 x 512", "4 x 128"]
    assert [r["tokens"] for r in res["results"]] == [128, 512, 512]
    assert all(r["host_ms"] > 0 and r["gpu_ms"] is None for r in res["results"])


def test_a_wrong_first_token_is_caught(pp):
    from graphburst.backend import get_backend

    dec = pp.build("tiny", get_backend("numpy"), eager=True, dtype="float32")
    rows = {3: np.arange(1, 20, dtype=np.int32)}
    dec.prefill_checked(rows, {3: 0}, limits={3: 5})
    pp._check_first_tokens(dec, rows, 1e-4)  # right as prefilled
    dec.bufs.pend[3] = (int(dec.bufs.pend[3]) + 1) % dec.target.vocab
    with pytest.raises(AssertionError, match="slot 3"):
        pp._check_first_tokens(dec, rows, 1e-4)
