"""Hooks and fixtures only: the GPU skip, the backend and rng fixtures (the marks are in marks.py)."""

from __future__ import annotations

import numpy as np
import pytest

from graphburst.backend import Backend, cuda_available
from marks import BACKENDS, GPU_REASON


def pytest_collection_modifyitems(config, items) -> None:
    """Skip every test marked ``gpu`` when there is no CUDA device: the mark alone is
    enough, so test modules never import from conftest (the marks are in marks.py)."""
    if cuda_available():
        return
    skip = pytest.mark.skip(reason=GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=BACKENDS)
def backend(request) -> Backend:
    return Backend(request.param)


@pytest.fixture
def rng(request) -> np.random.Generator:
    # Fresh inputs on every run, but reproducible from the printed seed on failure.
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)
