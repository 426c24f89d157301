"""The OpenAI completions subset: request validation and response shapes, no HTTP.

Every request field of both routes is classified once, in :data:`FIELDS`: *applied* (the
parser reads it and it changes the answer), *refused* (only its neutral values are taken;
any other is a 400 naming it, because the server cannot do what it asks) or *ignored* (it
cannot change the tokens, as vLLM ignores it). A field of no schema is ignored too, as
OpenAI and vLLM accept unknown fields. docs/serving.md lists the same table, and
tests/serving/test_http_fields.py holds both against the ``openai`` package's schemas.

``temperature``, ``top_p``, ``seed`` and vLLM's ``top_k`` (-1 = off) reach the device's
speculative rejection sampler when the server runs with ``--sampling``; a greedy server
refuses a field that would change its output (``temperature`` > 0, ``top_p`` < 1,
``top_k`` > 0) with a 400 naming it rather than ignoring it. The seven sampling-shaping
fields of :data:`DEVICE_FIELDS` (``logit_bias``, the penalties, ``min_p``, ``min_tokens``,
``ignore_eos``) reach the device's logits processing when the server runs with ``--sampling
--fields`` (:func:`check_device_fields`, through the library's ``sampling.params.check_fields``);
any other server refuses a non-neutral value, naming the flags.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import time

from ..constants import SEED_LIMIT
from ..sampling.params import FIELD_DEFAULTS, check_sampling
from ..sampling.params import check_fields as check_logits_fields
from ..validate import check_prompt

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TEXT_CHARS_PER_TOKEN = 64  # text longer than this x capacity cannot fit a slot: refused before tokenizing

# graphburst's finish reasons -> the OpenAI field. "abort" follows vLLM for requests the
# server cancelled (shutdown); "error" for a request the engine could not finish.
OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


class APIError(Exception):
    """An error response: HTTP status, OpenAI error ``type`` and the offending ``param``."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error"):  # "type": the OpenAI field name
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": None}}


@dataclasses.dataclass
class Completion:
    """A validated request: one prompt per choice, shared limits."""

    prompts: list  # list of list of int
    max_tokens: int
    stop_token_ids: list  # [0] -> the device EOS, the rest checked on the host
    stream: bool
    sampling: dict = dataclasses.field(default_factory=dict)  # Request's temperature/top_k/top_p/seed as sent
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage and no choices
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk too
    echo: list | None = None  # [n] str: the text each choice's reply starts with (``echo``); None: no echo
    skip_special_tokens: bool = False  # special tokens left out of the text
    device: dict = dataclasses.field(default_factory=dict)  # Request's logits processing fields (non-neutral ones)
    n: int = 1  # choices per prompt: prompts holds each prompt n times in a row (choice index = prompt * n + i)
    options: dict | None = None  # the Request's model options: {"k": n} from num_speculative_tokens, or None

    @property
    def prompt_tokens(self) -> int:
        """The ``usage.prompt_tokens`` of the answer: each prompt once, whatever ``n`` is (as OpenAI counts)."""
        return sum(map(len, self.prompts[::self.n]))

    def choice_sampling(self, index: int) -> dict:
        """The sampling settings and logits processing fields of choice ``index``'s Request: with a ``seed``,
        choice ``i`` of a prompt takes ``seed + i``, so the n choices differ and each reproduces."""
        fields = dict(self.sampling)
        if "seed" in fields:
            fields["seed"] = (fields["seed"] + index % self.n) % SEED_LIMIT
        return {**fields, **self.device}


# ---------------------------------------------------------------------- every request field

APPLIED, REFUSED, IGNORED = "applied", "refused", "ignored"


@dataclasses.dataclass(frozen=True)
class Field:
    """How a route treats one request field.

    ``applied``: its parser reads it. ``refused``: null and the values in ``neutral`` ask for
    nothing and are taken; any other value is a 400 ending with ``why``. ``ignored``: it
    cannot change the tokens (bookkeeping, caching hints), so it is dropped, as vLLM drops it.
    """

    status: str
    neutral: tuple = ()
    why: str = ""
    needs: str = ""  # applied only by a server started with these flags (the docs' status: "applied with ...")


