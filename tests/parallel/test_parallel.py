"""Parallel bursts on CPU: 2 processes (torchrun), gloo, the numpy backend (tests/parallel/parallel_worker.py).

TP=2 and PP=2 tokens equal TP=1's on the same fp32 weights over 10 bursts of a ragged
batch; the stage-local tables; the rank check, with a rank made to diverge; mismatched
models across ranks; a rank that raises; layouts rejected before any process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch.distributed as tdist  # noqa: E402

from graphburst.parallel.dist import Layout, check_layout  # noqa: E402
from graphburst.parallel.models import TINY  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "parallel" / "parallel_worker.py"
pytestmark = pytest.mark.skipif(not tdist.is_available() or not tdist.is_gloo_available(), reason="needs gloo")


def launch(scenario: str, out: Path, timeout: float = 90.0, **env_extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GB_TEST_TIMEOUT": "20", **env_extra}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           scenario, str(out)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
             for r in range(2)]
    return proc, ranks, time.monotonic() - t0


def test_tp2_and_pp2_tokens_equal_tp1_with_stage_local_tables(tmp_path):
    proc, ranks, _ = launch("tokens", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for res in ranks:
        assert res["ref_tokens"] > 200  # 10 bursts of 3 sequences, several tokens per round
        for name in ("tp2", "tp2_sharded_draft", "pp2"):
            assert res[name]["equal"], (res["rank"], name)
            assert res[name]["checks"] == 10  # the rank check ran at every drain
            assert res[name]["host_syncs"] == 10  # one per burst, the check included
        stage = res["pp2"]["stage"]
        r = res["rank"]
        assert stage["own"] == [2 * r, 2 * r + 2]
        assert stage["table_is_stage_local"] and stage["table_len"] == 2 + 1 + 1  # own layers, draft, pos_ctr
        assert stage["absent"] == ([2, 3] if r == 0 else [0, 1])
        for lengths in stage["own_lengths"]:  # every own layer rolled back to the committed position
            assert lengths == stage["pos_ctr"]
        assert res["shutdown_clean"]
    assert ranks[0]["pp2"]["stage"]["pos_ctr"] == ranks[1]["pp2"]["stage"]["pos_ctr"]


def test_tp2_and_pp2_shard_every_architecture_switch(tmp_path):
    """q/k/v biases, per-head q/k norms and head_dim != hidden/heads (Qwen2, Qwen3): TP and PP equal TP=1."""
    proc, ranks, _ = launch("tokens", tmp_path, GB_TEST_SWITCHES="1", GB_TEST_BURSTS="3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for res in ranks:
        for name in ("tp2", "tp2_sharded_draft", "pp2"):
            assert res[name]["equal"], (res["rank"], name)


def test_a_diverging_rank_fails_the_check_on_every_rank(tmp_path):
    proc, ranks, _ = launch("diverge", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for res in ranks:
        assert res["raised"] is not None
        assert "rank(s) [1] diverged from rank 0 in burst 3" in res["raised"]


def test_mismatched_models_across_ranks_are_rejected_before_model_collectives(tmp_path):
    proc, ranks, _ = launch("mismatch", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for res in ranks:
        assert res["raised"] and "rank(s) [1] disagree with rank 0" in res["raised"]


def test_a_rank_that_raises_stops_the_other_with_a_clear_error(tmp_path):
    proc, ranks, wall = launch("raise", tmp_path, timeout=60, GB_TEST_LINGER_S="5")
    assert proc.returncode != 0
    assert "rank 1 failed: ValueError: injected failure on rank 1" in proc.stderr
    assert "rank 0 failed: ParallelError: rank 0: burst 3 failed in a collective" in proc.stderr
    assert wall < 45  # bounded: no one waits for the group timeout of a hung peer forever


def test_lockstep_a_follower_whose_schedule_differs_stops_before_any_collective(tmp_path):
    # Rank 0 learns of it only when its next plan times out: a short group timeout keeps that wait short.
    proc, ranks, wall = launch("lockstep_schedule_diverges", tmp_path, GB_TEST_TIMEOUT="8")
    assert ranks[1] is not None, proc.stderr[-3000:]
    assert ranks[1]["raised"].startswith("RankDivergence: rank 1: lockstep schedule diverged from rank 0 before "
                                         "step 1"), ranks[1]
    assert "queued" in ranks[1]["raised"]
    if ranks[0] is not None and ranks[0]["raised"] is not None:  # rank 0 notices when its next plan cannot go out
        assert "ParallelError" in ranks[0]["raised"], ranks[0]
    assert wall < 80


def test_lockstep_a_prefill_failure_that_is_not_the_requests_stops_every_rank(tmp_path):
    """A RuntimeError in prefill (a collective failing) must not be served on as a per-request
    error under --tp: the ranks may be apart. The request still finishes, with the error."""
    proc, ranks, _ = launch("lockstep_prefill_fails", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for res in ranks:
        assert res["raised"] and "injected collective failure" in res["raised"], res
        assert res["raised"].startswith("ParallelError") and res["fatal"].startswith("RuntimeError")
    assert ranks[0]["request"]["done"] and "injected collective failure on rank 0" in ranks[0]["request"]["error"]


@pytest.mark.parametrize("layout, field", [(Layout(tp=3), "num_attention_heads"), (Layout(tp=4), "num_key_value_heads"),
                                           (Layout(pp=3), "num_hidden_layers")])
def test_bad_layouts_are_rejected_before_any_process_group(layout, field):
    with pytest.raises(ValueError, match=field):
        check_layout(TINY, layout)
    assert not tdist.is_initialized()


def test_world_size_must_match_the_layout():
    with pytest.raises(ValueError, match="nproc_per_node 2"):
        check_layout(TINY, Layout(tp=2), world_size=4)
    with pytest.raises(ValueError, match="not supported yet"):
        check_layout(TINY, Layout(tp=2, pp=2))
    cfg = TINY.replace(intermediate_size=129)
    with pytest.raises(ValueError, match="intermediate_size"):
        check_layout(cfg, Layout(tp=2))


def _demo(*flags, nproc=2, timeout=90):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m",
           "graphburst", "demo", "--model", "tiny-random", "--backend", "numpy", "--bursts", "2", *flags]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flag", ["--tp", "--pp"])
def test_demo_under_torchrun_matches_the_one_process_greedy(flag):
    proc = _demo(flag, "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("tp2" if flag == "--tp" else "pp2") in proc.stdout
    assert "NO" not in proc.stdout and proc.stdout.count("yes") == 4
    assert "1.0 per burst per rank" in proc.stdout


def test_demo_rejects_a_layout_the_model_cannot_take_before_any_group():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    alone = subprocess.run([sys.executable, "-m", "graphburst", "demo", "--model", "tiny-random", "--tp", "2",
                            "--backend", "numpy"], env=env, capture_output=True, text=True, timeout=60)
    assert alone.returncode == 2 and "launch with torchrun --nproc_per_node 2" in alone.stderr  # not torchrun
    assert "Traceback" not in alone.stderr
    one = subprocess.run([sys.executable, "-m", "graphburst", "demo", "--model", "tiny-random", "--pp", "3",
                          "--backend", "numpy"], env={**env, "WORLD_SIZE": "3"}, capture_output=True, text=True,
                         timeout=60)
    assert one.returncode == 2 and "pp=3 does not divide the model's num_hidden_layers (4)" in one.stderr
    assert "Traceback" not in one.stderr


@pytest.mark.parametrize("stage", [0, 1])
def test_stage_table_holds_only_the_stages_layers(stage):
    """In one process, no collective: a stage's decoder rolls back its own target layers,
    the draft's and pos_ctr, through kv_len_ptr_table_range; a recapture keeps it local."""
    import torch

    from graphburst.backend import Backend
    from graphburst.parallel.dist import Context
    from graphburst.parallel.models import random_pair
    from graphburst.parallel.runner import ParallelDecoder, build_pair

    cfg = TINY.replace(num_hidden_layers=6)
    ctx = Context(rank=stage, world=2, local_rank=stage, backend="gloo", device=torch.device("cpu"), timeout_s=5)
    t, d = random_pair(cfg, batch=1, capacity=16, seed=1)
    target, draft = build_pair(t, d, ctx, Layout(pp=2), batch=2, capacity=64, backend=Backend("numpy"))
    dec = ParallelDecoder(target, draft, ctx, k=2, m_rounds=2)
    own = range(3 * stage, 3 * stage + 3)
    assert [i for i, ly in enumerate(target.cache.layers) if ly is not None] == list(own)
    want = [target.cache.layers[i].length for i in own] + [ly.length for ly in draft.cache.layers] + [dec.bufs.pos_ctr]
    for _ in range(2):
        assert len(dec.table) == 3 + 1 + 1
        assert all(a is b for a, b in zip(dec.table.resolve(), want))
        dec.refresh_tables()
    # The stage's blocks are the whole model's layers own.start.. (weights copied, not re-drawn).
    got = target.module.inner.layers[0].mlp.down_proj.weight
    assert torch.equal(got, t.layers[own.start].mlp.down_proj.weight)


