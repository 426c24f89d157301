"""``graphburst bench real --profile prefill`` as a user runs it: every case's first tokens checked, then its
host (and GPU) time; a case whose check fails is reported, not timed, and the command exits 1; the check
itself catches a wrong first token."""

from __future__ import annotations

import json

import numpy as np
import pytest
from real_cli import cli_here, cli_json

torch = pytest.importorskip("torch")

from graphburst.bench import real_prefill  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefill")
    (tmp / "trace").mkdir()
    return cli_json("--profile", "prefill", "--smoke", "--backend", "numpy", "--dtype", "float32",
                    "--prefill-chunked", "--trace", tmp / "trace", cwd=tmp)


def test_cases_run_checked_and_timed(tiny):
    doc, stdout = tiny
    assert doc["meta"]["failures"] == [] and set(doc["results"]) == {"prefill"}
    (entry,) = doc["results"]["prefill"]
    # no prefill graphs on the CPU by default; float32's near-tie tolerance
    assert (entry["model"], entry["backend"], entry["prefill"], entry["tol"]) == ("tiny", "numpy", "eager", 1e-4)
    rows = entry["results"]
    assert [r["case"] for r in rows] == ["1 x 128", "1 x 512", "4 x 128", "1 x 512 at 512",
                                         "1 x 512 at 512 + 10 lognormal"]
    assert [r["tokens"] for r in rows[:4]] == [128, 512, 512, 512]  # a later chunk: its 512 tokens, not the prompt
    last = rows[4]
    assert last["rows"] == 11 and last["tokens"] > 512 and last["padded_to_longest"] == 11 * 512
    assert all(r["host_ms"] > 0 and r["gpu_ms"] is None and r["captures"] is None for r in rows)
    assert "prefill: one prefill_checked admission into 64 slots" in stdout and "1 x 512 at 512" in stdout


def test_trace_of_one_more_admission(tiny):
    doc, _ = tiny
    prof = doc["results"]["prefill"][0]["profile"]
    assert prof["case"] == "1 x 512 at 512 + 10 lognormal" and prof["calls"] == real_prefill.REPS
    with open(prof["trace"]) as f:
        assert json.load(f)["traceEvents"]
    assert prof["top_kernels"] is None and prof["top_host"][0]["us_per_round"] > 0


def test_a_case_that_fails_its_check_is_reported_not_timed(tmp_path, capsys, monkeypatch):
    calls = []

    def wrong_once(dec, rows, tol):
        calls.append(len(rows))
        if len(calls) == 2:
            raise AssertionError("slot 3: prefill's first token 7, greedy 9: not a near-tie")

    monkeypatch.setattr(real_prefill, "check_first_tokens", wrong_once)
    out = tmp_path / "p.json"
    rc, stdout = cli_here("--profile", "prefill", "--smoke", "--backend", "numpy", "--json", out, capsys=capsys)
    doc = json.loads(out.read_text())
    rows = doc["results"]["prefill"][0]["results"]
    assert rc == 1 and calls == [1, 1, 4]  # each case checked once, the failed one not run on
    assert "host_ms" in rows[0] and "host_ms" not in rows[1] and "not a near-tie" in rows[1]["failed"]
    assert doc["meta"]["failures"] == ["prefill tiny 1 x 512: slot 3: prefill's first token 7, greedy 9: "
                                       "not a near-tie"]
    assert "FAILED" in stdout and "correctness failure" in stdout


def test_a_wrong_first_token_is_caught():
    from graphburst.backend import get_backend

    s = dict(k=4, m=8, dtype="float32", seed=0, prefill_mode="eager")
    dec = real_prefill.build("tiny", get_backend("numpy"), s)
    rows = {3: np.arange(1, 20, dtype=np.int32)}
    dec.prefill_checked(rows, {3: 0}, limits={3: 5})
    real_prefill.check_first_tokens(dec, rows, 1e-4)  # right as prefilled
    dec.bufs.pend[3] = (int(dec.bufs.pend[3]) + 1) % dec.target.vocab
    with pytest.raises(AssertionError, match="slot 3"):
        real_prefill.check_first_tokens(dec, rows, 1e-4)


@pytest.mark.gpu
def test_prefill_view_on_the_gpu(tmp_path):
    """On CUDA: packed prefill graphs by default, GPU time beside host time, buckets captured by the timed calls;
    ``--prefill-mode eager`` takes none."""
    from graphburst.backend import cuda_available

    if not cuda_available() or not torch.cuda.is_available():
        pytest.skip("needs cupy, a CUDA device and CUDA torch")
    for mode, label in (("auto", "packed"), ("eager", "eager")):
        doc, _ = cli_json("--profile", "prefill", "--smoke", "--backend", "cupy", "--prefill-mode", mode,
                          cwd=tmp_path)
        (entry,) = doc["results"]["prefill"]
        assert entry["prefill"] == label and doc["meta"]["failures"] == []
        for r in entry["results"]:
            assert r["host_ms"] > 0 and r["gpu_ms"] > 0
            assert (r["captures"] is None) == (mode == "eager")


def test_a_cpu_run_gives_the_process_its_torch_state_back(tmp_path, capsys, monkeypatch):
    # a CPU run flushes subnormals to zero and uses one thread; a caller in the same process must not inherit
    # that (hypothesis, for one, refuses to run with flush-to-zero on)
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    rc, _ = cli_here("--profile", "prefill", "--smoke", "--backend", "numpy", "--dtype", "float32",
                     "--json", tmp_path / "out.json", capsys=capsys)
    assert rc == 0
    subnormal = torch.tensor([1e-40], dtype=torch.float32)
    assert (subnormal * 1.0).item() != 0.0 and torch.get_num_threads() == threads