def _refused(*neutral, why: str) -> Field:
    return Field(REFUSED, neutral, why)


_APPLIED, _IGNORED = Field(APPLIED), Field(IGNORED)

# The seven sampling-shaping fields (OpenAI's and vLLM's), applied on the device inside the burst
# by a server started with FIELDS_FLAGS, with the values that ask for nothing: any server takes
# those, and a server without the flags refuses any other (check_device_fields).
DEVICE_FIELDS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {}, "repetition_penalty": 1.0,
                 "min_p": 0.0, "min_tokens": 0, "ignore_eos": False}
DEVICE_FIELD_STATUS = APPLIED
#: drafts a round for one request, 0 (plain decoding) to the server's k (named as vLLM names k)
SPECULATION_FIELD = "num_speculative_tokens"
FIELDS_FLAGS = "--sampling --fields"

_NO_LOGPROBS = "the server returns no log probabilities"
_NO_GUIDE = "the server does not constrain the output"
_NO_TOOLS = "the server cannot render tool definitions or parse tool calls"
_TEXT_ONLY = "the server generates text only"

# Fields both routes share (vLLM's extras included), then each route's own.
_SHARED = {
    "model": _APPLIED, "stream": _APPLIED, "stream_options": _APPLIED, "temperature": _APPLIED, "top_p": _APPLIED,
    "top_k": _APPLIED, "seed": _APPLIED, "stop_token_ids": _APPLIED, "echo": _APPLIED,
    "skip_special_tokens": _APPLIED, SPECULATION_FIELD: _APPLIED,
    **{name: Field(DEVICE_FIELD_STATUS, needs=FIELDS_FLAGS) for name in DEVICE_FIELDS},
    "stop": _refused("", [], why="stop strings are not matched; send stop_token_ids"),
    "response_format": _refused({"type": "text"}, why=_NO_GUIDE),
    "use_beam_search": _refused(False, why="the server has no beam search"),
    "length_penalty": _refused(1, why="it scores beams, and the server has no beam search"),
    "allowed_token_ids": _refused(why="the server does not restrict the vocabulary"),
    "bad_words": _refused([], why="the server does not ban words"),
    "prompt_logprobs": _refused(why=_NO_LOGPROBS),
    "truncate_prompt_tokens": _refused(why="the server does not truncate prompts; a prompt that does not fit is a 400"),
    **{name: _refused(why=_NO_GUIDE) for name in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag", "structured_outputs",
        "guided_decoding_backend", "guided_whitespace_pattern")},
    "logits_processors": _refused([], why="the server runs no custom logits processors"),
    "priority": _refused(0, why="the server admits requests in arrival order"),
    "kv_transfer_params": _refused({}, why="the server does not transfer KV caches"),
    "vllm_xargs": _refused({}, why="the server has no custom extensions"),
    "spaces_between_special_tokens": _refused(True, why="the tokenizer's own decoder spaces the text"),
    "user": _IGNORED, "request_id": _IGNORED,
    "cache_salt": _IGNORED,  # salts a prefix cache, which the server does not have
    "return_token_ids": _IGNORED,  # every choice carries token_ids anyway
    "return_tokens_as_token_ids": _IGNORED,  # shapes logprobs, which are refused
    "include_stop_str_in_output": _IGNORED,  # concerns stop strings, which are refused
}

COMPLETION_FIELDS = {
    **_SHARED, "prompt": _APPLIED, "max_tokens": _APPLIED, "add_special_tokens": _APPLIED,
    "n": _APPLIED,
    "best_of": _refused(1, why="the server generates one sequence per choice"),
    "logprobs": _refused(why=_NO_LOGPROBS),
    "suffix": _refused("", why="the server cannot insert text before a suffix"),
    "prompt_embeds": _refused(why="the server takes token ids or text, not embeddings"),
}

