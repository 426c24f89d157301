"""``graphburst bench serve --model ... --http``: the open-loop load benchmark, on CPU.

The schedule (Poisson arrivals, the burst, seeded lengths), the latency arithmetic on hand
cases, the server's GPU busy/idle counters, the models the server child builds, and the
whole command against the real server over tiny-random (2 rates, ~20 requests).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from graphburst.bench.load import mismatches
from graphburst.bench.load_schedule import LengthDist, check_requests, poisson_times, schedule
from graphburst.bench.load_stats import (Record, itl_samples, read_access_log, request_figures, server_window,
                                         summarize, ttft_split)

ROOT = Path(__file__).resolve().parents[2]
U = LengthDist("uniform", 4, 9)
LN = LengthDist("lognormal", 2, 4000, mean=100.0, sigma=0.5)


# ---------------------------------------------------------------------- the schedule

def test_poisson_gaps_have_mean_one_over_rate():
    times = poisson_times(np.random.default_rng(3), 50.0, 400.0)
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert abs(len(times) - 50 * 400) < 4 * np.sqrt(50 * 400)  # Poisson count: sd = sqrt(mean)
    assert abs(gaps.mean() - 1 / 50) < 0.03 / 50
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential: sd = mean
    assert np.all(np.diff(times) > 0) and times[-1] < 400.0


def test_the_burst_arrives_at_once_among_the_poisson_requests():
    plain = schedule(rate=5, duration=4, prompt=U, output=U, vocab=100, seed=1)
    with_burst = schedule(rate=5, duration=4, burst=7, burst_at=1.5, prompt=U, output=U, vocab=100, seed=1)
    burst = [a for a in with_burst if a.burst]
    assert len(burst) == 7 and {a.t for a in burst} == {1.5}
    assert [a.t for a in with_burst if not a.burst] == [a.t for a in plain]  # the Poisson stream is unchanged
    assert [a.t for a in with_burst] == sorted(a.t for a in with_burst)


def test_a_schedule_is_drawn_again_from_its_seed():
    kw = dict(rate=20, duration=2, burst=3, burst_at=1.0, prompt=LN, output=U, vocab=1000)
    a, b, c = schedule(**kw, seed=4), schedule(**kw, seed=4), schedule(**kw, seed=5)
    assert a == b and a != c
    # request i has the same prompt and length at every rate; only its arrival time differs
    slow = schedule(**(kw | dict(rate=5)), seed=4)
    n = min(len(a), len(slow))
    assert [(x.prompt, x.max_tokens) for x in a[:n]] == [(x.prompt, x.max_tokens) for x in slow[:n]]
    assert all(0 <= t < 1000 for x in a for t in x.prompt) and all(4 <= x.max_tokens <= 9 for x in a)
    assert check_requests(2, prompt=LN, output=U, vocab=1000, seed=4) != [(x.prompt, x.max_tokens) for x in a[:2]]


def test_length_distributions_keep_their_range_and_mean():
    rng = np.random.default_rng(0)
    uniform = [U.draw(rng) for _ in range(4000)]
    assert set(uniform) == set(range(4, 10)) and abs(np.mean(uniform) - 6.5) < 0.1
    lognormal = [LN.draw(rng) for _ in range(20000)]
    assert abs(np.mean(lognormal) - 100) < 2  # clipping at 2 and 4000 barely moves it
    clipped = LengthDist("lognormal", 80, 120, mean=100.0, sigma=2.0)
    draws = [clipped.draw(rng) for _ in range(2000)]
    assert min(draws) == 80 and max(draws) == 120


@pytest.mark.parametrize("kw, why", [
    (dict(kind="normal", lo=1, hi=2), "one of uniform, lognormal"),
    (dict(kind="uniform", lo=5, hi=4), "min <= max"),
    (dict(kind="uniform", lo=1, hi=4, mean=2.0), r"mean \(min \+ max\) / 2"),
    (dict(kind="lognormal", lo=10, hi=20), "needs a mean in"),
    (dict(kind="lognormal", lo=10, hi=20, mean=30.0), "needs a mean in"),
    (dict(kind="lognormal", lo=10, hi=20, mean=15.0, sigma=0.0), "sigma"),
])
def test_a_bad_length_distribution_is_refused(kw, why):
    with pytest.raises(ValueError, match=why):
        LengthDist(**kw)


# ---------------------------------------------------------------------- the arithmetic

def test_itl_counts_a_chunk_gap_once_and_its_other_tokens_zero():
    assert itl_samples([(1.0, 1), (1.5, 3), (2.25, 2)]) == [0.5, 0.0, 0.0, 0.75, 0.0]
    assert itl_samples([(1.0, 3), (2.0, 1)]) == [0.0, 0.0, 1.0]  # the first chunk's extra tokens are 0 too
    assert itl_samples([(1.0, 1)]) == []


def _record(sent, chunks, done, prompt_len=3):
    tokens = list(range(sum(n for _, n in chunks)))
    return Record(0.0, prompt_len, len(tokens), sent=sent, status=200, chunks=chunks, tokens=tokens,
                  finish="length", done=done)


def test_request_figures_on_a_hand_case():
    f = request_figures(_record(10.0, [(10.2, 2), (10.5, 3)], 10.6))
    assert f["ttft"] == pytest.approx(0.2) and f["e2e"] == pytest.approx(0.6)
    assert f["tpot"] == pytest.approx(0.3 / 4) and f["itl"] == pytest.approx([0.0, 0.3, 0.0, 0.0])


def test_summary_of_a_run_with_a_429_and_an_error():
    ok = [_record(0.0, [(0.1, 1), (0.3, 1)], 0.4), _record(1.0, [(1.3, 1), (1.4, 1)], 1.5)]
    rejected = Record(0.0, 3, 5, sent=0.0, status=429, error="HTTP 429: busy")
    broken = Record(0.0, 3, 5, sent=0.0, status=200, error="the stream ended without data: [DONE]")
    row = summarize(ok + [rejected, broken], rate=2.0, duration=2.0, wall=4.0)
    assert (row["requests"], row["completed"], row["rejected_429"], row["errors"]) == (4, 2, 1, 1)
    assert row["offered_rps"] == 2.0 and row["achieved_rps"] == 0.5 and row["output_tokens_per_s"] == 1.0
    # TTFTs 100 and 300 ms: p99 = 100 + 0.99 x (300 - 100), numpy's linear interpolation
    assert row["ttft_ms"]["p50"] == pytest.approx(200.0) and row["ttft_ms"]["p99"] == pytest.approx(298.0)
    assert row["itl_ms"]["p50"] == pytest.approx(150.0)  # samples 200 and 100 ms
    assert row["e2e_ms"]["p50"] == pytest.approx(450.0) and row["prompt_tokens"] == 6
    assert row["first_errors"] == ["the stream ended without data: [DONE]"]
    fast = summarize(ok, rate=2.0, duration=2.0, wall=1.5)  # done within the arrival window: rates over the window
    assert fast["achieved_rps"] == 1.0 and fast["span_s"] == 2.0


def test_ttft_splits_into_the_access_logs_parts_joined_on_request_ids(tmp_path):
    a, b = _record(0.0, [(0.1, 1), (0.3, 1)], 0.4), _record(1.0, [(1.3, 1)], 1.5)
    a.request_id, b.request_id = "req-a", "req-b"
    lost = _record(2.0, [(2.1, 1)], 2.2)  # its line is not in the log: left out, and counted so
    lost.request_id = "req-lost"
    log = tmp_path / "access.jsonl"
    lines = [{"request_id": "req-a", "ttft_ms": 90.0, "queue_ms": 30.0, "prefill_ms": 59.0, "emit_ms": 1.0},
             {"request_id": "warm-up", "ttft_ms": 5000.0, "queue_ms": 5000.0, "prefill_ms": 0.0, "emit_ms": 0.0},
             {"request_id": "req-b", "ttft_ms": 280.0, "queue_ms": 200.0, "prefill_ms": 78.0, "emit_ms": 2.0}]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"request_id": "half a li')
    split = ttft_split([a, b, lost], read_access_log(str(log)))
    assert split["ttft_split_requests"] == 2
    parts = split["ttft_split_ms"]
    assert parts["queue"]["p50"] == pytest.approx(115.0) and parts["prefill"]["p50"] == pytest.approx(68.5)
    assert parts["emit"]["p50"] == pytest.approx(1.5)
    assert parts["client"]["p50"] == pytest.approx(15.0)  # client TTFTs 100 and 300 ms minus the server's 90 and 280
    assert ttft_split([a], {})["ttft_split_ms"]["queue"]["p50"] is None  # no log: no figure made up


def test_the_gpu_idle_of_a_window_comes_from_the_counters():
    before = {"graphburst_gpu_busy_seconds_total": 5.0, "graphburst_gpu_idle_seconds_total": 5.0,
              "graphburst_spec_rounds_total": 10.0, "graphburst_draft_accepted_total": 20.0,
              "graphburst_bursts_total": 3.0}
    after = {"graphburst_gpu_busy_seconds_total": 8.0, "graphburst_gpu_idle_seconds_total": 6.0,
             "graphburst_spec_rounds_total": 30.0, "graphburst_draft_accepted_total": 80.0,
             "graphburst_bursts_total": 7.0}
    w = server_window(before, after)
    assert w["gpu_idle_fraction"] == pytest.approx(0.25)  # 1 idle / (3 busy + 1 idle); the whole-run figure is 0.43
    assert w["accepted_per_round"] == 3.0 and w["bursts"] == 4
    assert server_window(before, before)["gpu_idle_fraction"] is None  # no GPU timing: no figure made up
    assert w["ladder_bursts"] == {}  # no ladder
    before['graphburst_ladder_bursts_total{rounds="1"}'] = 2.0
    after.update({'graphburst_ladder_bursts_total{rounds="1"}': 5.0, 'graphburst_ladder_bursts_total{rounds="8"}': 4.0})
    assert server_window(before, after)["ladder_bursts"] == {"1": 3, "8": 4}


def test_the_check_reports_every_difference():
    good = _record(0.0, [(0.1, 3)], 0.2)
    assert mismatches([good], [[0, 1, 2]]) == []
    assert mismatches([good], [[0, 9, 2]]) == ["check request 0: HTTP tokens differ from the in-process loop's at "
                                               "token 1 (3 vs 3 tokens)"]
    assert "at token 3 (3 vs 4 tokens)" in mismatches([good], [[0, 1, 2, 3]])[0]
    failed = Record(0.0, 3, 3, status=500, error="HTTP 500: boom")
    assert mismatches([failed], [[0, 1, 2]]) == ["check request 0: HTTP 500: boom"]


def test_auto_rates_stop_at_saturation():
    from graphburst.bench.load import _saturated

    def row(tps, p99, errors=0, rejected=0):
        return dict(output_tokens_per_s=tps, e2e_ms=dict(p99=p99), errors=errors, rejected_429=rejected)

    assert not _saturated([row(100, 50)])
    assert not _saturated([row(100, 50), row(190, 60)])
    assert _saturated([row(100, 50), row(104, 60)])  # grew < 5%
    assert _saturated([row(100, 50), row(190, 501)])  # E2E p99 past 10x the first rate's
    assert _saturated([row(100, 50), row(190, 60, rejected=1)])
    assert _saturated([row(100, 50, errors=2)])


# ---------------------------------------------------------------------- the server's side

def test_metrics_export_the_burst_clock_as_counters():
    pytest.importorskip("prometheus_client")
    from graphburst.backend import Backend
    from graphburst.bench.serve_http import scrape_text
    from graphburst.models.stubs import stub_pair
    from graphburst.serving.engine_thread import EngineThread
    from graphburst.serving.loop import ServeLoop
    from graphburst.serving.metrics import Metrics

    target, draft = stub_pair(2, 64, 1, 1, 64, backend=Backend("numpy"))
    loop = ServeLoop(target, draft, k=2, m_rounds=2)
    engine = EngineThread(loop, asyncio.new_event_loop())
    loop.pipeline.clock.record(3.0, None, False)  # what a GPU's drained bursts add (ms)
    loop.pipeline.clock.record(2.0, 1.5, True)
    engine._snapshot()
    got = scrape_text(Metrics(engine).render().decode())
    assert got["graphburst_gpu_busy_seconds_total"] == pytest.approx(0.005)
    assert got["graphburst_gpu_idle_seconds_total"] == pytest.approx(0.0015)
    assert got['graphburst_burst_exits_total{reason="flag"}'] == 0  # labelled samples under their labels


@pytest.fixture(scope="module")
def checkpoint_pair(tmp_path_factory):
    """A tiny Hugging Face Llama pair saved as checkpoint directories: (target dir, draft dir)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, eos_token_id=None,
                                   bos_token_id=None, pad_token_id=None)
    root = tmp_path_factory.mktemp("pair")
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "target")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1})) \
        .save_pretrained(root / "draft")
    return str(root / "target"), str(root / "draft")


