"""The OpenAI chat completions subset: messages, the model's chat template, response shapes; no HTTP.

A chat request is a completion whose prompt is the model's own chat template rendered over
the messages. The template is the one in the tokenizer directory (``tokenizer_config.json``'s
``chat_template`` or ``chat_template.jinja``) or in a GGUF file's metadata, rendered by transformers exactly as
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` renders
it (jinja2 in transformers' sandbox), so the prompt ids are the ones the model was trained
on; a request's ``add_generation_prompt`` and ``continue_final_message`` (vLLM's) reach that
call, and a request's own ``chat_template`` is refused, as vLLM refuses an untrusted one. Generation then runs as for ``/v1/completions``; the model's end-of-turn ids (the
tokenizer's ``eos_token`` and ``generation_config.json``'s ``eos_token_id``) stop it, as
vLLM does, and special tokens are left out of the text (``skip_special_tokens``).

``n`` > 1 asks for several choices of the one prompt: greedy choices are equal; sampled
choices with a ``seed`` use ``seed + i`` for choice ``i``, so each differs and each reproduces.
"""

from __future__ import annotations

import dataclasses
import json
import os

from ..models.gguf_checkpoint import is_gguf
from ..models.llama_config import CheckpointError
from ..models.named import resolve_model
from ..models.tokenizer import checkpoint_tokenizer
from . import openai_api as api

ROLES = ("system", "developer", "user", "assistant")
TEXT_PART_SEPARATOR = "\n"  # a content list of text parts is joined into one string, as vLLM joins it


def _bad(message: str, param: str = "messages") -> api.APIError:
    return api.APIError(message, param=param)


@dataclasses.dataclass
class ChatTokenizer:
    """The transformers tokenizer of a directory and its end-of-turn ids, or why chat cannot run."""

    tokenizer: object  # transformers PreTrainedTokenizerBase; None when ``missing``
    stop_ids: list  # [s] int: eos_token_id, then generation_config.json's eos ids, no repeats
    missing: str | None = None  # a library chat needs is not installed: chat answers 400 with this

    @property
    def template(self) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.chat_template


def load_chat_tokenizer(model_dir: str) -> ChatTokenizer:
    """``model_dir``'s tokenizer as transformers loads it (``AutoTokenizer``, local files only).

    Raises ValueError naming the directory when transformers cannot read it. Without
    transformers or jinja2 (both in the ``serve`` extra) the completions route still serves;
    the returned ChatTokenizer says what is missing.
    """
    try:
        import jinja2  # noqa: F401 - transformers renders templates with it, and imports it only then
        from transformers import GenerationConfig
    except ImportError as exc:
        return ChatTokenizer(None, [], missing=f"chat templates need transformers and jinja2, which this server "
                                              f"lacks (pip install 'graphburst[serve]'): {exc}")
    try:
        tok = checkpoint_tokenizer(model_dir)
    except CheckpointError as exc:
        raise ValueError(f"--tokenizer {model_dir!r}: {exc}") from None
    stops = [] if tok.eos_token_id is None else [int(tok.eos_token_id)]
    if is_gguf(resolve_model(model_dir)):  # the file's metadata holds its one end-of-turn id
        return ChatTokenizer(tok, stops)
    if os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        try:
            eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
        except (OSError, ValueError) as exc:  # a bad JSON file is an OSError in transformers
            raise ValueError(f"--tokenizer {model_dir!r}: cannot read generation_config.json: {exc}") from exc
        for t in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            if int(t) not in stops:
                stops.append(int(t))
    return ChatTokenizer(tok, stops)


@dataclasses.dataclass
class ChatRequest(api.Completion):
    """A validated chat request: ``n`` copies of the one rendered prompt."""

    role: str = "assistant"  # the reply's role: the last message's with add_generation_prompt=false, as vLLM
    echo_text: str = ""  # echo: the last message's content when its role is the reply's, else ""


def _content(i: int, value) -> str:
    name = f"messages[{i}].content"
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(f"{name} must be a string or a list of text parts, got {value!r:.60}", name)
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise _bad(f"{name}[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}} (only text is "
                           f"supported), got {part!r:.60}", f"{name}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{name}[{j}].text must be a string, got {part.get('text')!r:.60}", f"{name}[{j}].text")
        texts.append(part["text"])
    return TEXT_PART_SEPARATOR.join(texts)