CHAT_FIELDS = {
    **_SHARED, "messages": _APPLIED, "max_tokens": _APPLIED, "max_completion_tokens": _APPLIED, "n": _APPLIED,
    "add_generation_prompt": _APPLIED, "continue_final_message": _APPLIED,
    "chat_template": _refused(why="the server renders the model's own template and does not trust a request's"),
    "chat_template_kwargs": _refused({}, why="the server passes no extra variables to the chat template"),
    "documents": _refused([], why="the server passes no documents to the chat template"),
    "add_special_tokens": _refused(False, why="the chat template places the special tokens itself"),
    "best_of": _refused(1, why="the server generates one sequence per choice"),
    "logprobs": _refused(False, why=_NO_LOGPROBS), "top_logprobs": _refused(0, why=_NO_LOGPROBS),
    "tools": _refused([], why=_NO_TOOLS), "functions": _refused([], why=_NO_TOOLS),
    "tool_choice": _refused("none", "auto", why=_NO_TOOLS), "function_call": _refused("none", "auto", why=_NO_TOOLS),
    "parallel_tool_calls": _IGNORED,  # only matters with tools, which are refused
    "audio": _refused(why=_TEXT_ONLY), "modalities": _refused(["text"], why=_TEXT_ONLY),
    "prediction": _refused(why="the server does not take a predicted output"),
    "reasoning_effort": _refused("none", why="the server sets no reasoning budget"),
    "verbosity": _refused(why="the server cannot set how long a reply is by a level"),
    "web_search_options": _refused(why="the server cannot search the web"),
    "moderation": _refused(why="the server runs no moderation"),
    "metadata": _IGNORED, "store": _IGNORED, "service_tier": _IGNORED, "safety_identifier": _IGNORED,
    "prompt_cache_key": _IGNORED, "prompt_cache_retention": _IGNORED, "prompt_cache_options": _IGNORED,
    "mm_processor_kwargs": _IGNORED,  # for images and audio, which messages cannot carry
}

FIELDS = {"/v1/completions": COMPLETION_FIELDS, "/v1/chat/completions": CHAT_FIELDS}


def shown(value) -> str:
    """A request value as JSON, cut to 60 characters, for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _same(a, b) -> bool:
    """JSON equality that keeps true apart from 1 and "1" apart from 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, numbers.Real) and isinstance(b, numbers.Real):
        return a == b
    return type(a) is type(b) and a == b


def check_fields(body: dict, route: str) -> None:
    """Refuse each refused field of ``route`` sent with a value other than null or a neutral one.

    Applied fields are their parsers'; device fields are :func:`check_device_fields`'; ignored
    fields and fields of no schema pass.
    """
    table = FIELDS[route]
    for name, value in body.items():
        f = table.get(name)
        if f is None or f.status != REFUSED or value is None:
            continue
        if not any(_same(value, v) for v in f.neutral):
            raise APIError(f"{name}={shown(value)} is not supported: {f.why}", param=name)


def check_device_fields(body: dict, vocab: int, *, fields: bool = False) -> dict:
    """:data:`DEVICE_FIELDS` as ``Request`` takes them: the ones sent with a value that asks for something.

    Each value is checked by the library's own validator (``sampling.params.check_fields``; a bad
    one is a 400 naming the field and value); a neutral one (null, the value of
    :data:`DEVICE_FIELDS`, zero biases) is left out, so it changes nothing on any server. Any
    other value needs ``fields`` (the server applies the fields: ``--sampling --fields``), else
    it is a 400 naming the field and the flags. ``ignore_eos`` is returned for
    :func:`stops_in_force`, which applies it on the host.
    """
    out = {}
    for name in DEVICE_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if name == "logit_bias":
            _logit_bias_shape(value)
        try:
            checked = check_logits_fields(**{name: value}, vocab=vocab)[name]
        except (TypeError, ValueError) as exc:
            raise APIError(f"{name}={shown(value)}: {exc}", param=name) from None
        if name == "logit_bias":
            checked = {tok: bias for tok, bias in checked if bias}  # a zero bias changes nothing
            if not checked:
                continue
        elif _same(checked, FIELD_DEFAULTS[name]):
            continue
        if not fields:
            raise APIError(f"{name}={shown(value)} needs the logits processing fields on the device, which this "
                           f"server does not run (start it with {FIELDS_FLAGS}, or leave {name} out)", param=name)
        out[name] = checked
    return out