def test_a_draft_that_cannot_be_sharded_is_refused_naming_the_flag():
    from graphburst.cli_args import FlagError
    from graphburst.parallel.launch import check_draft

    odd = TINY.replace(num_attention_heads=3, num_key_value_heads=1, head_dim=16)
    with pytest.raises(FlagError, match=r"tp=2 does not divide the model's num_attention_heads \(3\); pass "
                                        r"--draft-mode replicated"):
        check_draft(odd, 2, "sharded")
    check_draft(odd, 2, "replicated")  # whole on every rank: nothing to divide
    check_draft(TINY, 2, "sharded")
    check_draft(None, 2, "sharded")  # tiny-random's own draft


def test_near_tie_rule_on_hand_made_logits():
    import torch

    from graphburst.models.parity import compare_tokens, describe

    logits = torch.tensor([3.0, 2.995, 1.0, -4.0])  # tokens 0 and 1 nearly tie; 2 is far behind
    seen = []

    def after(prefix):
        seen.append(prefix)
        return logits

    same = compare_tokens([7, 0, 5], [7, 0, 5, 9], after, 0.01)  # a prefix of the reference: no divergence
    assert same == dict(compared=3, agreed=3, divergence=None, ok=True) and not seen
    assert describe(same) == "all 3"
    tie = compare_tokens([7, 1, 4], [7, 0, 5], after, 0.01)
    assert tie["ok"] and tie["agreed"] == 1 and seen == [[7]]  # the logits after the agreed prefix
    assert tie["divergence"]["theirs"] == 1 and tie["divergence"]["ours"] == 0
    assert describe(tie) == "token 1: 1 vs 0, gap 0.0050 <= 0.0300 (near-tie)"
    far = compare_tokens([7, 2], [7, 0], after, 0.01)
    assert not far["ok"] and describe(far).endswith("gap 2.0000 > 0.0300 (NOT a near-tie)")
    assert not compare_tokens([7, 1], [7, 0], after, 1e-4)["ok"]  # fp32's tolerance is tighter


