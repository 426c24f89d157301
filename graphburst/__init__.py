"""graphburst: M-round speculative-decoding bursts captured into one CUDA graph.

``import graphburst`` works without cupy or a GPU; the numpy backend then runs the
reference kernels. ``TorchTarget`` and ``TorchDraft`` are loaded on first use (PEP 562),
so it works without torch too.
"""

from .backend import Backend, cuda_available, get_backend
from .buffers import KVCache, KVLayer, PtrTable, StreamBufs, kv_len_ptr_table, kv_len_ptr_table_range
from .engine.mode import BurstMode
from .engine.admission.checks import CapacityError
from .engine.decoder import SpecDecoder
from .capture import BurstGraph
from .constants import NO_EOS, PLACEHOLDER_TOKEN, UNBOUNDED_BUDGET
from .kernels.digest import greedy_reference
from .protocol import DraftModel, TargetModel
from .models.ngram import NgramDraft
from .models.stubs import StubDraft, StubTarget, stub_pair

__version__ = "0.1.0"

_LAZY = {"TorchTarget": "graphburst.models.torch_adapter", "TorchDraft": "graphburst.models.torch_adapter"}


def __getattr__(name: str):
    """``TorchTarget`` / ``TorchDraft`` from :mod:`graphburst.models.torch_adapter`, imported when first named."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graphburst' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


__all__ = [
    "Backend",
    "BurstGraph",
    "BurstMode",
    "CapacityError",
    "DraftModel",
    "KVCache",
    "KVLayer",
    "NO_EOS",
    "NgramDraft",
    "PLACEHOLDER_TOKEN",
    "PtrTable",
    "SpecDecoder",
    "StreamBufs",
    "StubDraft",
    "StubTarget",
    "TargetModel",
    "TorchDraft",
    "TorchTarget",
    "UNBOUNDED_BUDGET",
    "cuda_available",
    "get_backend",
    "greedy_reference",
    "kv_len_ptr_table",
    "kv_len_ptr_table_range",
    "stub_pair",
]
