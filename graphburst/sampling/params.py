"""Per-request sampling settings, validated once at admission.

The kernels read them as per-sequence arrays (``temperature [B] float32``,
``top_k [B] int32``, ``top_p [B] float32``, ``seed [B] uint64``); a request that fails
here is turned away on its own, before anything reaches the device.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from ..constants import (GREEDY_TEMPERATURE, LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS, PENALTY_LIMIT, SEED_LIMIT, TOP_K_OFF,
                         TOP_P_OFF)

#: The logits processing fields (``SpecDecoder(..., fields=True)``, :mod:`graphburst.sampling.fields`)
#: with the values that leave the logits alone.
FIELD_DEFAULTS = {"logit_bias": (), "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                  "min_p": 0.0, "min_tokens": 0, "ignore_eos": False}


@dataclass(frozen=True)
class SamplingParams:
    """One request's settings. Defaults are greedy decoding with every filter and field off.

    ``logit_bias`` is a tuple of ``(token id, bias)`` pairs, ids ascending and distinct.
    """

    temperature: float = GREEDY_TEMPERATURE
    top_k: int = TOP_K_OFF
    top_p: float = TOP_P_OFF
    seed: int = 0
    logit_bias: tuple = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False

    @property
    def fields(self) -> dict:
        """The logits processing fields that differ from :data:`FIELD_DEFAULTS`."""
        return {name: getattr(self, name) for name, off in FIELD_DEFAULTS.items() if getattr(self, name) != off}


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _f32(name: str, value) -> float:
    """A finite real that float32 holds as a normal number or zero (the device flushes subnormals)."""
    value = _real(name, value)
    if value != 0 and not abs(np.float32(value)) >= np.finfo(np.float32).tiny:
        raise ValueError(f"{name} must be 0 or at least {float(np.finfo(np.float32).tiny):.3g} in magnitude "
                         f"(float32 would flush it to 0), got {value}")
    return value


def check_logit_bias(logit_bias, vocab: int | None = None) -> tuple:
    """``logit_bias``: a dict of token id (an int, or a str of digits as JSON spells keys) -> bias
    in [-100, 100], at most ``MAX_LOGIT_BIAS`` entries; ids in ``[0, vocab)`` when ``vocab`` is
    given. Returns ``((id, bias), ...)``, ids ascending."""
    if logit_bias is None:
        return ()
    if isinstance(logit_bias, (tuple, list)):  # already in the returned form
        try:
            logit_bias = dict(logit_bias)
        except (TypeError, ValueError):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got {logit_bias!r}") from None
    if not isinstance(logit_bias, dict):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}")
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got {len(logit_bias)}")
    out = {}
    for key, bias in logit_bias.items():
        tok = key
        # ASCII digits only: str.isdigit() also admits digits int() refuses (superscripts, "²")
        if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit():
            tok = int(key)
        if isinstance(tok, bool) or not isinstance(tok, numbers.Integral):
            raise TypeError(f"logit_bias keys must be token ids (int), got {key!r}")
        tok = int(tok)
        if tok < 0 or (vocab is not None and tok >= vocab):
            raise ValueError(f"logit_bias token id {key!r} is outside the vocabulary [0, {vocab})")
        if tok in out:
            raise ValueError(f"logit_bias names token id {tok} twice")
        bias = _f32(f"logit_bias[{key!r}]", bias)
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias[{key!r}] must be in [-100, 100], got {bias}")
        out[tok] = bias
    return tuple(sorted(out.items()))


def check_fields(logit_bias=None, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, min_p=0.0,
                 min_tokens=0, ignore_eos=False, *, vocab: int | None = None) -> dict:
    """Validate the logits processing fields; raise TypeError/ValueError naming the field and value.

    Parameters
    ----------
    logit_bias : dict of token id -> bias in [-100, 100], at most 300 entries (:func:`check_logit_bias`)
    presence_penalty, frequency_penalty : real in [-2, 2] (0 = off)
    repetition_penalty : real > 0 (1 = off)
    min_p : real in [0, 1] (0 = off)
    min_tokens : int in [0, 2**31)
    ignore_eos : bool

    Returns
    -------
    dict of the seven fields as plain Python values (``logit_bias`` as sorted pairs)
    """
    out = {"logit_bias": check_logit_bias(logit_bias, vocab)}
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        value = _f32(name, value)
        if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
            raise ValueError(f"{name} must be in [-2, 2], got {value}")
        out[name] = value
    rep = _f32("repetition_penalty", repetition_penalty)
    if not rep > 0 or not np.isfinite(np.float32(rep)):
        raise ValueError(f"repetition_penalty must be > 0 and fit float32, got {rep}")
    out["repetition_penalty"] = rep
    mp = _f32("min_p", min_p)
    if not 0.0 <= mp <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {mp}")
    out["min_p"] = mp
    mt = _int("min_tokens", min_tokens)
    if not 0 <= mt <= np.iinfo(np.int32).max:
        raise ValueError(f"min_tokens must be in [0, 2**31), got {mt}")
    out["min_tokens"] = mt
    if not isinstance(ignore_eos, (bool, np.bool_)):
        raise TypeError(f"ignore_eos must be a bool, got {type(ignore_eos).__name__} {ignore_eos!r}")
    out["ignore_eos"] = bool(ignore_eos)
    return out


def check_sampling(temperature=GREEDY_TEMPERATURE, top_k=TOP_K_OFF, top_p=TOP_P_OFF, seed=0, *, vocab=None,
                   **fields) -> SamplingParams:
    """Validate one request's settings; raise TypeError/ValueError naming the field and value.

    ``fields``: the logits processing fields of :func:`check_fields` (keyword only; an unknown
    name is a TypeError); ``vocab`` bounds ``logit_bias``'s ids.

    Parameters
    ----------
    temperature : real, finite, >= 0 (0 = greedy)
    top_k : int, >= 0 (0 = off)
    top_p : real in (0, 1] (1 = off)
    seed : int in [0, 2**64)
    logit_bias, presence_penalty, frequency_penalty, repetition_penalty, min_p, min_tokens, ignore_eos :
        :func:`check_fields`

    Returns
    -------
    SamplingParams
        The settings as plain Python numbers.
    """
    temperature = _real("temperature", temperature)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    with np.errstate(over="ignore"):  # a value past float32's range becomes inf, refused next
        t32 = np.float32(temperature)
    if not np.isfinite(t32):
        raise ValueError(f"temperature must fit float32 (<= {float(np.finfo(np.float32).max):.3g}), got {temperature}")
    if 0 < temperature and not t32 >= np.finfo(np.float32).tiny:
        # float32 (and the device's flush to zero of subnormals) would silently turn this
        # into greedy decoding.
        raise ValueError(f"temperature must be 0 or >= {float(np.finfo(np.float32).tiny)}, got {temperature}")
    top_k = _int("top_k", top_k)
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if top_k > np.iinfo(np.int32).max:
        raise ValueError(f"top_k must be <= {np.iinfo(np.int32).max}, got {top_k}")
    top_p = _real("top_p", top_p)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not np.float32(top_p) >= np.finfo(np.float32).tiny:
        # The kernels read float32 and flush subnormals to 0: a smaller top_p would
        # silently become top-1.
        raise ValueError(f"top_p must not round to 0 in float32 (>= {float(np.finfo(np.float32).tiny):.3g}), "
                         f"got {top_p}")
    seed = _int("seed", seed)
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    unknown = set(fields) - set(FIELD_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown sampling field {min(unknown)!r}")
    return SamplingParams(temperature, top_k, top_p, seed, **check_fields(**fields, vocab=vocab))
