"""scripts/profile_forward.py on the CPU: the bytes floor against the issue's figures, and the table
renders every record kind (a profiled record once broke it after the measurements were taken)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from rich.console import Console

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def pf():
    sys.path.insert(0, str(SCRIPTS))  # profile_forward imports its sibling tp_floor
    try:
        import profile_forward
    finally:
        sys.path.remove(str(SCRIPTS))
    return profile_forward


@pytest.mark.parametrize("b,t,want", [(1, 1, 518), (1, 5, 519), (64, 1, 739), (64, 5, 741)])
def test_floor_is_the_issues(pf, b, t, want):
    """Issue 20's floors: (weights + valid KV read + KV written) / 4.8 TB/s for the 1b shape, 512 valid rows."""
    import torch

    from graphburst.bench.real_models import MODELS
    from graphburst.models.llama import Llama

    cfg = MODELS["1b"].cfg
    with torch.device("meta"):
        model = Llama(cfg.replace(num_hidden_layers=cfg.num_hidden_layers), batch=1, capacity=16, device="meta")
    wbytes = sum(p.numel() * 2 for p in model.parameters())  # bf16
    assert pf.floor_us(cfg, wbytes, b, t, 512, 2) == pytest.approx(want, rel=0.01)


def test_table_renders_every_record(pf):
    plain = {"shape": "1b", "batch": 1, "T": 5, "capacity": 1024, "valid": 512, "attention": "gqa", "path": "fused",
             "graph_us": 700.0, "floor_us": 519.0, "x_floor": 1.35, "check_rel_diff": 0.01}
    profiled = {**plain, "path": "sdpa", "kernel_sum_us": 650.0, "kernels": 290, "per_layer": 18.1,
                "nongemm_per_layer_us": 9.5, "top": [("nvjet", 4, 100.0)]}
    console = Console(width=160, record=True)
    console.print(pf.table_of([plain, profiled]))
    text = console.export_text()
    assert "fused" in text and "sdpa" in text and "9.5" in text
