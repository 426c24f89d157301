"""``--draft ngram`` on the command line: serve (JSONL; HTTP shares its builder), demo, flag errors."""

from __future__ import annotations

import argparse
import json

import pytest

from graphburst import NgramDraft, greedy_reference
from graphburst.backend import Backend
from graphburst import serve_cli
from graphburst.serve_cli import check_args
from graphburst.serving.factory import build_loop

from test_cli import SMALL, cli, one_line_error


def test_serve_jsonl_with_prompt_lookup():
    lines = [{"prompt": [1, 2, 3, 1, 2, 3, 1, 2], "max_new_tokens": 12},
             {"prompt": [4, 4, 4], "max_new_tokens": 5, "ngram_max": 2},  # a per-request n range
             {"prompt": [4], "max_new_tokens": 5, "ngram_min": 9}]  # above --ngram-max: only this line fails
    stdin = "".join(json.dumps(x) + "\n" for x in lines).encode()
    out = cli("serve", *SMALL, "--draft", "ngram", "--ngram-max", "3", stdin=stdin)
    recs = sorted((json.loads(x) for x in out.stdout.decode().splitlines()), key=lambda r: r["line"])
    assert out.returncode == 0, out.stderr.decode()
    for rec, line in zip(recs[:2], lines[:2]):
        assert rec["tokens"] == greedy_reference(line["prompt"], line["max_new_tokens"], 5003)
    assert recs[2]["error"] == "ngram_min (9) must be <= ngram_max (3)"


def test_build_loop_makes_the_ngram_draft():
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["serve", "--backend", "numpy", "--batch", "2", "--capacity", "64", "--draft", "ngram",
                              "--ngram-min", "2"])
    check_args(args)
    loop = build_loop(serve_cli.parse(args), Backend("numpy"))
    assert isinstance(loop.dec.draft, NgramDraft) and loop.dec.draft.default_range == (2, 4)
    assert loop.dec.draft.capacity == 64


@pytest.mark.parametrize("cmd, args, flag", [
    ("serve", ["--ngram-min", "2"], "--ngram-min"),  # without --draft ngram
    ("serve", ["--draft", "ngram", "--ngram-min", "4", "--ngram-max", "2"], "--ngram-min"),
    ("serve", ["--draft", "ngram", "--ngram-max", "17"], "--ngram-max"),
    ("demo", ["--ngram-max", "3"], "--ngram-max"),
    ("demo", ["--draft", "ngram", "--ngram-min", "0"], "--ngram-min"),
    ("demo", ["--draft", "nope"], "--draft"),
])
def test_ngram_flag_errors_are_one_line(cmd, args, flag):
    one_line_error(cli(cmd, "--backend", "numpy", *args), flag)


def test_demo_with_prompt_lookup_matches_greedy():
    out = cli("demo", "--backend", "numpy", "--draft", "ngram", "--vocab", "7", "--bursts", "2", "--batch", "2")
    text = out.stdout.decode()
    assert out.returncode == 0, out.stderr.decode()
    assert "prompt lookup" in text and "NO" not in text
