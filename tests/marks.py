"""Test marks shared by the test modules: GPU-only tests and the backends to run on.

A test that needs a GPU carries ``gpu`` (``@pytest.mark.gpu`` plus a skip without a CUDA
device) or ``requires_gpu``; ``BACKENDS`` parametrizes a test over numpy and, marked,
cupy. Import them with ``from marks import gpu`` (pytest puts tests/ on the path).
"""

from __future__ import annotations

import pytest

from graphburst.backend import cuda_available

GPU_REASON = "needs cupy and a CUDA device (run with -m gpu on a GPU machine)"
requires_gpu = pytest.mark.skipif(not cuda_available(), reason=GPU_REASON)
gpu = [pytest.mark.gpu, requires_gpu]

BACKENDS = ["numpy", pytest.param("cupy", marks=gpu)]
