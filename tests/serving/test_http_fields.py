"""Every request field is applied or refused: the field table against the OpenAI schemas, the docs and the server.

``FIELDS`` (graphburst/serving/openai_api.py) classifies each field of each route; the
schema test walks the request types of the installed ``openai`` package (and the vLLM
extensions the server knows) so that a field a new client version adds fails here until it
is classified and documented. Over the real server (numpy backend, stub models, a tiny
WordLevel tokenizer with a BOS post-processor and a chat template; ``--sampling --fields``),
each refused field with a non-neutral value is a 400 naming it, its neutral values change
nothing, and each applied field changes the answer as vLLM's does; every expected token comes
from the CPU greedy oracle, or for the logits processing fields from the library's host
reference (``fields_reference.host_decode``: transformers' processors over the stub target's
logits). A server without ``--fields`` refuses those with a 400 naming the field and the flags.
"""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import httpx
import pytest
from fields_reference import host_decode
from test_http_chat import CHAT_FLAGS, EOS, TEMPLATE, VOCAB, WORDS, until_stop
from test_http_server import ServerProcess, sse_events

from graphburst import greedy_reference
from graphburst.models.stubs import default_peak
from graphburst.serving import openai_api as api

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
BOS = 1
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER_W7 = [{"role": "user", "content": "w7 w8"}]
BASE = {COMPLETIONS: {"prompt": [7, 8], "max_tokens": 4}, CHAT: {"messages": USER_W7, "max_tokens": 4}}

# vLLM's extensions of the two request types (vllm/entrypoints/openai/protocol.py, CompletionRequest and
# ChatCompletionRequest: the sampling-params and extra-params blocks), as a client sends them.
VLLM_SHARED = {
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "bad_words", "add_special_tokens",
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
    "structured_outputs", "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params",
    "vllm_xargs",
}
VLLM = {COMPLETIONS: VLLM_SHARED | {"prompt_embeds"},
        CHAT: VLLM_SHARED | {"best_of", "echo", "add_generation_prompt", "continue_final_message", "documents",
                             "chat_template", "chat_template_kwargs", "mm_processor_kwargs"}}