def test_parallel_demo_check_passes_a_flipped_near_tie_and_fails_a_real_divergence():
    # What the multi-GPU demo's rank 0 runs against the whole target: a run that took the
    # runner-up token at a divergence passes only when the margin there is a near-tie.
    import torch

    from graphburst.models.checkpoint import tiny_random_pair
    from graphburst.models.parity import teacher_forced_logits
    from graphburst.parallel.launch import compare_to_greedy

    full = tiny_random_pair(batch=1, capacity=64, backend="numpy")[0].module
    prompt = [3, 14, 15, 92]
    greedy = full.greedy(prompt, 6)
    logits = teacher_forced_logits(full, prompt, greedy[:2])
    top2 = torch.topk(logits, 2)
    assert int(top2.indices[0]) == greedy[2]
    flipped = greedy[:2] + [int(top2.indices[1])] + [0, 0]  # the runner-up at token 2, then anything
    gap = float(top2.values[0] - top2.values[1])
    bound = max(1.0, abs(float(top2.values[0])))
    same, tie = compare_to_greedy([greedy, flipped], [prompt] * 2, full, tol=1.01 * gap / bound)
    assert same["ok"] and same["divergence"] is None and same["agreed"] == 6
    assert tie["ok"] and tie["agreed"] == 2 and tie["divergence"]["at"] == 2
    [strict] = compare_to_greedy([flipped], [prompt], full, tol=0.99 * gap / bound)
    assert not strict["ok"] and strict["agreed"] == 2
