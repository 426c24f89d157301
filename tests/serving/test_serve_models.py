"""``graphburst serve --model``: the Llama pair through JSONL and HTTP serving, on CPU.

Expected tokens come from full-recompute greedy loops (the whole sequence through the
model for every token): graphburst's own Llama for ``tiny-random``, transformers for a
saved checkpoint. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from graphburst.models.checkpoint import tiny_random_pair  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# One torch thread: CI has 2 cores, shared with pytest itself.
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
SIZES = ["--backend", "numpy", "--batch", "2", "--capacity", "64", "-k", "3", "-m", "2"]
PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [7, 7, 7, 100, 42, 17]]  # three requests over two slots: one waits
NEW = 12

torch.set_num_threads(1)


def serve_jsonl(*flags, lines, timeout=120):
    stdin = "".join(json.dumps(x) + "\n" for x in lines).encode()
    out = subprocess.run([sys.executable, "-m", "graphburst.cli", "serve", *flags], input=stdin,
                         capture_output=True, env=ENV, timeout=timeout)
    assert out.returncode == 0, out.stderr.decode()
    return {r["line"]: r for r in map(json.loads, out.stdout.decode().splitlines())}


def tiny_greedy(prompt, n):
    """Full-recompute greedy continuation of tiny_random_pair's target (seed 0 and 4 layers, as the CLI builds it)."""
    target, _ = tiny_random_pair(batch=1, capacity=64, backend="numpy")
    model, seq = target.module, list(prompt)
    zero = torch.zeros(1, dtype=torch.int32)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]), zero, [zero] * 4)[0, -1].argmax()))
    return seq[len(prompt):]


def hf_greedy(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_jsonl_tiny_random_equals_plain_greedy():
    recs = serve_jsonl("--model", "tiny-random", *SIZES,
                       lines=[{"prompt": p, "max_new_tokens": NEW} for p in PROMPTS])
    for i, prompt in enumerate(PROMPTS, start=1):
        assert recs[i]["finish_reason"] == "length" and recs[i]["tokens"] == tiny_greedy(prompt, NEW)
    assert any(r["accepted_per_round"] for r in recs.values())  # the early-exit draft is really used


def test_jsonl_saved_checkpoint_pair_equals_transformers_greedy(tmp_path):
    from test_llama_hf import hf_pair  # the same tiny random HF pair the loader tests use

    target, draft = hf_pair(3)
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    recs = serve_jsonl("--model", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), *SIZES,
                       lines=[{"prompt": p, "max_new_tokens": NEW} for p in PROMPTS] + [{"prompt": [1], "foo": 1,
                                                                                          "max_new_tokens": 2}])
    for i, prompt in enumerate(PROMPTS, start=1):
        assert recs[i]["tokens"] == hf_greedy(target, prompt, NEW), i
    assert "foo" in recs[len(PROMPTS) + 1]["error"]  # an option no model claims costs only its line


def test_jsonl_saved_checkpoint_alone_decodes_plainly(tmp_path):
    """A checkpoint served with no draft decodes plainly (k 0, one token a round): transformers' greedy tokens,
    and no draft accepted."""
    from test_llama_hf import hf_pair

    target, _ = hf_pair(3)
    target.save_pretrained(tmp_path / "target")
    plain = [f for f in SIZES if f not in ("-k", "3")]
    recs = serve_jsonl("--model", str(tmp_path / "target"), *plain,
                       lines=[{"prompt": p, "max_new_tokens": NEW} for p in PROMPTS])
    for i, prompt in enumerate(PROMPTS, start=1):
        assert recs[i]["tokens"] == hf_greedy(target, prompt, NEW), i
        assert recs[i]["accepted_per_round"] == 0
    out = subprocess.run([sys.executable, "-m", "graphburst.cli", "serve", "--model", str(tmp_path / "target"),
                          *SIZES], input=b"", capture_output=True, env=ENV, timeout=60)
    assert out.returncode == 2 and "-k: 3 drafts per round need a draft" in out.stderr.decode()


@pytest.mark.parametrize("flags, flag", [
    (["--model", "tiny-random", "--vocab", "100"], "--vocab"),
    (["--model", "tiny-random", "--accept", "0.5"], "--accept"),
    (["--model", "tiny-random", "--draft", "."], "--draft"),
    (["--model", "."], "--model"),
    (["--model", "tiny-random", "-k", "0", "--p-min", "0.2"], "--p-min"),
    (["--model", "tiny-random", "-k", "0", "--draft", "ngram"], "-k"),
    (["--model", "/no/such/dir", "--draft", "."], "--model"),
    (["--dtype", "bfloat16"], "--dtype"),
])
def test_model_flag_errors_are_one_line(flags, flag):
    out = subprocess.run([sys.executable, "-m", "graphburst.cli", "serve", "--backend", "numpy", *flags],
                         input=b"", capture_output=True, env=ENV, timeout=60)
    err = out.stderr.decode()
    lines = [x for x in err.splitlines() if x.strip()]
    assert out.returncode == 2 and len(lines) == 1 and flag in lines[0] and "Traceback" not in err, err


def test_a_directory_that_is_not_a_checkpoint_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "graphburst.cli", "serve", "--model", str(tmp_path), "--draft",
                          str(tmp_path), *SIZES], input=b"", capture_output=True, env=ENV, timeout=60)
    err = out.stderr.decode()
    assert out.returncode == 2 and "config.json" in err and "Traceback" not in err, err


def test_http_tiny_random_through_the_openai_client():
    openai = pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    from test_http_server import ServerProcess

    s = ServerProcess("--model", "tiny-random", *SIZES[2:])
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny-random"]
        r = client.completions.create(model="tiny-random", prompt=PROMPTS[0], max_tokens=NEW)
        assert r.choices[0].token_ids == tiny_greedy(PROMPTS[0], NEW) and r.choices[0].finish_reason == "length"
        chunks = client.completions.create(model="tiny-random", prompt=PROMPTS[1], max_tokens=NEW, stream=True)
        got = [t for c in chunks for t in (c.choices[0].token_ids or [])]
        assert got == tiny_greedy(PROMPTS[1], NEW)
    finally:
        assert s.terminate() == 0, s.errors()


@pytest.mark.gpu
def test_gpu_jsonl_tiny_random_equals_plain_greedy():
    """On the H200: torch on the cupy backend's device, captured with the burst; tokens equal the CPU loop."""
    flags = ["--backend", "cupy", *SIZES[2:]]
    recs = serve_jsonl("--model", "tiny-random", *flags, lines=[{"prompt": p, "max_new_tokens": NEW} for p in PROMPTS])
    for i, prompt in enumerate(PROMPTS, start=1):
        assert recs[i]["tokens"] == tiny_greedy(prompt, NEW), i
    # plain decoding (k 0) of the same target on the GPU: its T = 1 verify captured in the burst
    recs = serve_jsonl("--model", "tiny-random", *flags[:-4], "-k", "0", "-m", "4",
                       lines=[{"prompt": p, "max_new_tokens": NEW} for p in PROMPTS])
    for i, prompt in enumerate(PROMPTS, start=1):
        assert recs[i]["tokens"] == tiny_greedy(prompt, NEW) and recs[i]["accepted_per_round"] == 0, i
