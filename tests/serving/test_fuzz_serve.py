"""Fuzz ``graphburst serve`` with hypothesis: any mix of lines, one record each, valid ones exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphburst import greedy_reference

ROOT = Path(__file__).resolve().parents[2]
VOCAB, CAPACITY = 5003, 64

valid = st.builds(lambda p, n, eos_at, acc: {"prompt": p, "max_new_tokens": n, "accept_prob": acc} | (
    {"eos": greedy_reference(p, n, VOCAB)[eos_at % n]} if eos_at is not None else {}),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), st.integers(1, 40),
    st.none() | st.integers(0, 100), st.sampled_from([0.0, 0.5, 1.0]))
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=4), max_leaves=12)
near_valid = st.fixed_dictionaries({"prompt": json_values | st.lists(st.integers(-2, VOCAB + 2), max_size=80),
                                    "max_new_tokens": json_values | st.integers(-2, 100)},
                                   optional={"eos": json_values, "id": json_values, "accept_prob": json_values,
                                             "seed": json_values})
huge = st.sampled_from([b"[" * 50_000, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b', "max_new_tokens": 3}',
                        b'{"prompt": [1], "max_new_tokens": ' + b"9" * 5000 + b"}", b'{"prompt": [1e999]}'])
line = st.one_of(valid.map(lambda d: ("valid", d)),
                 near_valid.map(lambda d: ("other", json.dumps(d).encode())),
                 json_values.map(lambda v: ("other", json.dumps(v).encode())),
                 st.binary(max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b).map(lambda b: ("other", b)),
                 huge.map(lambda b: ("other", b)))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(line, min_size=1, max_size=25))
def test_every_line_gets_one_record_and_valid_requests_match_greedy(tmp_path_factory, lines):
    raw, valid_at = [], {}
    for i, (kind, item) in enumerate(lines, start=1):
        if kind == "valid":
            item = dict(item, id=f"valid-{i}-id")  # longer than any fuzzed id
            valid_at[i] = item
            raw.append(json.dumps(item).encode())
        else:
            raw.append(item)
    src = tmp_path_factory.mktemp("fuzz") / "req.jsonl"
    src.write_bytes(b"\n".join(raw) + b"\n")
    res = subprocess.run([sys.executable, "-m", "graphburst.cli", "serve", "--backend", "numpy", "--batch", "3",
                          "--vocab", str(VOCAB), "--capacity", str(CAPACITY), "-m", "2", "--requests", str(src)],
                         capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert b"Traceback" not in res.stderr, res.stderr.decode()[-3000:]
    recs = [json.loads(x) for x in res.stdout.splitlines()]
    non_blank = {i for i, r in enumerate(raw, start=1) if r.strip()}
    assert sorted(r["line"] for r in recs) == sorted(non_blank)  # exactly one record per non-blank line
    by_line = {r["line"]: r for r in recs}
    for i, req in valid_at.items():
        rec = by_line[i]
        assert "error" not in rec, rec
        want = greedy_reference(req["prompt"], req["max_new_tokens"], VOCAB)
        if "eos" in req:
            want = want[: want.index(req["eos"]) + 1]
        assert rec["id"] == f"valid-{i}-id" and rec["tokens"] == want
    served = sum("error" not in r for r in recs)
    assert res.returncode == (0 if served or not non_blank else 1), res.stderr.decode()[-2000:]
