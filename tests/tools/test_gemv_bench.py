"""tools/gemv_bench.py on the CPU: its shapes, the sweep's candidates, the per-bucket choice and the
CONFIGS literal it prints (pasted into models/decode/gemv.py), and the table."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest
from rich.console import Console

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gemv_bench.py"


@pytest.fixture(scope="module")
def gb():
    """tools/gemv_bench.py as a module (tools/ is a folder of scripts, not a package)."""
    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location("gemv_bench", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shapes_and_configs_cover_them(gb):
    """The 1b and 8b projections (N, K) are the models' shapes, and CONFIGS holds a tiling for each one's bucket."""
    from graphburst.models.decode.gemv import CONFIGS

    assert gb.projections("1b") == [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048),
                                    ("down", 2048, 8192), ("head", 128256, 2048)]
    assert gb.projections("8b")[0] == ("qkv", 6144, 4096) and gb.projections("8b")[3] == ("down", 4096, 14336)
    keys = {gb.bucket(n, k) for name in gb.SHAPES for _, n, k in gb.projections(name)}
    assert keys == set(CONFIGS), keys ^ set(CONFIGS)


@pytest.mark.parametrize("n,k", [(2048, 2048), (128256, 4096), (96, 257)])
def test_candidates_are_valid_tilings(gb, n, k):
    from graphburst.models.decode.gemv import default_config

    cands = gb.candidates(n, k, 132)
    assert len(cands) == len(set(cands)) and len(cands) <= 3 * 12
    for c in cands:
        assert c.block_n & (c.block_n - 1) == 0 and c.block_k & (c.block_k - 1) == 0
        assert 1 <= c.split_k <= -(-k // c.block_k)
    base = default_config(n, k, 132)
    assert any(c.block_n == base.block_n and c.block_k == base.block_k and c.split_k == base.split_k for c in cands)


def test_choice_and_literal_round_trip(gb):
    """A bucket takes the least summed time among tilings that ran at every swept M (not a faster one that
    failed at one M); the printed literal evaluates back to the same dict."""
    from graphburst.models.decode.gemv import GemvConfig

    a, b, c = GemvConfig(32, 256, 4, 4), GemvConfig(16, 512, 8, 2), GemvConfig(64, 256, 4, 1)
    sweeps = {(2048, 2048): {a: [5.0, 6.0], b: [4.0, 7.5], c: [1.0]}, (4096, 2048): {c: [3.0]}}
    best = gb.choose(sweeps, {(2048, 2048): 2, (4096, 2048): 1})
    assert best == {(2048, 2048): a, (4096, 2048): c}
    ns = {"GemvConfig": GemvConfig}
    exec(gb.configs_literal(best), ns)
    assert ns["CONFIGS"] == best


def test_table_renders_every_status(gb):
    ok = {"us": 10.0, "status": "ok", "GB/s": 800.0}
    rows = [{"shape": "1b", "proj": "o", "N": 2048, "K": 2048, "M": 1, "cublas": ok,
             "gemv": {"us": None, "status": "not run: OutOfResources: shared memory", "GB/s": None},
             "gemv_dot_at_m1": {"us": 12.0, "status": "ok"}},
            {"shape": "1b", "proj": "o", "N": 2048, "K": 2048, "M": 5, "cublas": ok, "gemv": ok,
             "best": {"config": [32, 256, 4, 4, 3], "us": 4.0, "GB/s": 2100.0}}]
    out = io.StringIO()
    Console(file=out, width=200).print(gb.table_of(rows))
    text = out.getvalue()
    assert "not run" in text and "(32, 256, 4, 4, 3)" in text and "1.00" in text
