"""Argument checks run once, at construction and capture time, never per replay."""

from __future__ import annotations

import numbers


def check_int(name: str, value, minimum: int = 1, maximum: int | None = None) -> int:
    """Return ``value`` as int, or raise naming it when it is not an int in range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_prob(name: str, value) -> float:
    """Return ``value`` as float, or raise when it is not a probability in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(value).__name__} {value!r}")
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
