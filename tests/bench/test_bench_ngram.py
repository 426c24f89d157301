"""``graphburst bench ngram`` run as a user runs it, on numpy with the tiny model (every code path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_ngram_smoke_on_numpy(tmp_path):
    out = tmp_path / "out.json"
    args = ["--smoke", "--backend", "numpy", "--json", str(out), "--batches", "1,3", "--histories", "1,40",
            "--e2e-batches", "1", "--workloads", "repeat,echo", "--prompt-len", "12", "--new-tokens", "10",
            "--decode-kernels", "reference"]  # the fused decode path (on its references) under every torch engine
    proc = subprocess.run([sys.executable, "-m", "graphburst.cli", "bench", "ngram", *args], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert "CPU REFERENCE" in res["meta"]["label"] and res["meta"]["settings"]["decode_kernels"] == "reference"
    assert [(r["batch"], r["history"]) for r in res["results"]["search"]] == [(1, 1), (1, 40), (3, 1), (3, 40)]
    assert all(r["checked"] and r["us_median"] > 0 for r in res["results"]["search"])
    e2e = res["results"]["e2e"]
    assert {(r["workload"], r["engine"]) for r in e2e} == {
        (w, e) for w in ("repeat", "echo")
        for e in ("graphburst-ngram", "graphburst-ngram-sync", "graphburst-plain", "plain", "hf-lookup", "hf-plain")}
    assert all(r["agreed_tokens"] == 10 for r in e2e)  # fp32 on the CPU: every engine's tokens agree
    plain = [r for r in e2e if r["engine"] == "graphburst-plain"]
    assert all(r["accepted_per_round"] == 0 and r["tokens_per_forward"] == 1.0 for r in plain)  # no draft


def test_bench_ngram_flag_errors():
    for args, flag in ((["--batches", "0"], "--batches"), (["--workloads", "x"], "--workloads"),
                       (["--decode-kernels", "folded"], "--decode-kernels"), (["--engines", "hf"], "--engines"),
                       (["--engines", ""], "--engines")):
        proc = subprocess.run([sys.executable, "-m", "graphburst.cli", "bench", "ngram", "--backend", "numpy", *args],
                              capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
        assert proc.returncode == 2 and flag in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_engines_left_out_are_not_run_and_the_reference_still_checks_the_rest(tmp_path):
    """--engines without graphburst-ngram: its untimed run at the first k still checks the engines named."""
    from graphburst import cli

    out = tmp_path / "out.json"
    rc = cli.main(["bench", "ngram", "--smoke", "--backend", "numpy", "--parts", "e2e", "--e2e-batches", "1",
                   "--workloads", "repeat", "--prompt-len", "12", "--new-tokens", "6", "--engines", "plain,hf-lookup",
                   "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]["e2e"]
    assert sorted(r["engine"] for r in rows) == ["hf-lookup", "plain"]
    assert all(r["agreed_tokens"] == r["compared_tokens"] == 6 for r in rows)


def test_an_engine_that_diverges_is_recorded_not_a_crash(tmp_path, monkeypatch):
    """A comparison engine whose tokens leave graphburst's (not at a near-tie) is a FAILED row and exit status 1,
    as in bench real; the other engines are still timed and the JSON is still written."""
    from graphburst import cli
    from graphburst.bench import real_checks

    honest = real_checks.compare_other

    def strict(name, *args, **kw):
        if name.startswith("hf-lookup"):
            raise AssertionError(f"{name}: token 3 is 1, graphburst's is 2, and the reference logits differ")
        return honest(name, *args, **kw)

    monkeypatch.setattr(real_checks, "compare_other", strict)
    out = tmp_path / "out.json"
    rc = cli.main(["bench", "ngram", "--smoke", "--backend", "numpy", "--parts", "e2e", "--e2e-batches", "1",
                   "--workloads", "repeat", "--prompt-len", "12", "--new-tokens", "6", "--json", str(out)])
    assert rc == 1
    rows = {r["engine"]: r for r in json.loads(out.read_text())["results"]["e2e"]}
    assert "token 3 is 1" in rows["hf-lookup"]["failed"] and "tokens_per_s" not in rows["hf-lookup"]
    assert rows["plain"]["tokens_per_s"] > 0 and rows["graphburst-ngram"]["speedup_vs_plain"] > 0


def test_text_prompt_classes():
    from graphburst.bench.text_prompts import CLASSES, load_prompts
    from graphburst.models.tokenizer import render_user_message

    for name in CLASSES:
        prompts = load_prompts(name)
        assert len(prompts) >= 3, name
        assert all(p and "---" not in p.splitlines() and not p.startswith("#") for p in prompts), name

    class Plain:  # a tokenizer without a chat template: the text alone
        chat_template = None

        def __call__(self, text):
            return {"input_ids": [ord(c) for c in text]}

    assert render_user_message(Plain(), "hi") == [104, 105]


def test_real_text_workload_on_a_trained_model(tmp_path):
    """SmolLM2-135M-Instruct, fp32 on the CPU: lookup hits on the code-editing prompts and misses on the open
    questions; graphburst's engines and transformers' prompt lookup agree; a graph runs M rounds per host sync,
    synced rounds fewer; only the engines asked for run."""
    out = tmp_path / "out.json"
    # 12 tokens: a whole burst of hits on the code (M=4 rounds of ~3 tokens), three bursts of misses on the
    # questions; each token costs every engine ~0.1 s on the CPU, so more would only repeat the same rounds.
    # The two plain baselines (a torch loop, HF's plain generate) are left out: the smoke run on numpy
    # covers them, and here each would cost the CPU as much as an engine under test.
    engines = "graphburst-plain,graphburst-ngram,graphburst-ngram-sync,hf-lookup"
    args = ["--smoke", "--backend", "numpy", "--parts", "e2e", "--model", "smollm2-135m", "--e2e-batches", "1",
            "--workloads", "edit_code,open_questions", "-k", "4", "-m", "4", "--new-tokens", "12",
            "--engines", engines, "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "graphburst.cli", "bench", "ngram", *args], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = {(r["workload"], r["engine"]): r for r in json.loads(out.read_text())["results"]["e2e"]}
    assert set(rows) == {(wl, e) for wl in ("edit_code", "open_questions") for e in engines.split(",")}
    assert all(r["agreed_tokens"] == 12 for r in rows.values())
    assert rows["edit_code", "graphburst-ngram"]["accepted_per_round"] > 1.0  # the answer repeats the code
    assert rows["open_questions", "graphburst-ngram"]["accepted_per_round"] < 0.5
    assert rows["edit_code", "graphburst-ngram"]["rounds_per_sync"] == 4.0  # M rounds, one drain
    assert rows["edit_code", "graphburst-ngram-sync"]["rounds_per_sync"] == 4 / 5  # a sync a round and the drain
    assert rows["edit_code", "graphburst-ngram"]["speedup_vs_synced"] is not None
    assert rows["open_questions", "graphburst-plain"]["rounds_per_sync"] == 4.0  # plain decoding: M rounds a drain
