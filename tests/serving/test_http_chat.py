"""``POST /v1/chat/completions`` as a user calls it: the openai client's chat API against the real server.

The prompt ids must be what transformers' ``apply_chat_template`` renders from the model
directory's own template (and, for one hand case, what the template says by hand); the
reply must be the CPU greedy oracle's continuation of those ids, and its text what
``/v1/completions`` gives for the same ids. The tokenizer is a tiny WordLevel one saved by
transformers with a chat template, so the whole file runs on the numpy backend in seconds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from graphburst import greedy_reference
from test_http_server import ServerProcess, sse_events

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 300
MODEL = "graphburst-stub"
BOS, EOS, SYSTEM, USER, ASSISTANT, END = 1, 2, 3, 4, 5, 6
WORDS = {BOS: "<s>", EOS: "</s>", SYSTEM: "<|system|>", USER: "<|user|>", ASSISTANT: "<|assistant|>", END: "<|end|>"}
# A template in the usual shape: bos, one block per message, the generation prompt, and a refusal.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'developer' %}"
            "{{ raise_exception('this template has no developer role') }}{% endif %}"
            " <|{{ m['role'] }}|> {{ m['content'] }} <|end|>{% endfor %}{% if add_generation_prompt %} <|assistant|>"
            "{% endif %}")
CHAT_FLAGS = ["--batch", "4", "-k", "3", "-m", "4", "--vocab", str(VOCAB), "--capacity", "256", "--sampling"]


def save_tokenizer(path: Path, *, template: str | None, eos_ids=(EOS, END)) -> None:
    """A WordLevel tokenizer (words ``w{i}`` and the special words above) saved by transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({WORDS.get(i, f"w{i}"): i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                chat_template=template)
    fast.save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos_ids)}))


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat_tokenizer")
    save_tokenizer(path, template=TEMPLATE)
    return path


@pytest.fixture(scope="module")
def hf(chat_dir):
    """The tokenizer as transformers loads it: the reference renderer."""
    return transformers.AutoTokenizer.from_pretrained(str(chat_dir))


@pytest.fixture(scope="module")
def chat_server(chat_dir):
    s = ServerProcess(*CHAT_FLAGS, "--tokenizer", str(chat_dir))
    yield s
    assert s.terminate() == 0, s.errors()


@pytest.fixture(scope="module")
def client(chat_server):
    return openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", timeout=30, max_retries=0)


def render(hf, messages) -> list:
    return list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def until_stop(tokens, stops=(EOS, END)) -> list:
    hits = [tokens.index(t) for t in stops if t in tokens]
    return tokens[: min(hits) + 1] if hits else tokens


def completions_text(url, ids, n) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": n}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


CONVERSATION = [{"role": "system", "content": "w40 w41"}, {"role": "user", "content": "w7 w8 w9"},
                {"role": "assistant", "content": [{"type": "text", "text": "w11"}, {"type": "text", "text": "w12"}]},
                {"role": "user", "content": "w13", "name": "w14"}]


def test_the_prompt_is_the_models_chat_template_as_transformers_renders_it(chat_server, client, hf):
    # By hand first, so the reference renderer itself is pinned: bos, the blocks, the generation prompt.
    ids = render(hf, [{"role": "user", "content": "w10 w11"}])
    assert ids == [BOS, USER, 10, 11, END, ASSISTANT]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w10 w11"}], max_tokens=3)
    assert r.prompt_token_ids == ids and r.usage.prompt_tokens == len(ids)
    # A whole conversation; a list of text parts is one string joined by newlines.
    joined = [dict(m, content="w11\nw12") if isinstance(m["content"], list) else m for m in CONVERSATION]
    r = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=3)
    assert r.prompt_token_ids == render(hf, joined)
    assert r.prompt_token_ids[:4] == [BOS, SYSTEM, 40, 41] and r.prompt_token_ids[-1] == ASSISTANT


