"""Checkpoints through the commands: every family runs in ``demo`` and ``serve``, and an
unloadable checkpoint is one line with exit 2 in ``demo``, ``serve`` and ``serve --http``.

Checkpoints are the tiny transformers-built families of tests/models/test_models_hf.py (no
download). The commands run in-process through ``graphburst.cli.main`` (a subprocess per
case would cost a torch import each), except the HTTP server, which needs its own process.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch

from graphburst.cli import main
from graphburst.models.checkpoint import load_pair
from graphburst.models.llama_config import CheckpointError

from test_models_hf import FAMILIES, hf_pair

torch.set_num_threads(1)

SERVE = ["--backend", "numpy", "--batch", "2", "--capacity", "64", "-k", "3", "-m", "2"]
PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [7, 7, 7, 100, 42, 17]]
NEW = 10


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """family -> (HF target, target dir, draft dir)."""
    out = {}
    for family in FAMILIES:
        target, draft = hf_pair(family, seed=2)
        root = tmp_path_factory.mktemp(family)
        target.save_pretrained(root / "target")
        draft.save_pretrained(root / "draft")
        out[family] = (target, root / "target", root / "draft")
    return out


def hf_greedy(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def one_line_exit_2(capsys, argv, *needles):
    """``main(argv)`` returns 2 with one stderr line holding every needle (a traceback fails the test)."""
    assert main(argv) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and "no GPU in use" not in x]
    assert len(err) == 1 and all(n in err[0] for n in needles), err
    return err[0]


# ---------------------------------------------------------------------- every family runs

@pytest.mark.parametrize("family", list(FAMILIES))
def test_demo_runs_each_family(pairs, family, capsys):
    _, target_dir, draft_dir = pairs[family]
    rc = main(["demo", "--backend", "numpy", "--model", str(target_dir), "--draft", str(draft_dir), "--batch", "2",
               "-k", "3", "-m", "2", "--bursts", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "matches greedy" in out and "NO" not in out, out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_serve_jsonl_each_family_equals_transformers(pairs, family, tmp_path, capsys):
    hf, target_dir, draft_dir = pairs[family]
    requests, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    requests.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": NEW}) + "\n" for p in PROMPTS))
    rc = main(["serve", "--model", str(target_dir), "--draft", str(draft_dir), *SERVE, "--requests", str(requests),
               "--output", str(output)])
    assert rc == 0, capsys.readouterr().err
    recs = {r["line"]: r for r in map(json.loads, output.read_text().splitlines())}
    for i, prompt in enumerate(PROMPTS, start=1):
        assert recs[i]["tokens"] == hf_greedy(hf, prompt, NEW), (family, i)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_http_text_prompts_with_the_model_directorys_tokenizer(pairs, family, tmp_path):
    """``tokenizer.json`` in the model directory is picked up by ``serve --http`` with no flag."""
    from test_http_server import ServerProcess
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf, target_dir, draft_dir = pairs[family]
    model = tmp_path / "model"
    shutil.copytree(target_dir, model)
    vocab = hf.config.vocab_size
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model / "tokenizer.json"))
    s = ServerProcess("--model", str(model), "--draft", str(draft_dir), *SERVE[2:])
    try:
        want = hf_greedy(hf, [5, 6, 7], NEW)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "w5 w6 w7", "max_tokens": NEW}, timeout=30).json()
        assert r["choices"][0]["token_ids"] == want and r["choices"][0]["text"] == tok.decode(want)
    finally:
        assert s.terminate() == 0, s.errors()


# ---------------------------------------------------------------------- one line, exit 2

def bad_copy(pairs, tmp_path, family="qwen3"):
    """A writable copy of a family's target directory, and its draft."""
    _, target_dir, draft_dir = pairs[family]
    bad = tmp_path / "bad"
    shutil.copytree(target_dir, bad)
    return bad, draft_dir