def _logit_bias_shape(value) -> None:
    """OpenAI's ``logit_bias`` is a JSON object whose keys are token ids in decimal (the values are
    ``check_fields``'); the library also takes pairs and other spellings of a key, which JSON never means."""
    if not isinstance(value, dict):
        raise APIError(f"logit_bias must be an object of token ids to biases, got {shown(value)}", param="logit_bias")
    for key in value:
        if not (len(key) <= 10 and key.isascii() and key.isdigit()):
            raise APIError(f"logit_bias key {shown(key)} is not a token id (a decimal string such as \"42\")",
                           param="logit_bias")


def stops_in_force(device: dict, request_stops: list, model_stops=(), *, max_tokens: int) -> list:
    """The stop ids a request stops at, the first of them the device's EOS, with ``ignore_eos``
    and ``min_tokens`` of ``device`` (:func:`check_device_fields`; ``ignore_eos`` is taken out).

    As vLLM: ``ignore_eos`` drops the model's end-of-turn ids (``model_stops``: the chat route's
    tokenizer EOS and ``generation_config.json`` ids; the completions route stops at no id of its
    own) and leaves the request's ``stop_token_ids`` in force; ``min_tokens`` holds back every
    stop id, the model's too, until that many tokens are out, and must not exceed ``max_tokens``.
    The device holds back one stop token (the first in force), so ``min_tokens`` with any other
    stop id to hold back is a 400 naming it rather than a reply vLLM would not give.
    """
    ignore = device.pop("ignore_eos", False)
    stops = list(request_stops) + [t for t in model_stops if not ignore and t not in request_stops]
    least = device.get("min_tokens", 0)
    if least:
        if least > max_tokens:
            raise APIError(f"min_tokens={least} must be at most max_tokens={max_tokens}", param="min_tokens")
        held = list(dict.fromkeys([*request_stops, *model_stops]))
        if [t for t in held if t not in stops[:1]]:
            device_held = f"only token {stops[0]}, the first stop id in force" if stops else "none (ignore_eos)"
            if not model_stops:
                fix = "send at most one stop id"
            elif len(model_stops) == 1:
                fix = f"send no stop_token_ids and no ignore_eos (the model ends a turn at {model_stops[0]})"
            else:
                fix = f"this model ends a turn at {len(model_stops)} ids, so it cannot be held to min_tokens here"
            raise APIError(f"min_tokens={least} holds back every stop id ({', '.join(map(str, held))}) until "
                           f"{least} tokens are out, but the server holds back {device_held}; {fix}",
                           param="min_tokens")
    return stops


def check_flag(body: dict, name: str, default: bool) -> bool:
    """A true/false field; null is its default."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(f"{name} must be true or false, got {shown(value)}", param=name)
    return value


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_prompt_ids(name: str, value, vocab: int, capacity: int, *, param: str = "prompt") -> list:
    """One prompt through the library's own check (``validate.check_prompt``), as a 400."""
    if isinstance(value, list) and len(value) >= capacity:  # before the per-token loop
        raise APIError(f"{name} holds {len(value)} tokens; a slot holds {capacity} with the new ones",
                       param=param)
    try:
        return check_prompt(name, value, vocab).tolist()
    except (TypeError, ValueError) as exc:
        raise APIError(str(exc), param=param) from exc