# One value per logits processing field that asks for something: a server without --fields refuses each.
DEVICE_SAMPLES = {"presence_penalty": 0.5, "frequency_penalty": -1.0, "logit_bias": {"5": 10},
                  "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2, "ignore_eos": True}

# One value per refused field that asks for something the server cannot do. A refused field
# without one fails test_every_refused_field_has_a_non_neutral_sample, so none goes untested.
NON_NEUTRAL = {
    "stop": ["w5"], "response_format": {"type": "json_object"}, "use_beam_search": True, "length_penalty": 0.5,
    "allowed_token_ids": [5, 6], "bad_words": ["w5"], "prompt_logprobs": 1, "truncate_prompt_tokens": 2,
    "guided_json": {"type": "object"}, "guided_regex": "w[0-9]", "guided_choice": ["w5", "w6"],
    "guided_grammar": "root ::= 'w5'", "structural_tag": "{}", "structured_outputs": {"regex": "w5"},
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ", "logits_processors": ["a.b"],
    "priority": 1, "kv_transfer_params": {"do_remote_decode": True}, "vllm_xargs": {"a": 1},
    "spaces_between_special_tokens": False, "best_of": 2, "logprobs": 2, "suffix": "w9", "prompt_embeds": "AAAA",
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": False},
    "documents": [{"title": "w1", "text": "w2"}], "add_special_tokens": True, "top_logprobs": 2,
    "tools": [{"type": "function", "function": {"name": "f"}}], "functions": [{"name": "f"}],
    "tool_choice": "required", "function_call": {"name": "f"}, "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "w5"}, "reasoning_effort": "high",
    "verbosity": "low", "web_search_options": {}, "moderation": {"model": "omni-moderation-latest"},
}
NON_NEUTRAL_ON = {(CHAT, "logprobs"): True}  # chat's logprobs is a flag, completions' a count

# Values for ignored fields: accepted, and the tokens are the same.
IGNORED_VALUES = {"user": "u", "request_id": "r1", "cache_salt": "s" * 43, "return_token_ids": True,
                  "return_tokens_as_token_ids": True, "include_stop_str_in_output": True,
                  "parallel_tool_calls": True, "metadata": {"k": "v"}, "store": True, "service_tier": "flex",
                  "safety_identifier": "id", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
                  "prompt_cache_options": {}, "mm_processor_kwargs": {"a": 1}}


def schema_fields(route: str) -> set:
    """The request fields of the installed openai package's types for ``route`` (the stream flag included)."""
    if route == COMPLETIONS:
        from openai.types import completion_create_params as params
    else:
        from openai.types.chat import completion_create_params as params
    return {name for cls in (params.CompletionCreateParamsStreaming, params.CompletionCreateParamsNonStreaming)
            for name in typing.get_type_hints(cls)}


def docs_table(route: str) -> dict:
    """docs/serving.md's table for ``route``: field -> status, one row naming one or more fields."""
    doc = (ROOT / "docs" / "serving.md").read_text()
    start = doc.index(f"**`POST {route}`**")
    rows = re.search(r"\n(\| field \| status \|.*?)\n\n", doc[start:], re.DOTALL).group(1).splitlines()[2:]
    out = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            assert name not in out, f"{route}: {name} is in two rows of the docs table"
            out[name] = cells[1]
    return out


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_every_schema_field_is_classified_and_documented(route):
    table = api.FIELDS[route]
    schema = schema_fields(route)
    assert {"prompt" if route == COMPLETIONS else "messages", "stream", "logit_bias"} <= schema  # the walk works
    assert not schema - table.keys(), f"{route}: OpenAI fields with no status in FIELDS: {sorted(schema - table.keys())}"
    assert not VLLM[route] - table.keys(), f"{route}: vLLM fields with no status: {sorted(VLLM[route] - table.keys())}"
    assert {f.status for f in table.values()} <= {api.APPLIED, api.REFUSED, api.IGNORED}
    docs = docs_table(route)
    status = {name: f.status + (f" with `{f.needs}`" if f.needs else "") for name, f in table.items()}
    assert docs == status, {
        "missing from the docs": sorted(table.keys() - docs.keys()), "not in FIELDS": sorted(docs.keys() - table.keys()),
        "other status": sorted(n for n in docs.keys() & table.keys() if docs[n] != status[n])}


def test_the_device_fields_are_one_table_applied_with_the_flags():
    assert api.DEVICE_FIELDS == {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {},
                                 "repetition_penalty": 1, "min_p": 0, "min_tokens": 0, "ignore_eos": False}
    assert api.DEVICE_FIELDS.keys() == DEVICE_SAMPLES.keys()
    for table in api.FIELDS.values():
        assert all(table[name].status == api.DEVICE_FIELD_STATUS == api.APPLIED for name in api.DEVICE_FIELDS)
        assert {name for name, f in table.items() if f.needs} == set(api.DEVICE_FIELDS)
        assert all(table[name].needs == api.FIELDS_FLAGS == "--sampling --fields" for name in api.DEVICE_FIELDS)


def refused(route: str) -> list:
    return [name for name, f in api.FIELDS[route].items() if f.status == api.REFUSED]


def test_every_refused_field_has_a_non_neutral_sample():
    missing = {name for route in api.FIELDS for name in refused(route)} - NON_NEUTRAL.keys()
    assert not missing, f"add a value that asks for something to NON_NEUTRAL for {sorted(missing)}"
    unused = {name for name in IGNORED_VALUES} ^ {n for t in api.FIELDS.values() for n, f in t.items()
                                                  if f.status == api.IGNORED}
    assert not unused, f"IGNORED_VALUES and the ignored fields differ: {sorted(unused)}"


# ---------------------------------------------------------------------- the server


def save_tokenizer(path: Path) -> None:
    """test_http_chat's WordLevel tokenizer and template, plus a post-processor that puts <s> before a text
    prompt (so add_special_tokens has something to change)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({WORDS.get(i, f"w{i}"): i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                chat_template=TEMPLATE)
    fast.save_pretrained(str(path))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fields_tokenizer")
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def hf(tok_dir):
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.fixture(scope="module")
def server(tok_dir):
    s = ServerProcess(*CHAT_FLAGS, "--fields", "--tokenizer", str(tok_dir))
    yield s
    assert s.terminate() == 0, s.errors()


def post(server, route, **fields) -> httpx.Response:
    return httpx.post(server.url + route, json={**BASE[route], **fields}, timeout=30)


def ok(server, route, **fields) -> dict:
    r = post(server, route, **fields)
    assert r.status_code == 200, r.text
    return r.json()


def events(server, route, **fields) -> list:
    r = post(server, route, stream=True, **fields)
    assert r.status_code == 200, r.text
    raw = sse_events(r.text.splitlines())
    assert raw[-1] == "[DONE]"
    return [json.loads(e) for e in raw[:-1]]


def chat_ref(ids, n) -> list:
    """The greedy reply to ``ids``: it ends at the tokenizer's eos (this tokenizer has no generation_config.json)."""
    return until_stop(greedy_reference(ids, n, VOCAB), (EOS,))


def render(hf, messages, **kw) -> list:
    kw.setdefault("add_generation_prompt", True)
    return list(hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


@pytest.mark.parametrize("route, name", [(route, name) for route in api.FIELDS for name in refused(route)])
def test_each_refused_field_with_a_non_neutral_value_is_a_400_naming_it(server, route, name):
    value = NON_NEUTRAL_ON.get((route, name), NON_NEUTRAL[name])
    r = post(server, route, **{name: value})
    assert r.status_code == 400, (name, r.text)
    err = r.json()["error"]
    assert err["param"] == name and name in err["message"] and api.shown(value) in err["message"], err
    assert set(err) == {"message", "type", "param", "code"} and err["message"].count(". ") == 0, err


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_neutral_and_ignored_values_change_nothing(server, route):
    plain = ok(server, route)["choices"][0]
    neutral = {name: f.neutral[0] for name, f in api.FIELDS[route].items()
               if f.status == api.REFUSED and f.neutral and name not in api.DEVICE_FIELDS}
    neutral |= {name: None for name in refused(route) if name not in neutral}  # null: not sent
    neutral |= dict(api.DEVICE_FIELDS, presence_penalty=0, repetition_penalty=1, logit_bias={"5": 0})
    ignored = {name: IGNORED_VALUES[name] for name, f in api.FIELDS[route].items() if f.status == api.IGNORED}
    got = ok(server, route, **neutral, **ignored, whatever_no_schema_has=1)["choices"][0]
    assert got["token_ids"] == plain["token_ids"] and got.get("text") == plain.get("text"), (got, plain)
    if route == COMPLETIONS:
        assert plain["token_ids"] == greedy_reference([7, 8], 4, VOCAB)


@pytest.mark.parametrize("body, param, named", [
    ({"logit_bias": {"x": 1}}, "logit_bias", '"x"'),
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias", f"[0, {VOCAB})"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "101"),
    ({"logit_bias": {"5": True}}, "logit_bias", "true"),
    ({"logit_bias": [5]}, "logit_bias", "[5]"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": "a"}, "frequency_penalty", '"a"'),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"min_tokens": -1}, "min_tokens", "-1"),
    ({"min_tokens": 1.5}, "min_tokens", "1.5"),
    ({"ignore_eos": "yes"}, "ignore_eos", '"yes"'),
    ({"echo": 1}, "echo", "true or false"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options", "include_usage"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options", '"yes"'),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
])
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_bad_values_of_checked_fields_are_400s_naming_them(server, route, body, param, named):
    r = post(server, route, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and named in err["message"], err


def test_a_greedy_server_refuses_echo_without_a_tokenizer_and_the_fields_without_the_flags():
    s = ServerProcess("--batch", "1", "--vocab", str(VOCAB), "--capacity", "64")
    try:
        r = httpx.post(s.url + COMPLETIONS, json={"prompt": [7, 8], "max_tokens": 2, "echo": True}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
        assert "tokenizer" in r.json()["error"]["message"]
        for name, value in DEVICE_SAMPLES.items():
            r = httpx.post(s.url + COMPLETIONS, json={"prompt": [7, 8], "max_tokens": 2, name: value}, timeout=10)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == name, r.text
            assert f"{name}={api.shown(value)}" in err["message"] and "--sampling --fields" in err["message"], err
        # Their neutral values are taken, and change nothing.
        neutral = dict(api.DEVICE_FIELDS, logit_bias={"5": 0, "6": -0.0}, min_p=0, repetition_penalty=1)
        r = httpx.post(s.url + COMPLETIONS, json={"prompt": [7, 8], "max_tokens": 6, **neutral}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy_reference([7, 8], 6, VOCAB)
    finally:
        assert s.terminate() == 0, s.errors()


# ---------------------------------------------------------------------- applied fields of /v1/completions


def test_completions_echo_prepends_the_prompts_text(server, hf):
    n = 6
    for prompt, ids, text in (("w7 w8", [BOS, 7, 8], "w7 w8"), ([7, 8], [7, 8], "w7 w8")):
        plain = ok(server, COMPLETIONS, prompt=prompt, max_tokens=n)["choices"][0]
        assert plain["token_ids"] == greedy_reference(ids, n, VOCAB) and not plain["text"].startswith(text)
        echoed = ok(server, COMPLETIONS, prompt=prompt, max_tokens=n, echo=True)["choices"][0]
        assert echoed["text"] == text + plain["text"] and echoed["token_ids"] == plain["token_ids"], echoed
        chunks = events(server, COMPLETIONS, prompt=prompt, max_tokens=n, echo=True)
        assert chunks[0]["choices"][0]["text"].startswith(text)
        assert "".join(c["choices"][0]["text"] for c in chunks) == echoed["text"]
    # Several prompts: each choice echoes its own.
    body = ok(server, COMPLETIONS, prompt=["w9", [10, 11]], max_tokens=2, echo=True)
    alone = [ok(server, COMPLETIONS, prompt=p, max_tokens=2, echo=True)["choices"][0]["text"] for p in ("w9", [10, 11])]
    assert [c["text"] for c in body["choices"]] == alone and alone[1].startswith("w10 w11")


def test_add_special_tokens_false_tokenizes_without_bos(server):
    with_bos = ok(server, COMPLETIONS, prompt="w7 w8", max_tokens=8)
    without = ok(server, COMPLETIONS, prompt="w7 w8", max_tokens=8, add_special_tokens=False)
    assert with_bos["usage"]["prompt_tokens"] == 3 and without["usage"]["prompt_tokens"] == 2
    assert with_bos["choices"][0]["token_ids"] == greedy_reference([BOS, 7, 8], 8, VOCAB)
    assert without["choices"][0]["token_ids"] == greedy_reference([7, 8], 8, VOCAB)
    assert with_bos["choices"][0]["token_ids"] != without["choices"][0]["token_ids"]


def test_skip_special_tokens_drops_them_from_the_text(server, hf):
    n = 40
    prompt = next([w] for w in range(7, VOCAB) if EOS in greedy_reference([w], n, VOCAB))  # a reply holding </s>
    keep = ok(server, COMPLETIONS, prompt=prompt, max_tokens=n)["choices"][0]
    skip = ok(server, COMPLETIONS, prompt=prompt, max_tokens=n, skip_special_tokens=True)["choices"][0]
    assert keep["token_ids"] == skip["token_ids"] == greedy_reference(prompt, n, VOCAB)
    assert keep["text"] == hf.decode(keep["token_ids"]) and "</s>" in keep["text"]
    assert skip["text"] == hf.decode(keep["token_ids"], skip_special_tokens=True) and "</s>" not in skip["text"]


def test_completions_n_gives_each_prompt_n_choices(server):
    body = ok(server, COMPLETIONS, prompt=[[7, 8], [9]], max_tokens=3, n=2)
    ref = [greedy_reference([7, 8], 3, VOCAB), greedy_reference([9], 3, VOCAB)]
    assert [(c["index"], c["token_ids"]) for c in body["choices"]] == [(0, ref[0]), (1, ref[0]), (2, ref[1]),
                                                                       (3, ref[1])]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 12
    # Sampled: choice i of a prompt takes seed + i, as on the chat route.
    got = ok(server, COMPLETIONS, prompt=[7, 8], max_tokens=8, n=2, temperature=1.5, seed=5)["choices"]
    for i in range(2):
        one = ok(server, COMPLETIONS, prompt=[7, 8], max_tokens=8, temperature=1.5, seed=5 + i)["choices"][0]
        assert got[i]["token_ids"] == one["token_ids"], i
    assert got[0]["token_ids"] != got[1]["token_ids"]


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_stream_options_usage_as_openai_and_vllm_send_it(server, route, hf):
    n = 12
    extra = {"prompt": [[7, 8], [9]]} if route == COMPLETIONS else {"n": 2}
    if route == CHAT:  # a chat reply may end at eos before n tokens
        n = len(chat_ref(render(hf, USER_W7), n))
    total = [ch for ch in events(server, route, max_tokens=n, **extra) if ch.get("usage")]
    # include_usage: usage null on every choice chunk, then one chunk of no choices with the totals.
    chunks = events(server, route, max_tokens=n, stream_options={"include_usage": True}, **extra)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2 * n
    assert all("usage" in ch and ch["usage"] is None for ch in chunks[:-1]), chunks
    if route == COMPLETIONS:  # without stream_options the last choice chunk carries the totals
        assert total[-1]["usage"] == chunks[-1]["usage"] and total[-1]["choices"]
    else:
        assert total == []
    # continuous_usage_stats: every chunk carries its choice's usage so far.
    chunks = events(server, route, max_tokens=n, stream_options={"include_usage": True,
                                                                 "continuous_usage_stats": True}, **extra)
    seen = {}
    for ch in chunks[:-1]:
        c = ch["choices"][0]
        seen[c["index"]] = seen.get(c["index"], 0) + len(c.get("token_ids", []))
        assert ch["usage"]["completion_tokens"] == seen[c["index"]], ch
        assert ch["usage"]["total_tokens"] == ch["usage"]["prompt_tokens"] + seen[c["index"]]
    assert seen == {0: n, 1: n} and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2 * n
    if route == COMPLETIONS:
        assert {ch["choices"][0]["index"]: ch["usage"]["prompt_tokens"] for ch in chunks[:-1]} == {0: 2, 1: 1}


# ---------------------------------------------------------------------- applied fields of the chat route


def test_add_generation_prompt_false_renders_without_the_assistant_header(server, hf):
    n = 6
    on = ok(server, CHAT, max_tokens=n)
    off = ok(server, CHAT, max_tokens=n, add_generation_prompt=False)
    assert on["prompt_token_ids"] == render(hf, USER_W7) and on["prompt_token_ids"][-1] == 5  # <|assistant|>
    assert off["prompt_token_ids"] == render(hf, USER_W7, add_generation_prompt=False) == on["prompt_token_ids"][:-1]
    assert off["choices"][0]["token_ids"] == chat_ref(off["prompt_token_ids"], n)
    # The reply's role is the last message's, as vLLM answers it, in the body and the stream.
    assert on["choices"][0]["message"]["role"] == "assistant" and off["choices"][0]["message"]["role"] == "user"
    assert events(server, CHAT, max_tokens=n, add_generation_prompt=False)[0]["choices"][0]["delta"]["role"] == "user"


def test_continue_final_message_and_echo(server, hf):
    n = 6
    messages = USER_W7 + [{"role": "assistant", "content": "w11 w12"}]
    body = ok(server, CHAT, messages=messages, max_tokens=n, add_generation_prompt=False, continue_final_message=True)
    ids = render(hf, messages, add_generation_prompt=False, continue_final_message=True)
    assert body["prompt_token_ids"] == ids and ids[-2:] == [11, 12]  # the last message left open: no <|end|>
    assert ids != render(hf, messages, add_generation_prompt=False)
    c = body["choices"][0]
    assert c["token_ids"] == chat_ref(ids, n) and c["message"]["role"] == "assistant"
    # echo: the reply starts with the last message, whose role is the reply's.
    echoed = ok(server, CHAT, messages=messages, max_tokens=n, add_generation_prompt=False,
                continue_final_message=True, echo=True)["choices"][0]
    assert echoed["message"]["content"] == "w11 w12" + c["message"]["content"]
    assert echoed["token_ids"] == c["token_ids"]
    chunks = events(server, CHAT, messages=messages, max_tokens=n, add_generation_prompt=False,
                    continue_final_message=True, echo=True)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[1]["choices"][0]["delta"] == {
        "content": "w11 w12"}
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == echoed["message"]["content"]
    # With the generation prompt the reply is the assistant's and the last message the user's: nothing to echo.
    plain = ok(server, CHAT, max_tokens=n)["choices"][0]
    assert ok(server, CHAT, max_tokens=n, echo=True)["choices"][0]["message"] == plain["message"]
    # Both at once is refused, as vLLM refuses it, and the default add_generation_prompt counts.
    for extra in ({}, {"add_generation_prompt": True}):
        r = post(server, CHAT, messages=messages, continue_final_message=True, **extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_a_request_chat_template_is_refused_naming_it(server):
    r = post(server, CHAT, chat_template="{{ messages }}")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "chat_template" and "template" in err["message"], err


def test_the_openai_client_sees_the_refusals_and_the_applied_fields(server):
    """As a user of the official client meets them: a 400 is a BadRequestError naming the field."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=30, max_retries=0)
    model = "graphburst-stub"
    for call, kw in ((client.completions.create, {"prompt": [7, 8], "best_of": 2}),
                     (client.completions.create, {"prompt": [7, 8], "suffix": "w9"}),
                     (client.completions.create, {"prompt": [7, 8], "presence_penalty": 2.5}),
                     (client.chat.completions.create, {"messages": USER_W7, "logit_bias": {"5": 101}}),
                     (client.chat.completions.create, {"messages": USER_W7, "modalities": ["text", "audio"]})):
        with pytest.raises(openai.BadRequestError) as exc:
            call(model=model, max_tokens=4, **kw)
        assert exc.value.body["param"] == next(k for k in kw if k not in ("prompt", "messages")), exc.value.body
    r = client.completions.create(model=model, prompt="w7 w8", max_tokens=4, echo=True)
    assert r.choices[0].text.startswith("w7 w8")
    chunks = list(client.completions.create(model=model, prompt=[7, 8], max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(ch.usage is None for ch in chunks[:-1])
    # The logits processing fields, as the client sends them (vLLM's as extra_body).
    r = client.completions.create(model=model, prompt=[7, 8], max_tokens=4, logit_bias={"9": 100})
    assert r.choices[0].token_ids == [9] * 4
    r = client.chat.completions.create(model=model, messages=USER_W7, max_tokens=3, logit_bias={"9": 100},
                                       extra_body={"min_tokens": 2})
    assert r.choices[0].token_ids == [9] * 3 and "w9" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------- the logits processing fields


def fields_ref(prompt, n, fields, eos=None) -> list:
    """The library's host reference for the server's stub target (its vocabulary and logit peak)."""
    return host_decode(prompt, n, fields, eos, vocab=VOCAB, peak=default_peak(VOCAB))


def reply(server, route, stream, **fields) -> tuple[list, str]:
    """A choice's token ids and finish reason, from one body or from the stream's chunks."""
    if not stream:
        c = ok(server, route, **fields)["choices"][0]
        return c["token_ids"], c["finish_reason"]
    chunks = events(server, route, **fields)
    return ([t for ch in chunks for t in ch["choices"][0].get("token_ids", [])],
            next(ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"][0]["finish_reason"]))


def chat_ids(hf, word: int) -> list:
    return render(hf, [{"role": "user", "content": f"w{word}"}])


def completion_cases() -> list:
    """(body, expected ids, expected finish reason, why): each field as the reference says it acts."""
    p, n = [7, 8], 10
    plain = greedy_reference(p, n, VOCAB)
    absent = next(t for t in range(7, VOCAB) if t not in plain)
    forced = fields_ref(p, n, {"logit_bias": {str(absent): 10}, "presence_penalty": 2, "frequency_penalty": 2})
    assert forced[0] == absent and forced.count(absent) == 1, forced  # the penalties take the bias back
    freq = fields_ref(p, n, {"logit_bias": {str(absent): 10}, "frequency_penalty": 1.5})
    assert freq != [absent] * n, freq
    # A prompt whose greedy reply repeats a token of its own or of the prompt: a strong repetition penalty acts.
    rp = next([w] for w in range(7, VOCAB) if len(set(greedy_reference([w], n, VOCAB) + [w])) < n + 1)
    rep = fields_ref(rp, n, {"repetition_penalty": 8})
    assert rep != greedy_reference(rp, n, VOCAB), rp
    ban = fields_ref(p, n, {"logit_bias": {str(plain[0]): -100}})
    assert ban[0] != plain[0], ban
    eos = plain[2]
    late = fields_ref(p, n, {"min_tokens": 6}, eos)
    assert eos not in late[:6] and late != plain[:3], late
    return [
        ({"logit_bias": {str(absent): 100}}, [absent] * n, "length", "a +100 bias forces its token"),
        ({"logit_bias": {str(plain[0]): -100}}, ban, "length", "a -100 bias bans its token"),
        ({"logit_bias": {str(absent): 10}, "presence_penalty": 2, "frequency_penalty": 2}, forced, "length",
         "presence and frequency penalties"),
        ({"logit_bias": {str(absent): 10}, "frequency_penalty": 1.5}, freq, "length", "a frequency penalty"),
        ({"prompt": rp, "repetition_penalty": 8}, rep, "length", "a repetition penalty over prompt and reply"),
        ({"stop_token_ids": [eos], "min_tokens": 6}, late, "stop" if late[-1] == eos else "length",
         "min_tokens holds the stop token back"),
        ({"stop_token_ids": [eos], "ignore_eos": True}, plain[:3], "stop",
         "ignore_eos leaves stop_token_ids in force, as vLLM"),
        ({"temperature": 1.5, "seed": 3, "min_p": 1.0}, plain, "length", "min_p 1 keeps the top token only"),
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_the_logits_processing_fields_reach_the_device_on_completions(server, stream):
    sampled, _ = reply(server, COMPLETIONS, stream, max_tokens=10, temperature=1.5, seed=3)
    assert sampled != greedy_reference([7, 8], 10, VOCAB)  # so min_p = 1 below is what makes it greedy
    for body, want, reason, why in completion_cases():
        got = reply(server, COMPLETIONS, stream, max_tokens=10, **body)
        assert got == (want, reason), (why, body, got, want)


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_the_logits_processing_fields_reach_the_device_on_chat(server, hf, stream):
    n = 30
    word = next(w for w in range(7, VOCAB) if EOS in greedy_reference(chat_ids(hf, w), n, VOCAB)[1:n - 8])
    ids, messages = chat_ids(hf, word), [{"role": "user", "content": f"w{word}"}]
    plain = greedy_reference(ids, n, VOCAB)
    stop_at = plain.index(EOS)
    assert reply(server, CHAT, stream, messages=messages, max_tokens=n) == (plain[:stop_at + 1], "stop")
    # ignore_eos: the tokenizer's EOS no longer ends the reply.
    assert reply(server, CHAT, stream, messages=messages, max_tokens=n, ignore_eos=True) == (plain, "length")
    # min_tokens: the EOS is held back, so the reply runs past it.
    late = fields_ref(ids, n, {"min_tokens": stop_at + 3}, EOS)
    assert len(late) > stop_at + 3 and EOS not in late[:stop_at + 3], late
    got = reply(server, CHAT, stream, messages=messages, max_tokens=n, min_tokens=stop_at + 3)
    assert got == (late, "stop" if late[-1] == EOS else "length"), (got, late)
    # logit_bias and a penalty together.
    fields = {"logit_bias": {"9": 10}, "presence_penalty": 2}
    want = fields_ref(ids, 12, fields, EOS)
    assert want[0] == 9 and want != [9] * len(want)
    assert reply(server, CHAT, stream, messages=messages, max_tokens=12, **fields)[0] == want


@pytest.mark.parametrize("body, named", [
    ({"min_tokens": 3, "stop_token_ids": [3, 4]}, "(3, 4)"),
    ({"min_tokens": 11}, "max_tokens=10"),
])
def test_min_tokens_that_the_device_cannot_hold_to_is_a_400(server, body, named):
    r = post(server, COMPLETIONS, **{"max_tokens": 10, **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "min_tokens" and named in err["message"], r.text
    # On chat the tokenizer's EOS is a stop id too: with ignore_eos it would be held back but never stop.
    r = post(server, CHAT, min_tokens=2, ignore_eos=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
