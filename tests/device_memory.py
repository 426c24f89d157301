"""This process's own device memory, for the tests that check it does not grow or stays in a budget.

The device's free memory (``cudaMemGetInfo``) counts every process on the GPU: under
``pytest -n 4``, or next to ``tools/gpu_load.py``, it moves for reasons no test controls.
What this process's allocators hold does not: CuPy's default pool, and torch's caching
allocator once torch has started CUDA. (Kernel modules, graphs and library handles are
outside both.)
"""

from __future__ import annotations

import sys


def own_device_bytes() -> dict:
    """Bytes in use and held by this process's allocators: ``cupy_used``, ``cupy_held`` and, when
    torch has initialised CUDA, ``torch_allocated`` and ``torch_reserved``."""
    import cupy

    pool = cupy.get_default_memory_pool()
    out = {"cupy_used": pool.used_bytes(), "cupy_held": pool.total_bytes()}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        out["torch_allocated"] = torch.cuda.memory_allocated()
        out["torch_reserved"] = torch.cuda.memory_reserved()
    return out


def held_bytes(counts: dict) -> int:
    """What the allocators hold from the device, of an :func:`own_device_bytes` reading."""
    return counts["cupy_held"] + counts.get("torch_reserved", 0)


def release_cached_blocks() -> None:
    """Give the allocators' idle blocks back to the device, so what they hold next is what was
    allocated since (an idle block reused would hide an allocation from a growth check)."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def peak_bytes() -> dict:
    """torch's peak allocated and reserved bytes since the process started CUDA (empty without torch
    on CUDA): what a growth check's message shows, so a breach says whether a peak or what is still
    held passed the budget."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    return {"torch_max_allocated": torch.cuda.max_memory_allocated(), "torch_max_reserved": torch.cuda.max_memory_reserved()}
