"""scripts/admission_warmup.py: a small checked run on numpy (warm and cold loops, the same tokens)."""

from __future__ import annotations

import json

from scripts_import import import_script

admission_warmup = import_script("admission_warmup")


def test_prompts_span_the_width_buckets():
    sizes = [len(p) for p in admission_warmup.workload(200, 400)]
    assert min(sizes) >= 1 and max(sizes) <= 400
    assert min(sizes) < 16 and max(sizes) > 256  # log-uniform: short and long prompts both


def test_a_small_run_on_numpy_captures_nothing_while_warm(tmp_path, capsys):
    out = tmp_path / "warm.json"
    got = admission_warmup.main(["--backend", "numpy", "--repeats", "1", "--requests", "24", "--batch", "4",
                                 "--capacity", "512", "--longest", "400", "--new", "9", "-m", "2", "--json", str(out)])
    rows = {r["kind"]: r for r in got["rows"]}
    assert rows["warm"]["captures_in_window"] == 0 and rows["cold"]["captures_in_window"] > 0
    assert [w for w, _ in got["capture_ms"]] == [16, 32, 64, 128, 256, 512]
    assert "captured at construction (warm) or first use (cold)" in capsys.readouterr().out
    assert json.loads(out.read_text())["runs"] == got["runs"]
