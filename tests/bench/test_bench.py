"""``graphburst bench {latency,serve,capture}`` run as a user runs them, on numpy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphburst.bench.common import check_greedy, random_prompts
from graphburst.kernels.digest import greedy_reference

ROOT = Path(__file__).resolve().parents[2]


def bench(*args, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "graphburst.cli", "bench", *args, "--backend", "numpy",
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_bench_capture_on_numpy(tmp_path):
    res = bench("capture", tmp_path=tmp_path)
    assert res["meta"]["backend"] == "numpy" and "CPU REFERENCE" in res["meta"]["label"]
    assert res["results"]["guard_check_ns"] > 0
    assert res["results"]["device_exit_rounds"] == 8  # the stub prompt has budget left: all M rounds run
    # five checked bursts of 8 rounds commit between 1 and k + 1 tokens a round, the same with draft caps
    assert 5 * 8 <= res["results"]["draft_caps_tokens"] <= 5 * 8 * 5
    assert "burst_us_draft_caps" not in res["results"]  # no CUDA events on numpy: absent, never made up


def test_bench_serve_on_numpy(tmp_path):
    res = bench("serve", "--num-requests", "3", "--new-tokens", "5", "--refill-requests", "70", "--pipeline-depth",
                "2", "4", tmp_path=tmp_path)
    burst = [r for r in res["results"] if r["workload"] == "burst"]
    refill = [r for r in res["results"] if r["workload"] == "refill"]
    assert [r["tokens"] for r in burst] == [15] * 6
    assert [(r["engine"], r["tokens"]) for r in refill] == [("graph pipelined", 350)] * 2 + [
        ("graph pipelined depth 4", 350)] * 2  # 70 requests > 64 slots, per stub cost and depth
    # numpy has no GPU timing: both idle figures are absent, never made up
    assert all(r["gpu_idle_fraction"] is None and r["gpu_idle_fraction_steady"] is None for r in res["results"])


def test_bench_serve_takes_the_loop_shape(tmp_path):
    """--batch, -k and -m shape the stubs' loop (they were once ignored: -m 16 ran M=8)."""
    res = bench("serve", "--num-requests", "2", "--new-tokens", "5", "--refill-requests", "9", "--batch", "4",
                "-k", "2", "-m", "16", tmp_path=tmp_path)
    assert res["meta"]["m"] == 16 and res["meta"]["k"] == 2 and res["meta"]["batch"] == 4
    assert all((r["batch"], r["k"], r["m"]) == (4, 2, 16) for r in res["results"])
    refill = [r for r in res["results"] if r["workload"] == "refill"]
    # 9 requests through 4 slots, 5 tokens each, per stub cost; one burst of M=16 rounds serves a slot's 5 tokens
    assert [r["tokens"] for r in refill] == [45, 45]
    assert all(r["bursts"] >= 3 for r in refill)  # three waves of admissions at the least