@pytest.mark.parametrize("model, draft", [("tiny", None), ("qwen3-tiny-pair", None), ("tiny", "ngram"),
                                          ("tiny-random", "ngram"), ("DIR", "DIR"), ("DIR", "ngram")])
def test_the_server_child_builds_and_checks_each_kind_of_model(model, draft, request):
    pytest.importorskip("torch")
    from graphburst.bench.load_server import build, check_in_process

    shape = model not in ("tiny-random", "DIR")
    if model == "DIR":
        model, dir_draft = request.getfixturevalue("checkpoint_pair")
        draft = dir_draft if draft == "DIR" else draft
    lookup = draft == "ngram"
    s = dict(model=model, draft=draft, shape=shape, backend="numpy", batch=2, k=2, m=2, capacity=64, max_queue=4,
             ngram_min=1 if lookup else None, ngram_max=3 if lookup else None, dtype="float32", eps=0.01, seed=0,
             served_name=f"random-{model}" if shape else None)
    loop, config = build(s)
    assert config.http == "127.0.0.1:0" and loop.dec.batch == 2
    assert (type(loop.dec.draft).__name__ == "NgramDraft") == (draft == "ngram")
    reqs = check_requests(2, prompt=U, output=U, vocab=loop.vocab, seed=0)
    first = check_in_process(loop, reqs)
    assert [len(t) for t in first] == [n for _, n in reqs]
    assert check_in_process(loop, reqs) == first  # the loop is deterministic across reuse: the check can hold


