"""The OpenAI completions subset: request validation and response shapes, no HTTP.

``temperature``, ``top_p``, ``seed`` and vLLM's ``top_k`` (-1 = off) reach the device's
speculative rejection sampler when the server runs with ``--sampling``; a greedy server
refuses a field that would change its output (``temperature`` > 0, ``top_p`` < 1,
``top_k`` > 0) with a 400 naming it rather than ignoring it. ``n`` > 1 and ``best_of`` > 1
are refused too; fields that cannot change the tokens (``user``, ``presence_penalty`` of
0, ...) are ignored, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import time

from ..sampling.params import check_sampling
from ..validate import check_prompt

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TEXT_CHARS_PER_TOKEN = 64  # text longer than this x capacity cannot fit a slot: refused before tokenizing

# graphburst's finish reasons -> the OpenAI field. "abort" follows vLLM for requests the
# server cancelled (shutdown); "error" for a request the engine could not finish.
OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


class APIError(Exception):
    """An error response: HTTP status, OpenAI error ``type`` and the offending ``param``."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error"):  # noqa: A002 - the OpenAI field name
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

    @property
    def prompt_tokens(self) -> int:
        """The ``usage.prompt_tokens`` of the answer: every choice's prompt."""
        return sum(map(len, self.prompts))

    def choice_sampling(self, index: int) -> dict:
        """The sampling fields of choice ``index``'s Request."""
        return self.sampling


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


def _prompts(value, vocab: int, tokenizer, *, max_prompts: int, capacity: int) -> list:
    """``prompt`` as a list of token-id lists; text needs a tokenizer.

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
        return check_prompt_ids(f"prompt{i} (tokenized)", tokenizer.encode(s).ids, vocab, capacity)

    if isinstance(value, str):
        return [text("", value)]
    if not isinstance(value, list) or not value:
        raise APIError(f"prompt must be a token-id list, a list of them, or text; got {value!r:.60}", param="prompt")
    if not any(isinstance(t, (list, str)) for t in value):  # one prompt of token ids
        return [check_prompt_ids("prompt", value, vocab, capacity)]
    if len(value) > max_prompts:
        raise APIError(f"prompt holds {len(value)} prompts; at most {max_prompts} per request", param="prompt")
    out = []
    for i, p in enumerate(value):
        if isinstance(p, str):
            out.append(text(f"[{i}]", p))
        elif isinstance(p, list):
            out.append(check_prompt_ids(f"prompt[{i}]", p, vocab, capacity))
        else:
            raise APIError(f"prompt[{i}] must be an int token id, a token-id list or text, got {p!r:.60}",
                           param="prompt")
    return out


def parse_completion(body, *, model: str, vocab: int, capacity: int, tokenizer=None,
                     max_prompts: int, sampling: bool = False) -> Completion:
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
        Needed for text prompts.
    max_prompts : int
        More prompts than this in one request could never be queued at once.
    sampling : bool
        The server samples (``--sampling``); otherwise fields that change greedy output are refused.
    """
    if not isinstance(body, dict):
        raise APIError(f"the body must be a JSON object, got {type(body).__name__}", param="body")
    check_model(body, model)
    if "prompt" not in body:
        raise APIError("missing field prompt", param="prompt")
    prompts = _prompts(body["prompt"], vocab, tokenizer, max_prompts=max_prompts, capacity=capacity)

    max_tokens = body.get("max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if not is_int(max_tokens) or max_tokens < 1:
        raise APIError(f"max_tokens must be an int >= 1, got {max_tokens!r}", param="max_tokens")
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > capacity:
        raise APIError(f"a prompt of {longest} tokens plus max_tokens={max_tokens} needs {longest + max_tokens} "
                       f"KV entries, but a slot holds {capacity}", param="max_tokens")

    stops = check_stop_ids(body, vocab)
    stream = check_stream(body)
    _check_unsupported(body)
    return Completion(prompts, int(max_tokens), stops, stream, check_sampling_fields(body, sampling))


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


def _check_unsupported(body: dict) -> None:
    """Refuse what the server cannot do rather than ignore it."""
    n, best_of = body.get("n", 1), body.get("best_of")
    if n != 1:
        raise APIError(f"n={n!r}: only n=1 is supported (send several prompts for several choices)", param="n")
    if best_of not in (None, 1):
        raise APIError(f"best_of={best_of!r}: only 1 is supported", param="best_of")
    if body.get("echo"):
        raise APIError("echo is not supported", param="echo")
    if body.get("logprobs") is not None:
        raise APIError("logprobs are not supported", param="logprobs")
    if body.get("stop"):
        raise APIError("stop strings are not supported; use stop_token_ids", param="stop")


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
    """How ``/v1/completions`` answers: a :func:`completion` body, or :class:`StreamChunks` events with
    ``usage`` on the last one. :class:`graphburst.serving.chat.ChatReply` is the chat route's."""

    prefix = "cmpl"
    skip_special_tokens = False

    def __init__(self, cid: str, created: int, model: str, comp: Completion):
        self.cid, self.created, self.model = cid, created, model
        self.chunks = StreamChunks(cid, created, model)

    def start(self) -> bytes:
        return b""

    def chunk(self, index: int, text: str, token_ids: list, reason: str | None, usage_: dict | None) -> bytes:
        return self.chunks.chunk(index, text, token_ids, reason, usage_)

    def end(self, usage_: dict) -> bytes:
        return b""

    def body(self, texts: list, tokens: list, reasons: list, usage_: dict) -> dict:
        choices = [choice(i, texts[i], tokens[i], reasons[i]) for i in range(len(texts))]
        return completion(self.cid, self.created, self.model, choices, usage_)
