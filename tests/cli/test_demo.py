"""``graphburst demo`` as a user runs it: graph replay by default, stub and Llama pairs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def demo(*args, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "graphburst.cli", "demo", "--backend", "numpy", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def check_ran(res, mode="graph"):
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"mode={mode}" in res.stdout
    assert "NO" not in res.stdout and res.stdout.count("yes") >= 2
    assert "host syncs: 3 over 3 bursts (1.0 per burst)" in res.stdout or mode != "graph"
    assert "numpy reference backend" in res.stdout


def test_stub_demo_defaults_to_graph_replay():
    check_ran(demo("--bursts", "3", "--batch", "2"))


def test_eager_mode_reports_a_sync_per_round():
    res = demo("--bursts", "2", "--batch", "2", "-m", "3", "--mode", "per_round_sync")
    check_ran(res, "per_round_sync")
    assert "host syncs: 8 over 2 bursts (4.0 per burst)" in res.stdout  # 3 rounds + 1 drain per burst


def test_tiny_random_llama_demo():
    res = demo("--model", "tiny-random", "--bursts", "3", "--batch", "2", "-m", "4")
    check_ran(res)
    assert "tiny-random" in res.stdout


def test_tiny_random_demo_on_the_folded_decode_kernels():
    """``--decode-kernels folded`` under Triton's interpreter (how a CPU runs them): the folded layer's kernels
    inside every round of the burst, the tokens checked against the SDPA greedy oracle. Without the
    interpreter the same flag is one line and exit 2, before any model is built."""
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "TRITON_INTERPRET": "1"}
    args = ["--model", "tiny-random", "--decode-kernels", "folded", "-k", "2", "-m", "2", "--bursts", "1",
            "--batch", "2"]
    res = subprocess.run([sys.executable, "-m", "graphburst.cli", "demo", "--backend", "numpy", *args],
                         capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "NO" not in res.stdout and res.stdout.count("yes") == 2
    res = demo(*args)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "--decode-kernels: folded runs Triton kernels on a GPU, and this run has none" in res.stderr


def test_checkpoint_pair_demo(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, bos_token_id=None,
                      pad_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "target")
    LlamaForCausalLM(LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1})).save_pretrained(tmp_path / "draft")
    res = demo("--model", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--bursts", "3",
               "--batch", "2", "-m", "2")
    check_ran(res)
    # The target alone decodes plainly, one token a round, checked against the same greedy oracle
    res = demo("--model", str(tmp_path / "target"), "--bursts", "3", "--batch", "2", "-m", "2")
    check_ran(res)
    assert "plain decoding" in res.stdout and "12 tokens in" in res.stdout  # 2 slots x 3 bursts x 2 rounds


@pytest.mark.parametrize("args, flag", [
    (("--draft", "."), "--draft"),
    (("--model", "/no/such/dir"), "--model"),
    (("--model", "."), "--model"),
])
def test_model_flag_errors_are_one_line(args, flag):
    res = demo(*args, timeout=60)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and flag in lines[0] and "Traceback" not in res.stderr, res.stderr


def test_a_trained_model_answers_a_text_prompt():
    # the README's real-model line: SmolLM2-135M-Instruct from its GGUF, its chat template, prompt lookup
    res = demo("--model", "smollm2-135m", "--draft", "ngram", "--prompt", "What is the capital of France?")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "answer The capital of France is Paris." in res.stdout
    assert "matches greedy" in res.stdout and "NO" not in res.stdout


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi"], "--prompt: needs a --model that carries a tokenizer"),
    (["--model", "tiny-random", "--prompt", "hi"], "--prompt: needs a --model that carries a tokenizer"),
    (["--model", "smollm2-135m", "--draft", "ngram", "--prompt", "  "], "--prompt: is empty"),
    (["--model", "smollm2-135m", "-k", "4"], "-k: 4 drafts per round need --draft MODEL or --draft ngram"),
    (["--model", "smollm2-135m", "--draft", "ngram", "-k", "0"], "-k: 0 decodes plainly, and --draft ngram"),
    (["-k", "0", "--tp", "2"], "-k: 0 (plain decoding) is not wired into --tp/--pp"),
    (["--model", "no/such/dir", "--draft", "ngram"], "--model: no such checkpoint: 'no/such/dir'"),
    (["--model", __file__, "--draft", "ngram"], "is a file but not a .gguf file"),
    (["--decode-kernels", "pdl"], "--decode-kernels: needs --model"),
    (["--model", "tiny-random", "--decode-kernels", "fast"], "--decode-kernels: invalid choice: 'fast'"),
])
def test_prompt_and_model_flag_errors_are_one_line(args, message):
    res = demo(*args)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