# ---------------------------------------------------------------------- the command

def _cli(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "graphburst.cli", "bench", "serve", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


SMALL = ["--model", "tiny-random", "--http", "--backend", "numpy", "--batch", "8", "-k", "2", "-m", "2",
         "--prompt-min", "4", "--prompt-mean", "12", "--prompt-max", "32", "--output-min", "4", "--output-mean",
         "12", "--output-max", "24"]


def test_the_open_loop_command_writes_a_row_per_rate(tmp_path):
    pytest.importorskip("aiohttp")
    pytest.importorskip("httpx")
    out, png = tmp_path / "load.json", tmp_path / "load.png"
    plot = ["--plot", str(png)] if _has("matplotlib") else []
    proc = _cli(*SMALL, "--rates", "5,10", "--duration", "1.2", "--burst", "3", "--json", str(out), *plot)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["meta"]["mode"] == "open-loop" and "CPU REFERENCE" in res["meta"]["label"]
    assert "equal the in-process loop's" in res["meta"]["check"]
    rows = res["results"]
    assert [r["rate"] for r in rows] == [5.0, 10.0]
    vocab = res["meta"]["vocab"]
    prompt, output = (LengthDist(**res["meta"]["server"][k]) for k in ("prompt", "output"))
    for r in rows:  # every request of the drawn schedule was sent, and ran to its max_tokens
        sched = schedule(rate=r["rate"], duration=1.2, burst=3, burst_at=0.6, prompt=prompt, output=output,
                         vocab=vocab, seed=0)
        assert (r["requests"], r["completed"], r["errors"], r["rejected_429"]) == (len(sched), len(sched), 0, 0)
        assert r["output_tokens"] == sum(a.max_tokens for a in sched)
        assert r["ttft_ms"]["p50"] > 0 and r["e2e_ms"]["p99"] >= r["e2e_ms"]["p50"] >= r["ttft_ms"]["p50"]
        assert r["gpu_idle_fraction"] is None and r["bursts"] > 0 and r["accepted_per_round"] is not None
        # TTFT's parts, from the server's access log: every timed request found, the parts within TTFT
        split = r["ttft_split_ms"]
        assert r["ttft_split_requests"] == r["completed"]
        assert 0 <= split["queue"]["p50"] and 0 < split["prefill"]["p50"] and 0 <= split["emit"]["p50"]
        assert split["queue"]["p50"] + split["prefill"]["p50"] <= r["ttft_ms"]["p99"]
    assert "rate /s" in proc.stdout and "TTFT p50 / p99 ms" in proc.stdout
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("args, why", [
    (["--model", "tiny-random"], "--model: the open-loop benchmark runs over HTTP; add --http"),
    (SMALL + ["--length-dist", "uniform"], "--prompt-mean: a uniform length has mean"),
    (SMALL + ["--capacity", "40"], "--capacity: 40 KV entries cannot hold"),
    (SMALL + ["--rates", "4,x"], "--rates: a comma list of rates > 0"),
    (SMALL + ["--rates", "0"], "--rates: a comma list of rates > 0"),
    (SMALL + ["--eps", "0.1"], "--eps: sets a random shape's acceptance"),
    (SMALL + ["--burst", "2", "--burst-at", "30"], "--burst-at: 30 s is past --duration 20 s"),
    (["--model", "1b", "--http", "--draft", "/tmp"], "--draft: a shape builds its own draft"),
    (["--model", "/no/such/dir", "--http", "--draft", "ngram"], "--model: no such checkpoint: '/no/such/dir'"),
    (["--rates", "4"], "--rates: applies to the open-loop benchmark only"),
    (["--draft", "ngram"], "--draft: applies to the open-loop benchmark only"),
    (["--prefill-warmup", "2"], "--prefill-warmup: applies to the open-loop benchmark only"),
    (SMALL + ["--prefill-warmup", "-1"], "--prefill-warmup"),
])
def test_a_bad_flag_is_one_line_and_exit_2(args, why):
    proc = _cli(*args, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert why in proc.stderr


def test_plot_without_matplotlib_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    from graphburst.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what a missing package looks like to import
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", *SMALL, "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "--plot: needs matplotlib" in err


def test_the_burst_may_carry_its_own_prompt_length():
    from graphburst.bench.load_schedule import LengthDist, schedule

    short, long = LengthDist("uniform", 3, 9), LengthDist("uniform", 300, 300)
    arrivals = schedule(rate=20.0, duration=2.0, burst=5, burst_at=1.0, prompt=short,
                        output=LengthDist("uniform", 1, 4), vocab=100, seed=3, burst_prompt=long)
    assert sum(a.burst for a in arrivals) == 5
    assert all(len(a.prompt) == 300 for a in arrivals if a.burst)
    assert all(3 <= len(a.prompt) <= 9 for a in arrivals if not a.burst)
