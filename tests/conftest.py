"""Hooks and fixtures only: the GPU skip, the end-of-test device sync, the backend and rng fixtures (the marks
are in marks.py)."""

from __future__ import annotations

import os

# One CPU thread per process for torch's and numpy's BLAS/OpenMP pools, here and in every
# subprocess a test starts (they copy os.environ): the tests' tensors are tiny, and on a small
# CI machine shared with other work, idle pool threads spinning on every core made the suite
# several times slower. Set before anything imports torch; a value given outside wins.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

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


@pytest.fixture(autouse=True)
def _gpu_work_ends_in_its_test(request):
    """A GPU test's device work has finished, without a fault, when the test ends: an asynchronous
    fault (an illegal address, say) is then reported by the test that caused it, in its teardown,
    and not by whichever test of the same process next waits on the device."""
    yield
    if "gpu" in request.node.keywords and cuda_available():
        import cupy

        cupy.cuda.runtime.deviceSynchronize()


@pytest.fixture(params=BACKENDS)
def backend(request) -> Backend:
    return Backend(request.param)


@pytest.fixture
def rng(request) -> np.random.Generator:
    # Fresh inputs on every run, but reproducible from the printed seed on failure.
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)
