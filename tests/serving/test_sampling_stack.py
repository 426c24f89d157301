"""Sampling through the user-facing stack: ``graphburst serve --sampling`` JSONL,
``graphburst demo --temperature`` (run as subprocesses), and the torch Llama path
(temperature 0 equals greedy; eager equals graph) on CPU and, gpu-marked, on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marks import gpu
from graphburst import greedy_reference

ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def cli(*args, stdin=b""):
    return subprocess.run([sys.executable, "-m", "graphburst.cli", *args], input=stdin, capture_output=True, env=ENV,
                          timeout=180)


def test_serve_jsonl_sampling_fields():
    lines = [
        {"id": "s1", "prompt": [1, 2, 3], "max_new_tokens": 9, "temperature": 0.9, "seed": 123, "top_p": 0.95},
        {"id": "g", "prompt": [4, 5], "max_new_tokens": 6},
        {"id": "s2", "prompt": [1, 2, 3], "max_new_tokens": 9, "temperature": 0.9, "seed": 123, "top_p": 0.95},
        {"id": "bad", "prompt": [1], "max_new_tokens": 2, "top_p": 0},
        {"id": "r", "prompt": [7], "max_new_tokens": 4, "temperature": 1.0, "top_k": 5},
    ]
    text = "".join(json.dumps(x) + "\n" for x in lines).encode()
    out = cli("serve", "--backend", "numpy", "--batch", "2", "--vocab", "100", "--sampling", stdin=text)
    assert out.returncode == 0, out.stderr.decode()
    recs = {r.get("id", r["line"]): r for r in map(json.loads, out.stdout.decode().splitlines())}
    assert recs["s1"]["tokens"] == recs["s2"]["tokens"] and len(recs["s1"]["tokens"]) == 9  # same seed, same tokens
    assert recs["s1"]["seed"] == 123
    assert recs["g"]["tokens"] == greedy_reference([4, 5], 6, 100) and "seed" not in recs["g"]
    assert recs[4]["error"] == "top_p must be in (0, 1], got 0.0"
    assert isinstance(recs["r"]["seed"], int) and len(recs["r"]["tokens"]) == 4  # a drawn seed, reported
    greedy = cli("serve", "--backend", "numpy", "--batch", "2", "--vocab", "100", stdin=text)
    recs = {r["line"]: r for r in map(json.loads, greedy.stdout.decode().splitlines())}  # in finishing order
    assert recs[1]["error"].startswith("temperature 0.9 needs sampling, but this loop decodes greedily")
    assert recs[2]["tokens"] == greedy_reference([4, 5], 6, 100)


def test_demo_temperature_matches_eager():
    out = cli("demo", "--backend", "numpy", "--batch", "2", "--bursts", "2", "--vocab", "300", "--temperature", "0.8",
              "--top-k", "50", "--seed", "4")
    text = out.stdout.decode()
    assert out.returncode == 0, text + out.stderr.decode()
    assert "matches eager (T=0.8)" in text and "NO" not in text


def test_demo_bad_temperature_is_one_line():
    out = cli("demo", "--backend", "numpy", "--temperature", "1e-40")
    err = out.stderr.decode()
    assert out.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert "--temperature: temperature must be 0 or >= " in err and "Traceback" not in err


def tiny_pair(backend, seed=5):
    from graphburst.models.checkpoint import tiny_random_pair

    return tiny_random_pair(batch=2, capacity=96, backend=backend, seed=seed)


PROMPTS = [[1, 2, 3], [4, 5]]


def llama_run(backend, *, sampling, engine, **kw):
    from graphburst.engine.decoder import SpecDecoder
    from graphburst.capture import BurstGraph

    target, draft = tiny_pair(backend)
    dec = SpecDecoder(target, draft, k=3, m_rounds=2, sampling=sampling)
    dec.prefill(PROMPTS, **kw)
    run = BurstGraph(dec).run if engine == "graph" else (lambda: dec.run_burst(mode=engine))
    out = [[] for _ in PROMPTS]
    for _ in range(2):
        for b, t in enumerate(run()):
            out[b] += t.tolist()
    return out, target


@pytest.mark.parametrize("backend_name", ["numpy", pytest.param("cupy", marks=gpu)])
def test_llama_sampling(backend_name):
    pytest.importorskip("torch")
    from graphburst.backend import Backend

    backend = Backend(backend_name)
    greedy, target = llama_run(backend, sampling=False, engine="pre_issued")
    assert greedy == [target.module.greedy(p, len(o)) for p, o in zip(PROMPTS, greedy)]
    t0, _ = llama_run(backend, sampling=True, engine="graph", temperature=0.0, seed=3)
    assert t0 == greedy
    kw = dict(temperature=0.8, top_p=0.9, seed=[11, 12])
    eager, _ = llama_run(backend, sampling=True, engine="per_round_sync", **kw)
    graph, _ = llama_run(backend, sampling=True, engine="graph", **kw)
    assert eager == graph and eager != greedy
