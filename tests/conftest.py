"""Shared fixtures: backends, GPU marking and random-input helpers."""

from __future__ import annotations

import numpy as np
import pytest

from graphburst.backend import Backend, cuda_available

GPU_REASON = "needs cupy and a CUDA device (run with -m gpu on a GPU machine)"
requires_gpu = pytest.mark.skipif(not cuda_available(), reason=GPU_REASON)
gpu = [pytest.mark.gpu, requires_gpu]

BACKENDS = ["numpy", pytest.param("cupy", marks=gpu)]


def pytest_collection_modifyitems(config, items) -> None:
    """Skip every test marked ``gpu`` when there is no CUDA device: the mark alone is
    enough, so test modules never import from conftest."""
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
