"""Parallel bursts on 2 GPUs of one host: NCCL inside the torch-captured burst graphs.

The same worker as the CPU tests (tests/parallel/parallel_worker.py) with ``GB_TEST_GPU=1``:
TP=2 (replicated and sharded draft) and PP=2 tokens equal TP=1 on the same fp32 weights
over 50 bursts of a ragged batch, both ranks agreeing at every drain; a diverging rank
fails the check; a rank that raises stops the other within a bounded time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu]
ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "parallel" / "parallel_worker.py"


def _two_gpus() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


needs_two = pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices of one host")


def launch(scenario: str, out: Path, bursts: int = 50, timeout: float = 150.0, **extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GB_TEST_GPU": "1", "GB_TEST_BURSTS": str(bursts),
           "GB_TEST_TIMEOUT": "60", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", **extra}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           scenario, str(out)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
             for r in range(2)]
    return proc, ranks, time.monotonic() - t0


@needs_two
def test_gpu_tp2_pp2_tokens_equal_tp1_over_50_bursts(tmp_path):
    proc, ranks, _ = launch("tokens", tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for res in ranks:
        assert res["ref_tokens"] > 50 * 3
        for name in ("tp2", "tp2_sharded_draft", "pp2"):
            assert res[name]["equal"], (res["rank"], name)
            assert res[name]["checks"] == 50 and res[name]["host_syncs"] == 50
            info = res[name]["graph"]
            assert info["backend"] == "cupy" and info["capture_api"] == "torch" and info["host_syncs_per_burst"] == 1
        assert res["pp2"]["stage"]["table_is_stage_local"]
        for lengths in res["pp2"]["stage"]["own_lengths"]:
            assert lengths == res["pp2"]["stage"]["pos_ctr"]
        assert res["shutdown_clean"]


@needs_two
def test_gpu_diverging_rank_fails_the_check(tmp_path):
    proc, ranks, _ = launch("diverge", tmp_path, bursts=6)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for res in ranks:
        assert res["raised"] and "rank(s) [1] diverged from rank 0 in burst 3" in res["raised"]


@needs_two
def test_gpu_raising_rank_stops_the_other(tmp_path):
    proc, _, wall = launch("raise", tmp_path, bursts=6, timeout=120)
    assert proc.returncode != 0
    assert "rank 1 failed: ValueError: injected failure on rank 1" in proc.stderr
    assert wall < 100  # torchrun stops the survivor; the NCCL watchdog bounds it otherwise (60 s)


@needs_two
def test_gpu_peer_dying_mid_graph_bounds_the_drain_wait(tmp_path):
    """Rank 1 exits (code 0, so torchrun leaves rank 0 alone) before burst 3; rank 0 replays burst 3,
    whose NCCL collectives wait forever inside the graph (no watchdog sees them); the drain's
    bounded wait raises ParallelError after GB_TEST_DRAIN_TIMEOUT and rank 0 exits 1."""
    proc, _, wall = launch("die", tmp_path, bursts=6, timeout=120, GB_TEST_TIMEOUT="20", GB_TEST_DRAIN_TIMEOUT="5")
    assert proc.returncode != 0
    assert "rank 1: dying before burst 3" in proc.stderr
    assert ("rank 0 failed: ParallelError: rank 0: burst 3 (waiting at drain for its graph) did not finish within "
            "5 s") in proc.stderr, proc.stderr[-4000:]
    assert wall < 60  # 5 s of waiting, then a teardown that skips the device sync
