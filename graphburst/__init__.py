"""graphburst: M-round speculative-decoding bursts captured into one CUDA graph.

``import graphburst`` works without cupy or a GPU; the numpy backend then runs the
reference kernels.
"""

from .backend import Backend, cuda_available, get_backend
from .buffers import KVCache, KVLayer, PtrTable, StreamBufs, kv_len_ptr_table, kv_len_ptr_table_range
from .burst import CapacityError, SpecDecoder
from .constants import NO_EOS, PLACEHOLDER_TOKEN, UNBOUNDED_BUDGET
from .kernels.digest import greedy_reference
from .protocol import DraftModel, TargetModel
from .models.ngram import NgramDraft
from .models.stubs import StubDraft, StubTarget, stub_pair

__version__ = "0.1.0"

__all__ = [
    "Backend",
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
    "UNBOUNDED_BUDGET",
    "cuda_available",
    "get_backend",
    "greedy_reference",
    "kv_len_ptr_table",
    "kv_len_ptr_table_range",
    "stub_pair",
]