def test_chat_reply_is_the_greedy_continuation_and_the_completions_text(chat_server, client, hf):
    messages = [{"role": "user", "content": "w7 w8 w9"}]
    ids = render(hf, messages)
    n = 24
    ref = greedy_reference(ids, n, VOCAB)
    assert not set(ref) & set(WORDS), "pick a conversation whose reply has no special word (a stop id or bos)"
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.token_ids == ref and c.finish_reason == "length" and c.message.role == "assistant"
    assert c.message.content == completions_text(chat_server.url, ids, n)["text"] == hf.decode(ref)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), n, len(ids) + n)
    # max_completion_tokens is OpenAI's current name for max_tokens
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5)
    assert r.choices[0].token_ids == ref[:5]

    # Streaming: the role first, then the content, the finish reason, then usage (asked for) and [DONE].
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    body = [ch for ch in chunks if ch.choices]
    assert [ch.choices[0].finish_reason for ch in body] == [None] * (len(body) - 1) + ["length"]
    assert "".join(ch.choices[0].delta.content or "" for ch in body) == c.message.content
    assert [t for ch in body[1:] for t in ch.choices[0].token_ids] == ref
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert all(ch.usage is None for ch in chunks[:-1])
    # Without include_usage no chunk carries usage; the raw stream ends with [DONE].
    lines = httpx.post(chat_server.url + "/v1/chat/completions", timeout=30,
                       json={"messages": messages, "max_tokens": n, "stream": True}).text.splitlines()
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    assert all("usage" not in json.loads(e) for e in events[:-1])
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_chat_stops_at_the_models_end_of_turn_ids(chat_server, client, hf):
    """The tokenizer's eos (EOS) and generation_config.json's eos ids (END) stop a reply
    (finish_reason "stop"), as vLLM does; a special token is not part of the text."""
    n = 60
    for stop in (EOS, END):  # for each, a conversation whose greedy reply hits that stop id first
        for word in range(7, VOCAB):
            messages = [{"role": "user", "content": f"w{word}"}]
            ref = greedy_reference(render(hf, messages), n, VOCAB)
            want = until_stop(ref)
            if want[-1] == stop and len(want) < n:
                break
        else:
            pytest.fail(f"no conversation stops at {stop}")
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n)
        c = r.choices[0]
        assert c.token_ids == want and c.finish_reason == "stop", (stop, want, c.token_ids)
        assert c.message.content == hf.decode(want, skip_special_tokens=True)
        assert "</s>" not in c.message.content
        # A stop id of the request's own ends it earlier
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n,
                                           extra_body={"stop_token_ids": [want[1]]})
        assert r.choices[0].token_ids == want[:2] and r.choices[0].finish_reason == "stop"


def test_n_choices_and_seeds(chat_server, client, hf):
    messages = [{"role": "user", "content": "w20 w21"}]
    ref = greedy_reference(render(hf, messages), 10, VOCAB)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, n=2)
    assert [c.index for c in r.choices] == [0, 1] and all(c.token_ids == ref for c in r.choices)
    assert r.usage.prompt_tokens == len(r.prompt_token_ids) and r.usage.completion_tokens == 20
    # Sampled: choice i takes seed + i, so the choices differ and each is reproduced by its own seed.
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, n=3, temperature=1.5, seed=11)
    got = [c.token_ids for c in sorted(r.choices, key=lambda c: c.index)]
    assert len({tuple(g) for g in got}) > 1, got
    for i in range(3):
        one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=1.5,
                                             seed=11 + i)
        assert one.choices[0].token_ids == got[i], i
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, n=2, stream=True))
    for i in range(2):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert [t for c in mine[1:] for t in c.token_ids] == ref


