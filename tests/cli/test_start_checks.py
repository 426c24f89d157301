"""Serve settings that can never work are refused at start, in one line with exit 2, before any model
loads: a tokenizer with fewer ids than the model's vocabulary, a capacity that holds no request, a
pipeline depth with the pipeline off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphburst.serving.factory import MIN_CAPACITY, ConfigError, ServeConfig, check_tokenizer_vocab

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def serve(*args, stdin=b"", timeout=120):
    return subprocess.run([sys.executable, "-m", "graphburst.cli", "serve", "--backend", "numpy", *args],
                          input=stdin, capture_output=True, env=ENV, timeout=timeout, check=False)


def one_line_error(res, flag) -> str:
    err = res.stderr.decode()
    assert res.returncode == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"graphburst serve: error: {flag}: "), err
    return lines[0]


def word_tokenizer(path: Path, size: int) -> Path:
    """A WordLevel tokenizer of ``size`` ids (``w0`` .. ``w{size-1}``) in ``path/tokenizer.json``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir(exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


# ---------------------------------------------------------------------- the tokenizer's vocabulary

@pytest.mark.parametrize("model", [["--vocab", "5003"], ["--model", "tiny-random"]])
def test_a_tokenizer_smaller_than_the_models_vocabulary_is_refused(model, tmp_path):
    pytest.importorskip("tokenizers")
    if model[0] == "--model":
        pytest.importorskip("torch")
    tok = word_tokenizer(tmp_path / "tok", 300)
    line = one_line_error(serve("--http", "127.0.0.1:0", *model, "--tokenizer", str(tok)), "--tokenizer")
    vocab = "5003" if model[0] == "--vocab" else "512"
    assert "300" in line and vocab in line, line


def test_a_tokenizer_as_large_as_the_vocabulary_or_larger_passes(tmp_path):
    pytest.importorskip("tokenizers")
    tok = str(word_tokenizer(tmp_path / "tok", 300))
    for vocab in (300, 200):
        check_tokenizer_vocab(ServeConfig(vocab=vocab, http="127.0.0.1:0", tokenizer=tok))
    with pytest.raises(ConfigError, match="tokenizer.* 300 token ids.* 301"):
        check_tokenizer_vocab(ServeConfig(vocab=301, http="127.0.0.1:0", tokenizer=tok))


# ---------------------------------------------------------------------- capacity

def test_a_capacity_that_holds_no_request_is_refused_naming_the_minimum():
    line = one_line_error(serve("--capacity", "1"), "--capacity")
    assert f"[{MIN_CAPACITY}," in line and "one prompt token plus one new token" in line, line
    with pytest.raises(ConfigError, match=f"capacity.*smallest capacity is {MIN_CAPACITY}"):
        ServeConfig(capacity=1)


@pytest.mark.parametrize("flags", [[], ["-k", "8", "-m", "16", "--accept", "1"], ["--engine", "per_round_sync"],
                                   ["--draft", "ngram"]])
def test_the_minimum_capacity_serves_a_request_whatever_k_and_m(flags):
    """The smallest capacity is the real one: a burst's draft rows past it never stop a request that fits."""
    from graphburst import greedy_reference

    res = serve("--capacity", str(MIN_CAPACITY), "--batch", "2", "--vocab", "5003", *flags,
                stdin=b'{"prompt": [7], "max_new_tokens": 1}\n{"prompt": [3], "max_new_tokens": 1}\n')
    assert res.returncode == 0, res.stderr.decode()
    recs = {r["line"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert recs[1]["tokens"] == greedy_reference([7], 1, 5003) and recs[2]["tokens"] == greedy_reference([3], 1, 5003)


# ---------------------------------------------------------------------- pipeline depth

@pytest.mark.parametrize("other", [["--no-pipeline"], ["--engine", "per_round_sync"]])
def test_a_pipeline_depth_with_the_pipeline_off_is_refused(other):
    line = one_line_error(serve("--pipeline-depth", "3", *other), "--pipeline-depth")
    assert " ".join(other) in line, line
    with pytest.raises(ConfigError, match="pipeline_depth"):
        ServeConfig(pipeline_depth=2, **({"pipelined": False} if other == ["--no-pipeline"] else
                                         {"engine": "per_round_sync"}))


def test_the_pipeline_depth_defaults_to_two_and_is_kept_when_given():
    assert ServeConfig().pipeline_depth == 2 and ServeConfig(pipeline_depth=3).pipeline_depth == 3
    assert ServeConfig(pipelined=False).pipeline_depth == 2


# ---------------------------------------------------------------------- speculation settings

def test_spec_max_batch_with_plain_decoding_is_refused_naming_both():
    line = one_line_error(serve("-k", "0", "--spec-max-batch", "2"), "--spec-max-batch")
    assert "k 0 decodes plainly" in line and "got 2" in line, line
    with pytest.raises(ConfigError, match="spec_max_batch.*got 2"):
        ServeConfig(k=0, spec_max_batch=2)
    with pytest.raises(ConfigError, match="spec_max_batch"):
        ServeConfig(spec_max_batch=-1)
    assert ServeConfig(spec_max_batch=0).spec_max_batch == 0
