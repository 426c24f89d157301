"""The serve start-up lines say what nothing else does: how requests are decoded, how long a chat request
without max_tokens runs, and that the stub models sample slowly on the CPU; docs/serving.md says both."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from graphburst.serving.factory import CPU_STUB_SAMPLING_BURST_S, ServeConfig, build_loop, startup_notes

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
VOCAB = 300
CAPACITY = 64


def chat_tokenizer(path: Path) -> Path:
    """A WordLevel tokenizer of VOCAB words with a chat template and no end-of-turn id the stubs would hit."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}w3"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template).save_pretrained(str(path))
    return path


def test_the_http_start_up_states_a_chat_requests_default_length_and_it_holds(tmp_path):
    pytest.importorskip("aiohttp")
    tok = chat_tokenizer(tmp_path / "tok")
    proc = subprocess.Popen([sys.executable, "-m", "graphburst.cli", "serve", "--http", "127.0.0.1:0", "--backend",
                             "numpy", "--batch", "2", "--vocab", str(VOCAB), "--capacity", str(CAPACITY),
                             "--tokenizer", str(tok)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=60), "the server did not start"
        url = proc.stdout.readline().decode().rsplit(" ", 1)[1].strip()
        body = json.dumps({"messages": [{"role": "user", "content": "w5 w6"}]}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.load(resp)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    err = err.decode()
    line = next((x for x in err.splitlines() if "chat request without max_tokens" in x), None)
    assert line is not None and f"up to {CAPACITY} tokens minus its prompt" in line, err
    usage = answer["usage"]  # what the line said: the whole slot after the prompt
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CAPACITY, answer
    assert answer["choices"][0]["finish_reason"] == "length"


def test_the_chat_line_only_with_chat_and_the_slow_line_only_for_a_slow_cpu_sampler():
    loop = build_loop(ServeConfig(backend="numpy", batch=2, vocab=VOCAB, capacity=CAPACITY, sampling=True))
    small = ServeConfig(backend="numpy", batch=2, vocab=VOCAB, capacity=CAPACITY, sampling=True)
    assert startup_notes(small, loop) == []  # a burst of 2 slots x 300 tokens is quick
    (chat,) = startup_notes(small, loop, chat=True)
    assert f"up to {CAPACITY} tokens" in chat
    defaults = ServeConfig(backend="numpy", sampling=True)  # what `graphburst serve --sampling` gets on a CPU
    (slow,) = startup_notes(defaults, loop)
    assert "slow" in slow and f"about {CPU_STUB_SAMPLING_BURST_S} s a burst at --batch 64 --vocab 32000" in slow
    assert startup_notes(ServeConfig(backend="numpy"), loop) == []  # greedy: no line


def test_serving_doc_says_both_in_a_sentence():
    text = (ROOT / "docs" / "serving.md").read_text()
    assert "A chat request without `max_tokens`" in text and "up to `--capacity` tokens minus the rendered prompt" in text
    assert "With `--sampling` on the CPU the stub models are slow" in text
    assert f"about {CPU_STUB_SAMPLING_BURST_S} s a burst" in text


def test_plain_decoding_and_the_burst_form_are_said_at_start_up(monkeypatch):
    """A served model with no draft says it decodes plainly; a device-exit or ladder loop says which it runs
    (and, where "auto" fell back to the ladder, why)."""
    plain = ServeConfig(backend="numpy", batch=2, vocab=VOCAB, capacity=CAPACITY, k=0)
    (line,) = startup_notes(plain, build_loop(plain))
    assert line.startswith("no draft: plain decoding, one token a round")
    on = ServeConfig(backend="numpy", batch=2, vocab=VOCAB, capacity=CAPACITY, device_exit="on")
    assert startup_notes(on, build_loop(on)) == ["bursts end on the device: each burst's rounds run in a "
                                                 "conditional WHILE node"]
    ladder = ServeConfig(backend="numpy", batch=2, vocab=VOCAB, capacity=CAPACITY, device_exit="ladder")
    assert startup_notes(ladder, build_loop(ladder)) == ["bursts of a ladder of 1, 2, 4, 8 rounds, each as long as "
                                                         "the queue wants"]
    from graphburst import capture

    monkeypatch.setattr(capture, "device_exit_refusal", lambda dec: ("no conditional nodes here", "probe: none"))
    auto = ServeConfig(backend="numpy", batch=2, vocab=VOCAB, capacity=CAPACITY, device_exit="auto")
    (line,) = startup_notes(auto, build_loop(auto))
    assert line.startswith("bursts of a ladder of 1, 2, 4, 8 rounds") and "cannot be built here: probe: none" in line


def test_decode_kernels_other_than_auto_are_said_at_start_up():
    """A model served on decode kernels of the user's choice says which; the default says nothing."""
    pytest.importorskip("torch")
    for kernels, want in (("auto", []), ("reference", ["decode and verify forwards on decode_kernels='reference'"])):
        config = ServeConfig(backend="numpy", model="tiny-random", batch=2, capacity=CAPACITY, decode_kernels=kernels)
        assert startup_notes(config, build_loop(config)) == want


@pytest.mark.parametrize("args, message", [
    (["--decode-kernels", "folded"], "--decode-kernels: applies to a model checkpoint only"),
    (["--model", "tiny-random", "--decode-kernels", "pdl"], "--decode-kernels: pdl runs Triton kernels on a GPU, "
                                                             "and this run has none (--backend numpy)"),
])
def test_decode_kernels_a_run_cannot_launch_are_one_line_and_exit_2(args, message):
    proc = subprocess.run([sys.executable, "-m", "graphburst.cli", "serve", "--backend", "numpy", *args],
                          input="", capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
