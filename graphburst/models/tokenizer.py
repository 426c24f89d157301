"""A checkpoint's own tokenizer, as transformers builds it: from a directory's tokenizer files, or from
a GGUF file's metadata (vocabulary, merges, special ids and chat template in the file).

Building one from a GGUF file converts its whole vocabulary (about 2.5 s for SmolLM2's 49152
tokens), so each is built once per process (:func:`checkpoint_tokenizer` is cached).
"""

from __future__ import annotations

import functools
import os

from .gguf_checkpoint import gguf_tokenizer, is_gguf
from .llama_config import CheckpointError
from .named import resolve_model


@functools.lru_cache(maxsize=8)
def _cached(path: str):
    if is_gguf(path):
        return gguf_tokenizer(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a directory it cannot read
        raise CheckpointError(f"{path}: transformers cannot load this tokenizer: {type(exc).__name__}: "
                              f"{' '.join(str(exc).split())}") from None


def checkpoint_tokenizer(model):
    """The transformers tokenizer of a checkpoint directory, GGUF file or named model (CheckpointError
    naming the path when there is none)."""
    return _cached(os.fspath(resolve_model(model)))


def render_user_message(tokenizer, text: str) -> list[int]:
    """``text`` as one user message through the tokenizer's chat template, as ``/v1/chat/completions``
    renders it (the plain text's ids when the tokenizer has no template)."""
    if not tokenizer.chat_template:
        return [int(t) for t in tokenizer(text)["input_ids"]]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns a BatchEncoding
    return [int(t) for t in ids]


def has_tokenizer(model) -> bool:
    """Whether ``model`` carries a tokenizer: a GGUF file always does, a directory when it has ``tokenizer.json``."""
    path = os.fspath(resolve_model(model))
    return is_gguf(path) or os.path.isfile(os.path.join(path, "tokenizer.json"))


def tokenizer_size(model) -> int | None:
    """How many token ids the tokenizer of a directory (its ``tokenizer.json``, added tokens included) or
    GGUF file (or named model) has text for: its highest id + 1. None when it cannot be read here (the
    loader that serves it then says why)."""
    path = os.fspath(resolve_model(model))
    try:
        if is_gguf(path):
            return len(checkpoint_tokenizer(path))
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(os.path.join(path, "tokenizer.json")).get_vocab(with_added_tokens=True).values()
    except Exception:  # noqa: BLE001 - tokenizers and transformers raise many types for a file they cannot read
        return None
    return max(ids, default=-1) + 1