@pytest.mark.parametrize("body, param, named", [
    ({}, "messages", "messages"),
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": "hi"}, "messages", "list"),
    ({"messages": [{"role": "user", "content": "w1"}, "w2"]}, "messages[1]", "messages[1]"),
    ({"messages": [{"role": "user", "content": "w1"}, {"content": "w2"}]}, "messages[1].role", "missing"),
    ({"messages": [{"role": "wizard", "content": "w1"}]}, "messages[0].role", "wizard"),
    ({"messages": [{"role": 5, "content": "w1"}]}, "messages[0].role", "one of"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type", "only text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text",
     "string"),
    ({"messages": [{"role": "user", "content": "w1", "name": 4}]}, "messages[0].name", "string"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls", "tool calls"),
    ({"messages": [{"role": "developer", "content": "w1"}]}, "messages", "no developer role"),
    ({"messages": [{"role": "user", "content": "w1 " * 20_000}]}, "messages", "characters"),
    ({"messages": [{"role": "user", "content": "w1 " * 300}]}, "messages", "a slot holds 256"),
    ({"messages": [{"role": "user", "content": "w1"}], "max_tokens": 0}, "max_tokens", "0"),
    ({"messages": [{"role": "user", "content": "w1"}], "max_completion_tokens": 999}, "max_completion_tokens", "999"),
    ({"messages": [{"role": "user", "content": "w1"}], "n": 0}, "n", "n must be"),
    ({"messages": [{"role": "user", "content": "w1"}], "stream_options": {"include_usage": True}}, "stream_options",
     "stream: true"),
    ({"messages": [{"role": "user", "content": "w1"}], "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options", "include_usage"),
    ({"messages": [{"role": "user", "content": "w1"}], "stop": ["w5"]}, "stop", "stop_token_ids"),
    ({"messages": [{"role": "user", "content": "w1"}], "tools": [{"type": "function"}]}, "tools", "tools"),
    ({"messages": [{"role": "user", "content": "w1"}], "logprobs": True}, "logprobs", "logprobs"),
    ({"messages": [{"role": "user", "content": "w1"}], "response_format": {"type": "json_object"}},
     "response_format", "json_object"),
    ({"messages": [{"role": "user", "content": "w1"}], "stop_token_ids": [VOCAB]}, "stop_token_ids", str(VOCAB)),
    ({"messages": [{"role": "user", "content": "w1"}], "temperature": -1}, "temperature", "-1"),
])
def test_bad_chat_bodies_get_400_naming_the_field(chat_server, body, param, named):
    r = httpx.post(chat_server.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and named in err["message"], err


def test_good_chat_after_bad_ones_and_a_wrong_model_is_404(chat_server):
    r = httpx.post(chat_server.url + "/v1/chat/completions", timeout=10,
                   json={"messages": [{"role": "user", "content": "w1"}], "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(chat_server.url + "/v1/chat/completions", timeout=10,
                   json={"messages": [{"role": "user", "content": "w1"}], "max_tokens": 2, "user": "u", "whatever": 1})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2


def test_a_model_without_a_chat_template_gets_a_400_and_completions_still_work(tmp_path):
    save_tokenizer(tmp_path, template=None)
    s = ServerProcess("--batch", "2", "--vocab", str(VOCAB), "--capacity", "256", "--tokenizer", str(tmp_path))
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}]},
                       timeout=10)
        assert r.status_code == 400, r.text
        assert "no chat template" in r.json()["error"]["message"] and MODEL in r.json()["error"]["message"]
        assert completions_text(s.url, "w15 w16", 4)["token_ids"] == greedy_reference([15, 16], 4, VOCAB)
    finally:
        assert s.terminate() == 0, s.errors()


def test_chat_without_a_tokenizer_is_a_400_saying_it_needs_text():
    s = ServerProcess("--batch", "1", "--vocab", str(VOCAB), "--capacity", "64")
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       timeout=10)
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"], r.text
        assert "--tokenizer" in r.json()["error"]["message"]
    finally:
        assert s.terminate() == 0, s.errors()


def test_the_serving_docs_chat_example_runs(chat_server, hf, capsys):
    """docs/serving.md's chat example, as written, against a server with a chat template."""
    doc = (ROOT / "docs" / "serving.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "chat.completions.create" in b)
    assert 'OpenAI(base_url="http://127.0.0.1:8000/v1"' in code
    exec(compile(code.replace("http://127.0.0.1:8000", chat_server.url), "docs/serving.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    messages = json.loads(re.search(r"messages = (\[.*?\])\n", code, re.S).group(1))
    ids = render(hf, messages)
    n = int(re.search(r"max_tokens=(\d+)", code).group(1))
    want = until_stop(greedy_reference(ids, n, VOCAB))
    assert printed[0] == hf.decode(want, skip_special_tokens=True), (printed, want)
    assert printed[1:] == printed[:1]  # the streamed deltas make the same text


def test_a_tokenizer_transformers_cannot_read_is_one_line_and_exit_2(chat_dir, tmp_path):
    import os
    import shutil
    import subprocess
    import sys

    shutil.copy(chat_dir / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "graphburst.cli", "serve", "--http", "127.0.0.1:0", "--backend", "numpy",
                        "--vocab", str(VOCAB), "--tokenizer", str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "--tokenizer" in p.stderr and "transformers cannot load this tokenizer" in p.stderr, p.stderr


def test_without_transformers_completions_serve_and_chat_says_what_is_missing(chat_dir, tmp_path):
    """transformers (or jinja2) not installed: the server starts, says so once, and chat is a 400 naming it."""
    fake = tmp_path / "transformers"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('transformers hidden by the test')\n")
    s = ServerProcess("--batch", "2", "--vocab", str(VOCAB), "--capacity", "256", "--tokenizer", str(chat_dir),
                      env={"PYTHONPATH": f"{tmp_path}:{ROOT}"})
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}]},
                       timeout=10)
        assert r.status_code == 400 and "transformers hidden by the test" in r.json()["error"]["message"], r.text
        assert "graphburst[serve]" in r.json()["error"]["message"]
        assert completions_text(s.url, "w15 w16", 4)["token_ids"] == greedy_reference([15, 16], 4, VOCAB)
    finally:
        assert s.terminate() == 0, s.errors()
    assert "/v1/chat/completions is off" in s.errors()