CORRUPT = {
    "truncated": lambda b: b[:20000],
    "garbage": lambda b: bytes(range(256)) * 20,
    "empty": lambda b: b"",
    "bad header": lambda b: b[:8] + b"{not json" + b[17:],
}


@pytest.mark.parametrize("how", list(CORRUPT))
def test_a_corrupt_safetensors_file_is_a_checkpoint_error(pairs, tmp_path, how):
    bad, draft_dir = bad_copy(pairs, tmp_path)
    weights = bad / "model.safetensors"
    weights.write_bytes(CORRUPT[how](weights.read_bytes()))
    with pytest.raises(CheckpointError, match=f"{weights}: not a readable safetensors file"):
        load_pair(bad, draft_dir, batch=1, capacity=8, backend="numpy")


@pytest.mark.parametrize("text,needle", [
    ("[1, 2]", "must hold a JSON object, got list"),  # was AttributeError: 'list' object has no attribute 'get'
    ("{'vocab_size': 3}", "invalid JSON: Expecting property name enclosed in double quotes"),  # named no file
    ("", "invalid JSON"),
])
def test_a_bad_config_json_names_the_file(pairs, tmp_path, text, needle):
    bad, draft_dir = bad_copy(pairs, tmp_path)
    (bad / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=f"{bad / 'config.json'}: {needle}"):
        load_pair(bad, draft_dir, batch=1, capacity=8, backend="numpy")


def test_an_invalid_index_names_the_file(pairs, tmp_path):
    bad, draft_dir = bad_copy(pairs, tmp_path)
    (bad / "model.safetensors.index.json").write_text("{weight_map: 1}")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: invalid JSON"):
        load_pair(bad, draft_dir, batch=1, capacity=8, backend="numpy")


def test_a_vocab_mismatch_is_named_before_any_tensor_is_read(pairs, tmp_path):
    bad, draft_dir = bad_copy(pairs, tmp_path)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vocab_size"] += 1
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").unlink()  # never reached
    with pytest.raises(CheckpointError, match="vocab_size .* differs from the target's"):
        load_pair(draft_dir, bad, batch=1, capacity=8, backend="numpy")


def _break(kind, bad):
    if kind == "truncated safetensors":
        weights = bad / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:20000])
        return "not a readable safetensors file"
    if kind == "config list":
        (bad / "config.json").write_text("[]")
        return "must hold a JSON object"
    if kind == "config invalid":
        (bad / "config.json").write_text("{")
        return "invalid JSON"
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vocab_size"] += 1
    (bad / "config.json").write_text(json.dumps(cfg))
    return "vocab_size"


KINDS = ["truncated safetensors", "config list", "config invalid", "vocab mismatch"]


@pytest.mark.parametrize("kind", KINDS)
def test_demo_reports_a_bad_checkpoint_in_one_line(pairs, tmp_path, kind, capsys):
    bad, draft_dir = bad_copy(pairs, tmp_path)
    needle = _break(kind, bad)
    one_line_exit_2(capsys, ["demo", "--backend", "numpy", "--model", str(bad), "--draft", str(draft_dir)],
                    "graphburst demo:", needle)


@pytest.mark.parametrize("http", [False, True])
@pytest.mark.parametrize("kind", ["truncated safetensors", "config list", "vocab mismatch"])
def test_serve_reports_a_bad_checkpoint_in_one_line(pairs, tmp_path, kind, http, capsys):
    bad, draft_dir = bad_copy(pairs, tmp_path)
    needle = _break(kind, bad)
    requests = tmp_path / "one.jsonl"
    requests.write_text(json.dumps({"prompt": [1, 2], "max_new_tokens": 2}) + "\n")
    argv = ["serve", "--model", str(bad), "--draft", str(draft_dir), *SERVE]
    mode = ["--http", "127.0.0.1:0"] if http else ["--requests", str(requests)]  # --requests is JSONL's only
    one_line_exit_2(capsys, argv + mode, "graphburst serve:", needle)
