"""Argument checks run once, at construction and capture time, never per replay."""

from __future__ import annotations

import json
import numbers
import sys
from collections.abc import Sequence

import numpy as np


def check_int(name: str, value, minimum: int = 1, maximum: int | None = None) -> int:
    """Return ``value`` as int, or raise naming it when it is not an int in range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {_short(value)}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_prob(name: str, value) -> float:
    """Return ``value`` as float, or raise when it is not a probability in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(value).__name__} {_short(value)}")
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def check_array(name: str, arr, backend, shape: tuple, dtype) -> None:
    """Raise unless ``arr`` is a C-contiguous array of ``backend`` with this shape and dtype.

    Parameters
    ----------
    name : str
        Name used in the error message.
    arr : array
        Caller-supplied array.
    backend : Backend
        Its array type and device are required.
    shape : tuple of int
    dtype : numpy dtype-like
    """
    xp = backend.xp
    if not isinstance(arr, xp.ndarray):
        raise TypeError(
            f"{name} must be a {xp.__name__}.ndarray for the {backend.name} backend, got {type(arr).__name__}"
        )
    if arr.dtype != xp.dtype(dtype):
        raise TypeError(f"{name} must have dtype {xp.dtype(dtype)}, got {arr.dtype}")
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(arr.shape)}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    backend.check_device(name, arr)


def check_prompt(name: str, prompt, vocab: int) -> np.ndarray:
    """Return a prompt as a ``[n] int32`` host array, or raise naming the bad token.

    The one prompt check of the library: ``SpecDecoder.prefill`` and ``ServeLoop``
    both use it, so they accept the same inputs: a non-empty list, tuple or other
    sequence of ints (numpy integers included) or a 1-D integer numpy array, every
    token in ``[0, vocab)``. Bools, floats, strings, ``None``, generators, nested and
    ragged sequences are refused with TypeError/ValueError.
    """
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError(f"{name} must be a non-empty 1-D token sequence, got shape {prompt.shape}")
        if prompt.dtype == np.bool_ or not np.issubdtype(prompt.dtype, np.integer):
            raise TypeError(f"{name} must hold integer tokens, got dtype {prompt.dtype}")
        bad = (prompt < 0) | (prompt >= vocab)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name}[{i}] = {int(prompt[i])} is outside the vocabulary [0, {vocab})")
        return prompt.astype(np.int32)
    if isinstance(prompt, (str, bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise TypeError(f"{name} must be a list of int tokens or a 1-D integer array, got {type(prompt).__name__}"
                        + ("" if prompt is None else f" {_short(prompt)}"))
    if len(prompt) == 0:
        raise ValueError(f"{name} must be a non-empty 1-D token sequence, got an empty {type(prompt).__name__}")
    for i, t in enumerate(prompt):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{name}[{i}] must be an int token, got {type(t).__name__} {_short(t)}")
        if not 0 <= t < vocab:
            raise ValueError(f"{name}[{i}] = {int(t)} is outside the vocabulary [0, {vocab})")
    return np.array(prompt, dtype=np.int32)


def _short(value, limit: int = 60) -> str:
    """``repr`` cut to ``limit`` characters: error messages must stay one short line."""
    try:
        text = repr(value)
    except RecursionError:
        return f"<deeply nested {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def per_slot(name: str, value, batch: int) -> list:
    """A per-slot setting broadcast from a scalar (checked later), or a sequence of one per slot."""
    if value is None or isinstance(value, (numbers.Number, str, bytes, bytearray)):
        return [value] * batch  # check_int then names the bad scalar, e.g. 1.0 or '3'
    if isinstance(value, np.ndarray) and value.ndim == 1:
        value = value.tolist()
    if not isinstance(value, Sequence):
        raise TypeError(f"{name} must be an int, None, or a sequence with one entry per slot ({batch}), "
                        f"got {type(value).__name__}")
    value = list(value)
    if len(value) != batch:
        raise ValueError(f"{name} must be a scalar or have one entry per slot ({batch}), got {len(value)}")
    return value


class _LongInt:
    """Stands in for an over-long integer while a request is decoded again; the walk names its field."""

    def __init__(self, digits: int):
        self.digits = digits


def _find_long_int(obj):
    """Path (``max_new_tokens``, ``prompt[3]``) and value of the first _LongInt in ``obj``; iterative
    because ``obj`` may be nested as deep as the parser allows."""
    todo = [("", obj)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, _LongInt):
            return path or "the value", value
        if isinstance(value, dict):
            todo += reversed([(f"{path}.{k}" if path else str(k), v) for k, v in value.items()])
        elif isinstance(value, list):
            todo += reversed([(f"{path}[{i}]", v) for i, v in enumerate(value)])
    return "the value", None


def parse_json(text: str):
    """Decode one request (a JSONL line, an HTTP body); raise ValueError with a one-line reason.

    The reason names the column of a syntax error, says when the nesting is too deep for
    the parser, and names the field of an integer longer than Python converts
    (``sys.get_int_max_str_digits()``, 4300 by default) rather than Python's advice to raise it.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"bad JSON: {exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise ValueError("bad JSON: nested too deeply") from None
    except ValueError:  # an integer over the conversion limit: decode again (slowly) to find its field
        limit = sys.get_int_max_str_digits()

        def parse_int(digits: str):
            n = len(digits) - digits.startswith("-")
            return _LongInt(n) if n > limit else int(digits)

        path, value = _find_long_int(json.loads(text, parse_int=parse_int))
        raise ValueError(f"{path}: an integer of {value.digits if value else 'too many'} digits, over the "
                         f"{limit}-digit limit") from None