def _prompts(value, vocab: int, tokenizer, *, max_prompts: int, capacity: int,
             add_special_tokens: bool = True) -> tuple[list, list]:
    """``prompt`` as a list of token-id lists, and each one's text as sent (None for token ids);
    text needs a tokenizer.

    Counts and lengths are checked before any per-token work, so an oversized body that
    will be refused costs the event loop almost nothing.
    """
    def text(i, s):
        if tokenizer is None:
            raise APIError(f"prompt{i} is text ({s[:40]!r}) but the server has no tokenizer (start it with "
                           "--tokenizer DIR); send token ids", param="prompt")
        if len(s) > MAX_TEXT_CHARS_PER_TOKEN * capacity:  # a token is rarely longer than this many characters
            raise APIError(f"prompt{i} holds {len(s)} characters, more than a slot of {capacity} tokens could take",
                           param="prompt")
        ids = tokenizer.encode(s, add_special_tokens=add_special_tokens).ids
        return check_prompt_ids(f"prompt{i} (tokenized)", ids, vocab, capacity)

    if isinstance(value, str):
        return [text("", value)], [value]
    if not isinstance(value, list) or not value:
        raise APIError(f"prompt must be a token-id list, a list of them, or text; got {value!r:.60}", param="prompt")
    if not any(isinstance(t, (list, str)) for t in value):  # one prompt of token ids
        return [check_prompt_ids("prompt", value, vocab, capacity)], [None]
    if len(value) > max_prompts:
        raise APIError(f"prompt holds {len(value)} prompts; at most {max_prompts} per request", param="prompt")
    out, texts = [], []
    for i, p in enumerate(value):
        if isinstance(p, str):
            out.append(text(f"[{i}]", p))
            texts.append(p)
        elif isinstance(p, list):
            out.append(check_prompt_ids(f"prompt[{i}]", p, vocab, capacity))
            texts.append(None)
        else:
            raise APIError(f"prompt[{i}] must be an int token id, a token-id list or text, got {p!r:.60}",
                           param="prompt")
    return out, texts