def test_bench_serve_http_on_numpy(tmp_path):
    """The server runs as a subprocess on loopback; concurrent httpx clients check every stream's tokens."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("httpx")
    res = bench("serve", "--num-requests", "4", "--new-tokens", "9", "--refill-requests", "0", "--http",
                "--http-timeout", "60", tmp_path=tmp_path)
    http = [r for r in res["results"] if r["transport"] == "http"]
    assert [r["engine"] for r in http] == ["graph pipelined", "graph"]
    assert all(r["tokens"] == 36 and r["clients"] == 4 and r["bursts"] > 0 for r in http)
    assert all(r["tokens_per_s"] > 0 and r["ttft_ms"]["p50"] > 0 for r in http)
    assert len([r for r in res["results"] if r["transport"] == "in-process"]) == 6


def test_bench_latency_quick_on_numpy(tmp_path):
    res = bench("latency", "--quick", tmp_path=tmp_path)
    first = res["results"][0]
    base = first["result"]
    assert set(base) >= {"a", "b", "c", "d", "_nodes"}
    assert base["c"]["syncs"] == 1 and base["a"]["syncs"] == first["config"]["m"] + 1


def test_bench_latency_sampling_on_numpy(tmp_path):
    res = bench("latency", "--sampling", tmp_path=tmp_path)
    assert res["meta"]["mode"] == "sampling"
    (row,) = res["results"]  # numpy: B = 1 only
    assert row["config"] == dict(k=4, m=8, batch=1)
    r = row["result"]
    assert r["greedy_round_us"] > 0 and r["sampling_round_us"] > 0
    assert r["overhead"] == pytest.approx(r["sampling_round_us"] / r["greedy_round_us"] - 1)
    assert 1 <= r["greedy_tokens_per_round"] <= 5 and 1 <= r["sampling_tokens_per_round"] <= 5


def test_bench_sampling_kernels_on_numpy(tmp_path):
    """``--sampling-model kernels``: one line per sampling op, the round total their sum."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "graphburst.cli", "bench", "latency", "--sampling", "--sampling-model",
                           "kernels", "--backend", "numpy", "--json", str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.read_text())["results"]  # numpy: V = 32000, B = 1 only
    assert row["config"] == dict(vocab=32000, batch=1, k=4)
    t = row["result"]
    assert all(v > 0 for v in t.values()) and len(t) == 6
    total = t["round total (k draft steps + verify probs + accept)"]
    assert total == pytest.approx(4 * t["draft_probs_sample (1 draft row)"] + t["probs_from_logits (k+1 verify rows)"]
                                  + t["accept_sample"])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("sampling kernels V=32000 B=1 ")]
    assert len(lines) == 6 and all(ln.endswith(" µs") for ln in lines)


def test_check_greedy_rejects_a_wrong_token():
    prompts = random_prompts(2)
    outs = [greedy_reference(p, 6, 32000) for p in prompts]
    check_greedy("ok", prompts, outs)
    outs[1][3] = (outs[1][3] + 1) % 32000
    with pytest.raises(AssertionError, match="sequence 1 differs"):
        check_greedy("bad", prompts, outs)


def test_sampling_cost_on_a_llama_pair_runs_on_cpu(tmp_path):
    """``bench latency --sampling --sampling-model tiny``: the real-model sampling comparison's code path."""
    out = tmp_path / "s.json"
    res = subprocess.run([sys.executable, "-m", "graphburst.cli", "bench", "latency", "--backend", "numpy",
                          "--sampling", "--sampling-model", "tiny", "--json", str(out)], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["results"]
    assert rows[0]["config"]["model"] == "tiny" and rows[0]["result"]["greedy_round_us"] > 0


def test_bench_latency_sampling_fields_on_numpy(tmp_path):
    """``--sampling --fields``: the fields' cost per round, after the greedy check passed."""
    res = bench("latency", "--sampling", "--fields", tmp_path=tmp_path)
    (row,) = res["results"]  # numpy: B = 1 only
    assert row["config"]["batch"] == 1 and "repetition_penalty" in row["config"]["fields"]
    r = row["result"]
    assert r["sampling_round_us"] > 0 and r["fields_round_us"] > 0
    assert r["fields_overhead"] == pytest.approx(r["fields_round_us"] / r["sampling_round_us"] - 1)
    assert 1 <= r["fields_tokens_per_round"] <= 5


def test_fields_check_fails_when_fields_are_ignored():
    """The bench's check refuses plain greedy tokens (fields ignored) and tokens off its host loop."""
    from graphburst.bench import sampling as bs
    from graphburst.bench.common import VOCAB, random_prompts
    from graphburst.kernels.digest import greedy_reference

    prompts = random_prompts(1)
    with pytest.raises(AssertionError, match="differs from the host loop"):
        bs.check_fields_greedy("x", prompts, [greedy_reference(prompts[0], 6, VOCAB)], bs.CHECK_FIELDS)