def check_messages(value, *, max_chars: int) -> list:
    """``messages`` as the plain ``[{"role", "content"[, "name"]}]`` list a chat template reads.

    Raises :class:`APIError` naming the field (``messages[1].role``); more than ``max_chars``
    characters in all could not fit a slot and are refused before rendering.
    """
    if not isinstance(value, list) or not value:
        raise _bad(f"messages must be a non-empty list of {{\"role\", \"content\"}} objects, got {value!r:.60}")
    out, chars = [], 0
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object with role and content, got {m!r:.60}", f"messages[{i}]")
        role = m.get("role")
        if role is None:
            raise _bad(f"messages[{i}].role is missing", f"messages[{i}].role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r:.60}",
                           f"messages[{i}].role")
        if m.get("tool_calls") or "tool_call_id" in m:
            raise _bad(f"messages[{i}]: tool calls are not supported", f"messages[{i}].tool_calls")
        if m.get("content") is None:
            raise _bad(f"messages[{i}].content is missing", f"messages[{i}].content")
        msg = {"role": role, "content": _content(i, m["content"])}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise _bad(f"messages[{i}].name must be a string, got {m['name']!r:.60}", f"messages[{i}].name")
            msg["name"] = m["name"]
        chars += len(msg["content"])
        if chars > max_chars:
            raise _bad(f"messages hold more than {max_chars} characters, more than a slot could take")
        out.append(msg)
    return out


def render(chat: ChatTokenizer, messages: list, *, vocab: int, capacity: int, add_generation_prompt: bool = True,
           continue_final_message: bool = False) -> list:
    """The prompt ids: ``apply_chat_template(messages, add_generation_prompt=..., continue_final_message=...,
    tokenize=True)``."""
    from jinja2 import TemplateError

    try:
        ids = chat.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, tokenize=True,
                                                 return_dict=False)
    except TemplateError as exc:  # the template's own raise_exception(...), or a template bug
        raise _bad(f"the model's chat template refused these messages: {exc}") from None
    except ValueError as exc:  # transformers: the final message cannot be continued (its text is not in the render)
        if not continue_final_message:
            raise
        raise _bad(f"continue_final_message=true, but the chat template cannot leave the last message open: {exc}",
                   "continue_final_message") from None
    return api.check_prompt_ids("messages (rendered by the chat template)", list(ids), vocab, capacity,
                                param="messages")


def _max_tokens(body: dict, room: int) -> int:
    """``max_completion_tokens`` (OpenAI's current name) or ``max_tokens``; default: the room left in a slot."""
    for field in ("max_completion_tokens", "max_tokens"):
        value = body.get(field)
        if value is None:
            continue
        if not api.is_int(value) or value < 1:
            raise api.APIError(f"{field} must be an int >= 1, got {value!r:.60}", param=field)
        if value > room:
            raise api.APIError(f"the rendered prompt leaves {room} tokens of the slot, but {field}={value}",
                               param=field)
        return int(value)
    assert room >= 1, room  # check_prompt_ids refused a prompt that fills the slot
    return room


