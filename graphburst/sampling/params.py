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

from ..constants import GREEDY_TEMPERATURE, SEED_LIMIT, TOP_K_OFF, TOP_P_OFF


@dataclass(frozen=True)
class SamplingParams:
    """One request's settings. Defaults are greedy decoding with every filter off."""

    temperature: float = GREEDY_TEMPERATURE
    top_k: int = TOP_K_OFF
    top_p: float = TOP_P_OFF
    seed: int = 0


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


def check_sampling(temperature=GREEDY_TEMPERATURE, top_k=TOP_K_OFF, top_p=TOP_P_OFF, seed=0) -> SamplingParams:
    """Validate one request's settings; raise TypeError/ValueError naming the field and value.

    Parameters
    ----------
    temperature : real, finite, >= 0 (0 = greedy)
    top_k : int, >= 0 (0 = off)
    top_p : real in (0, 1] (1 = off)
    seed : int in [0, 2**64)

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
    return SamplingParams(temperature, top_k, top_p, seed)