def parse_completion(body, *, model: str, vocab: int, capacity: int, tokenizer=None,
                     max_prompts: int, sampling: bool = False, fields: bool = False, k: int | None = None
                     ) -> Completion:
    """Validate a ``/v1/completions`` body; raise :class:`APIError` naming the field.

    Parameters
    ----------
    body : object
        The decoded JSON body.
    model : str
        The served model name; a different ``model`` is a 404 like OpenAI's.
    vocab, capacity : int
        Token ids must be in ``[0, vocab)``; prompt plus ``max_tokens`` must fit ``capacity``.
    tokenizer : tokenizers.Tokenizer, optional
        Needed for text prompts and ``echo``.
    max_prompts : int
        More prompts than this in one request could never be queued at once.
    sampling : bool
        The server samples (``--sampling``); otherwise fields that change greedy output are refused.
    fields : bool
        The server applies the logits processing fields (``--sampling --fields``); otherwise
        :data:`DEVICE_FIELDS` other than neutral are refused.
    k : int, optional
        The server's drafts per round: ``num_speculative_tokens`` may ask for 0 to k
        (:func:`check_speculation`); None: the field is refused.
    """
    if not isinstance(body, dict):
        raise APIError(f"the body must be a JSON object, got {type(body).__name__}", param="body")
    check_model(body, model)
    check_fields(body, "/v1/completions")
    if "prompt" not in body:
        raise APIError("missing field prompt", param="prompt")
    prompts, texts = _prompts(body["prompt"], vocab, tokenizer, max_prompts=max_prompts, capacity=capacity,
                              add_special_tokens=check_flag(body, "add_special_tokens", True))

    max_tokens = body.get("max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if not is_int(max_tokens) or max_tokens < 1:
        raise APIError(f"max_tokens must be an int >= 1, got {max_tokens!r}", param="max_tokens")
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > capacity:
        raise APIError(f"a prompt of {longest} tokens plus max_tokens={max_tokens} needs {longest + max_tokens} "
                       f"KV entries, but a slot holds {capacity}", param="max_tokens")

    n = body.get("n", 1)
    n = 1 if n is None else n
    if not is_int(n) or n < 1 or n * len(prompts) > max_prompts:
        raise APIError(f"n={shown(n)}: n must be an int >= 1 with n x {len(prompts)} prompts at most {max_prompts} "
                       "(--max-queue)", param="n")
    stops = check_stop_ids(body, vocab)
    stream = check_stream(body)
    include_usage, continuous = check_stream_options(body, stream)
    skip = check_flag(body, "skip_special_tokens", False)
    echo = None
    if check_flag(body, "echo", False):  # as vLLM: the prompt's text as sent, or its ids decoded
        if tokenizer is None:
            raise APIError("echo=true needs the prompt's text, but the server has no tokenizer (start it with "
                           "--tokenizer DIR)", param="echo")
        echo = [t if t is not None else tokenizer.decode(p, skip_special_tokens=skip) for p, t in zip(prompts, texts)]
    device = check_device_fields(body, vocab, fields=fields)
    stops = stops_in_force(device, stops, max_tokens=int(max_tokens))
    n = int(n)
    return Completion([p for p in prompts for _ in range(n)], int(max_tokens), stops, stream,
                      check_sampling_fields(body, sampling), include_usage=include_usage, continuous_usage=continuous,
                      echo=None if echo is None else [e for e in echo for _ in range(n)], skip_special_tokens=skip,
                      device=device, n=n, options=check_speculation(body, k))


def check_model(body: dict, model: str) -> None:
    """A ``model`` other than the served one is a 404, as OpenAI answers it."""
    if "model" in body and body["model"] != model:
        raise APIError(f"model {body['model']!r:.80} does not exist; this server serves {model!r}", param="model",
                       status=404, type="not_found_error")


def check_stop_ids(body: dict, vocab: int) -> list:
    """``stop_token_ids`` (vLLM's field) as a list of ints in ``[0, vocab)``."""
    stops = body.get("stop_token_ids") or []
    if not isinstance(stops, list):
        raise APIError(f"stop_token_ids must be a list of token ids, got {stops!r:.60}", param="stop_token_ids")
    for i, t in enumerate(stops):
        if not is_int(t) or not 0 <= t < vocab:
            raise APIError(f"stop_token_ids[{i}] = {t!r} is not a token id in [0, {vocab})", param="stop_token_ids")
    return [int(t) for t in stops]


def check_speculation(body: dict, k: int | None) -> dict | None:
    """``num_speculative_tokens`` as the request's model options (``{"k": n}``), or None when not sent.
    It is an int in ``[0, k]``: fewer drafts a round than the server's k, 0 for plain decoding."""
    value = body.get(SPECULATION_FIELD)
    if value is None:
        return None
    if k is None:
        raise APIError(f"{SPECULATION_FIELD}={shown(value)}: this server takes no per-request draft count",
                       param=SPECULATION_FIELD)
    if not is_int(value) or not 0 <= value <= k:
        raise APIError(f"{SPECULATION_FIELD} must be an int in [0, {k}] (the server's -k; 0 decodes plainly), "
                       f"got {shown(value)}", param=SPECULATION_FIELD)
    return {"k": int(value)}


def check_stream(body: dict) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(f"stream must be true or false, got {stream!r}", param="stream")
    return stream


def check_sampling_fields(body: dict, sampling: bool) -> dict:
    """The request's sampling fields, checked as ServeLoop checks them (400 naming the field)."""
    fields = {f: body[f] for f in ("temperature", "top_k", "top_p", "seed") if body.get(f) is not None}
    if fields.get("top_k") == -1:  # vLLM's spelling of "off"
        fields["top_k"] = 0
    try:
        params = check_sampling(**fields)
    except (TypeError, ValueError) as exc:
        raise APIError(str(exc), param=str(exc).split()[0]) from exc
    if not sampling:
        changes = {"temperature": params.temperature > 0, "top_p": params.top_p < 1, "top_k": params.top_k > 0}
        for field, changed in changes.items():
            if changed:
                raise APIError(f"{field}={fields[field]}: this server decodes greedily (start it with --sampling, "
                               f"or leave {field} out)", param=field)
    return fields


def check_stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """``stream_options`` as (include_usage, continuous_usage_stats); only with ``stream: true``.

    ``continuous_usage_stats`` (vLLM's) puts usage on every chunk; like vLLM it needs
    ``include_usage``, and without it is refused rather than left to do nothing.
    """
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise APIError("stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict):
        raise APIError(f"stream_options must be an object such as {{\"include_usage\": true}}, got {shown(options)}",
                       param="stream_options")
    for key in ("include_usage", "continuous_usage_stats"):
        if options.get(key) is not None and not isinstance(options[key], bool):
            raise APIError(f"stream_options.{key} must be true or false, got {shown(options[key])}",
                           param="stream_options")
    include, continuous = bool(options.get("include_usage")), bool(options.get("continuous_usage_stats"))
    if continuous and not include:
        raise APIError("stream_options.continuous_usage_stats=true needs include_usage: true", param="stream_options")
    return include, continuous


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(index: int, text: str, token_ids: list, reason: str | None) -> dict:
    return {"index": index, "text": text, "token_ids": token_ids, "logprobs": None,
            "finish_reason": None if reason is None else OPENAI_FINISH[reason]}


def completion(cid: str, created: int, model: str, choices: list, usage_: dict | None) -> dict:
    """A completion body, or one stream chunk (same shape; OpenAI uses one object type)."""
    return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage_}


def model_list(model: str, created: int, max_len: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "graphburst", "max_model_len": max_len}]}