def parse_chat(body, *, model: str, vocab: int, capacity: int, chat: ChatTokenizer | None, max_choices: int,
               sampling: bool = False, fields: bool = False, k: int | None = None) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body and render its prompt; raise :class:`api.APIError`.

    ``chat`` is None when the server has no tokenizer (token-id mode): chat needs text, a 400.
    ``sampling``, ``fields`` and ``k`` as for :func:`api.parse_completion`; the model's end-of-turn ids
    stop a reply after the request's ``stop_token_ids``, unless ``ignore_eos``
    (:func:`api.stops_in_force`).
    """
    if not isinstance(body, dict):
        raise api.APIError(f"the body must be a JSON object, got {type(body).__name__}", param="body")
    api.check_model(body, model)
    if chat is None:
        raise api.APIError("chat completions need text, but the server has no tokenizer (start it with "
                           "--tokenizer DIR); send token ids to /v1/completions", param="messages")
    if chat.missing is not None:
        raise api.APIError(chat.missing, param="messages")
    if chat.template is None:
        raise api.APIError(f"model {model!r} has no chat template (its tokenizer_config.json has no chat_template "
                           "and there is no chat_template.jinja); send a prompt to /v1/completions",
                           param="messages")
    api.check_fields(body, "/v1/chat/completions")
    if "messages" not in body:
        raise api.APIError("missing field messages", param="messages")
    messages = check_messages(body["messages"], max_chars=api.MAX_TEXT_CHARS_PER_TOKEN * capacity)
    n = body.get("n", 1)
    if not api.is_int(n) or not 1 <= n <= max_choices:
        raise api.APIError(f"n must be an int in [1, {max_choices}] (--max-queue), got {n!r:.60}", param="n")
    stream = api.check_stream(body)
    include_usage, continuous = api.check_stream_options(body, stream)
    add_generation_prompt = api.check_flag(body, "add_generation_prompt", True)
    continue_final = api.check_flag(body, "continue_final_message", False)
    if continue_final and add_generation_prompt:  # vLLM refuses the pair too: one opens a new turn, one continues
        raise api.APIError("continue_final_message=true needs add_generation_prompt=false (a new reply and a "
                           "continued last message exclude each other)", param="continue_final_message")
    prompt = render(chat, messages, vocab=vocab, capacity=capacity, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final)
    max_tokens = _max_tokens(body, capacity - len(prompt))
    device = api.check_device_fields(body, vocab, fields=fields)
    stops = api.stops_in_force(device, api.check_stop_ids(body, vocab), [t for t in chat.stop_ids if t < vocab],
                               max_tokens=max_tokens)
    role = "assistant" if add_generation_prompt else messages[-1]["role"]
    echo = api.check_flag(body, "echo", False) and messages[-1]["role"] == role
    return ChatRequest([prompt] * int(n), max_tokens, stops, stream, api.check_sampling_fields(body, sampling),
                       include_usage=include_usage, continuous_usage=continuous,
                       skip_special_tokens=api.check_flag(body, "skip_special_tokens", True), device=device,
                       n=int(n), role=role, echo_text=messages[-1]["content"] if echo else "",
                       options=api.check_speculation(body, k))


# ---------------------------------------------------------------------- responses


class ChatReply:
    """How ``/v1/chat/completions`` answers: a ``chat.completion`` body, or ``chat.completion.chunk`` events.

    The stream opens with one chunk per choice carrying ``delta.role``; with ``echo`` (and the
    last message in the reply's role) one chunk per choice with that message's content, as
    vLLM sends it; then ``delta.content`` chunks, the one that ends a choice carrying its
    ``finish_reason``; with ``stream_options.include_usage`` a last chunk with ``usage`` and no
    choices (and ``usage: null`` on every other chunk, or with ``continuous_usage_stats`` that
    choice's usage so far), as OpenAI sends it. Choices carry ``token_ids`` (vLLM's extension).
    """

    prefix = "chatcmpl"
    skip_special_tokens = True  # an end-of-turn token is not part of the reply's text

    def __init__(self, cid: str, created: int, model: str, req: ChatRequest):
        self.cid, self.created, self.model, self.req = cid, created, model, req
        self.skip_special_tokens = req.skip_special_tokens
        self._head = ('data: {"id":' + json.dumps(cid) + ',"object":"chat.completion.chunk","created":'
                      + str(int(created)) + ',"model":' + json.dumps(model) + ',"choices":[{"index":')
        self._generated = [0] * len(req.prompts)

    def _usage(self, index: int) -> str:
        """The chunk's ``usage`` member: none without include_usage, else null or this choice's so far."""
        if not self.req.include_usage:
            return ""
        if not self.req.continuous_usage:
            return ',"usage":null'
        return ',"usage":' + json.dumps(api.usage(len(self.req.prompts[index]), self._generated[index]),
                                        separators=(",", ":"))

    def _event(self, index: int, delta: str, tail: str, finish: str) -> bytes:
        return (f'{self._head}{int(index)},"delta":{delta}{tail},"logprobs":null,"finish_reason":{finish}}}]'
                f'{self._usage(index)}}}\n\n').encode()

    def start(self) -> bytes:
        n = len(self.req.prompts)
        role = '{"role":' + json.dumps(self.req.role) + ',"content":""}'
        head = [self._event(i, role, "", "null") for i in range(n)]
        if self.req.echo_text:
            echo = '{"content":' + json.dumps(self.req.echo_text) + "}"
            head += [self._event(i, echo, "", "null") for i in range(n)]
        return b"".join(head)

    def chunk(self, index: int, text: str, token_ids: list, reason: str | None, usage_: dict | None) -> bytes:
        self._generated[index] += len(token_ids)
        delta = "{}" if reason is not None and not text else '{"content":' + json.dumps(text) + "}"
        finish = "null" if reason is None else json.dumps(api.OPENAI_FINISH[reason])
        return self._event(index, delta, f',"token_ids":[{",".join(map(str, token_ids))}]', finish)

    def end(self, usage_: dict) -> bytes:
        if not self.req.include_usage:
            return b""
        obj = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "choices": [], "usage": usage_}
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def body(self, texts: list, tokens: list, reasons: list, usage_: dict) -> dict:
        choices = [{"index": i, "message": {"role": self.req.role, "content": self.req.echo_text + texts[i]},
                    "logprobs": None, "finish_reason": api.OPENAI_FINISH[reasons[i]], "token_ids": tokens[i]}
                   for i in range(len(texts))]
        return {"id": self.cid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_, "prompt_token_ids": self.req.prompts[0]}