def now() -> int:
    return int(time.time())


class StreamChunks:
    """Server-sent-event chunks of one streamed completion, encoded without building dicts.

    A chunk is the :func:`completion` body with one :func:`choice`, framed as
    ``data: <json>\\n\\n``; the fields that never change within a stream (id, created,
    model) are encoded once, so a chunk costs one ``json.dumps`` of its text and a join of
    its token ids. ``json.loads`` of a chunk equals :func:`completion` of the same values.
    """

    def __init__(self, cid: str, created: int, model: str):
        self._head = ('data: {"id":' + json.dumps(cid) + ',"object":"text_completion","created":' + str(int(created))
                      + ',"model":' + json.dumps(model) + ',"choices":[{"index":')

    def chunk(self, index: int, text: str, token_ids: list, reason: str | None, usage_: dict | None) -> bytes:
        finish = "null" if reason is None else json.dumps(OPENAI_FINISH[reason])
        use = "null" if usage_ is None else json.dumps(usage_, separators=(",", ":"))
        return (f'{self._head}{int(index)},"text":{json.dumps(text)},"token_ids":[{",".join(map(str, token_ids))}],'
                f'"logprobs":null,"finish_reason":{finish}}}],"usage":{use}}}\n\n').encode()


class CompletionReply:
    """How ``/v1/completions`` answers: a :func:`completion` body, or :class:`StreamChunks` events.

    Streamed, ``usage`` rides on the last choice's chunk; with ``stream_options.include_usage``
    it is OpenAI's shape instead: ``usage: null`` on every choice chunk (with
    ``continuous_usage_stats``, that choice's usage so far, as vLLM sends it) and one last
    chunk with ``choices: []`` and the usage. With ``echo`` a choice's text starts with its
    prompt's text (the first chunk carries it). :class:`graphburst.serving.chat.ChatReply` is
    the chat route's.
    """

    prefix = "cmpl"
    skip_special_tokens = False

    def __init__(self, cid: str, created: int, model: str, comp: Completion):
        self.cid, self.created, self.model, self.comp = cid, created, model, comp
        self.chunks = StreamChunks(cid, created, model)
        self.skip_special_tokens = comp.skip_special_tokens
        self._unechoed = list(comp.echo) if comp.echo is not None else None  # per choice: None once sent
        self._generated = [0] * len(comp.prompts)

    def start(self) -> bytes:
        return b""

    def chunk(self, index: int, text: str, token_ids: list, reason: str | None, usage_: dict | None) -> bytes:
        if self._unechoed is not None and self._unechoed[index] is not None:
            text, self._unechoed[index] = self._unechoed[index] + text, None
        if self.comp.include_usage:
            self._generated[index] += len(token_ids)
            usage_ = usage(len(self.comp.prompts[index]), self._generated[index]) if self.comp.continuous_usage \
                else None
        return self.chunks.chunk(index, text, token_ids, reason, usage_)

    def end(self, usage_: dict) -> bytes:
        if not self.comp.include_usage:
            return b""
        obj = completion(self.cid, self.created, self.model, [], usage_)
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def body(self, texts: list, tokens: list, reasons: list, usage_: dict) -> dict:
        echo = self.comp.echo or [""] * len(texts)
        choices = [choice(i, echo[i] + texts[i], tokens[i], reasons[i]) for i in range(len(texts))]
        return completion(self.cid, self.created, self.model, choices, usage_)
