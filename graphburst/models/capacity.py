"""KV capacity from the GPU's memory (``--capacity auto``): the generic arithmetic.

Every part that will allocate memory describes itself as a :class:`MemorySpec` (the
model modules build them from their configs: ``llama_memory.memory_spec``,
``stubs.stub_memory_spec``, ``NgramDraft.memory_spec``; the serving factory adds the
decoder's own buffers), and :func:`auto_capacity` finds the largest capacity whose
total fits::

    available = total * gpu_memory_fraction - (total - free)          # free: before anything is built
    need(C)   = sum over parts of rows(C) * (batch * slot_row_bytes + row_bytes)
              + fixed_bytes + reserve_bytes (every part) + RUNTIME_RESERVE_BYTES
    capacity  = the largest multiple of CAPACITY_MULTIPLE with need(C) <= available,
                capped by every part's max_capacity (a model's max_position_embeddings)

``total - free`` is what the device already holds when sizing runs: the CUDA context,
other processes, allocator pools. ``fixed_bytes`` is what a part allocates once but has
not yet (weights, burst buffers); ``reserve_bytes`` its transient peak (activations,
logits), both stated by the part. Nothing here knows a particular model.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

#: The ``--gpu-memory-fraction`` default: vLLM's, leaving a tenth of the GPU to everything unaccounted.
DEFAULT_GPU_MEMORY_FRACTION = 0.9
#: Capacities are rounded down to a multiple of this: the Triton decode attention reads KV in
#: tiles of 64 rows (``kernels/attention.BLOCK_N``), so a full slot ends on a whole tile,
#: and 64 is a multiple of the Llama KV row rounding (``llama.KV_ROW_MULTIPLE``, 16), so a
#: model's storage rows (capacity + its slack, rounded) waste no rows to rounding.
CAPACITY_MULTIPLE = 64
#: Memory the estimate does not itemise: cuBLAS and cuDNN workspaces, the CuPy and Triton
#: modules loaded at first launch, allocator fragmentation, a captured graph's own nodes.
RUNTIME_RESERVE_BYTES = 512 * 2**20
#: The largest capacity handed out: the ServeConfig range (int32 positions), as a multiple.
CAPACITY_LIMIT = (2**31 - 2) // CAPACITY_MULTIPLE * CAPACITY_MULTIPLE


@dataclasses.dataclass(frozen=True)
class MemorySpec:
    """What one part (a model, the decoder's buffers) will allocate, as a function of the capacity.

    Parameters
    ----------
    name : str
        For messages (``target``, ``draft``, ``decoder``).
    slot_row_bytes : int
        Bytes per batch slot per storage row: a model's KV (every layer, K and V).
    row_bytes : int
        Bytes per storage row shared by the slots (RoPE tables, a prefill's attention mask).
    slack_rows, row_multiple : int
        Storage rows are ``ceil((capacity + slack_rows) / row_multiple) * row_multiple``.
    fixed_bytes : int
        Allocated once, not yet at sizing time (weights, buffers).
    reserve_bytes : int
        Transient peak (activations, logits).
    max_capacity : int or None
        The largest capacity the part can use (a model's ``max_position_embeddings``).
    max_capacity_why : str
        What sets it, for messages.
    """

    name: str
    slot_row_bytes: int
    row_bytes: int = 0
    slack_rows: int = 0
    row_multiple: int = 1
    fixed_bytes: int = 0
    reserve_bytes: int = 0
    max_capacity: int | None = None
    max_capacity_why: str = "positions"

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "max_capacity_why"):
                if not isinstance(value, str) or not value:
                    raise TypeError(f"MemorySpec {f.name} must be a non-empty str, got {value!r}")
            elif value is not None or f.name != "max_capacity":
                low = 1 if f.name in ("row_multiple", "max_capacity") else 0
                if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                    raise ValueError(f"MemorySpec {self.name!r}: {f.name} must be an int >= {low}, got {value!r}")

    def rows(self, capacity: int) -> int:
        """Storage rows per slot at ``capacity``."""
        return -(-(capacity + self.slack_rows) // self.row_multiple) * self.row_multiple

    def bytes_at(self, capacity: int, batch: int) -> int:
        """Everything this part takes at ``capacity``: storage, fixed and reserved."""
        return self.kv_bytes_at(capacity, batch) + self.fixed_bytes + self.reserve_bytes

    def kv_bytes_at(self, capacity: int, batch: int) -> int:
        """The part that grows with the capacity."""
        return self.rows(capacity) * (batch * self.slot_row_bytes + self.row_bytes)


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """The capacity :func:`auto_capacity` chose, and the figures it chose it from (bytes)."""

    capacity: int
    batch: int
    gpu_memory_fraction: float
    total_bytes: int
    free_bytes: int
    specs: tuple
    limit: str | None  # what capped it below the memory: "the target's max_position_embeddings", or None

    @property
    def in_use_bytes(self) -> int:
        return self.total_bytes - self.free_bytes

    @property
    def available_bytes(self) -> int:
        """The budget: ``total * fraction - in use``."""
        return math.floor(self.total_bytes * self.gpu_memory_fraction) - self.in_use_bytes

    @property
    def fixed_bytes(self) -> int:
        return sum(s.fixed_bytes for s in self.specs)

    @property
    def reserve_bytes(self) -> int:
        return sum(s.reserve_bytes for s in self.specs) + RUNTIME_RESERVE_BYTES

    @property
    def kv_bytes(self) -> int:
        return sum(s.kv_bytes_at(self.capacity, self.batch) for s in self.specs)

    def describe(self) -> str:
        """One line: the capacity and where it came from."""
        capped = f", capped by {self.limit}" if self.limit else ""
        return (f"capacity {self.capacity} KV entries per slot (auto{capped}: {self.batch} slots x "
                f"{row_text(self.specs)} = {gib(self.kv_bytes)} GiB; {gib(self.available_bytes)} GiB available at "
                f"--gpu-memory-fraction {self.gpu_memory_fraction:g} of {gib(self.total_bytes)} GiB, "
                f"{gib(self.in_use_bytes)} GiB in use, {gib(self.fixed_bytes)} GiB weights and buffers, "
                f"{gib(self.reserve_bytes)} GiB reserved for activations)")


def gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def size_text(n: int) -> str:
    """``32 KiB``, ``4 B``, ``1.5 KiB``."""
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:g} KiB" if n % 128 == 0 else f"{n / 1024:.1f} KiB"


def row_text(specs) -> str:
    """``(target 32 KiB + draft 4 KiB per row)``: the slot-row bytes of each part that has any."""
    parts = [f"{s.name} {size_text(s.slot_row_bytes)}" for s in specs if s.slot_row_bytes]
    return f"({' + '.join(parts)} per row)"


def check_fraction(value) -> float:
    """``gpu_memory_fraction`` as a float in ``(0, 1]`` (ValueError/TypeError naming the value)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"gpu_memory_fraction must be a number in (0, 1], got {type(value).__name__} {value!r}")
    if math.isnan(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {value}")
    return float(value)


def device_memory(backend) -> tuple[int, int]:
    """``(free, total)`` bytes of the backend's GPU (``cudaMemGetInfo``); ValueError on the numpy backend."""
    if not backend.is_gpu:
        raise ValueError("capacity 'auto' sizes the KV cache from the GPU's memory, and the numpy backend has no GPU; "
                         "give a capacity (or, from Python, free_bytes and total_bytes)")
    with backend.device():
        free, total = backend.xp.cuda.runtime.memGetInfo()
    return int(free), int(total)


def auto_capacity(specs: Sequence[MemorySpec], *, batch: int, gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION,
                  free_bytes: int | None = None, total_bytes: int | None = None, backend=None, min_capacity: int = 1,
                  multiple: int = CAPACITY_MULTIPLE) -> CapacityPlan:
    """The largest KV capacity per slot whose parts fit the GPU's budget (module docstring).

    Parameters
    ----------
    specs : sequence of MemorySpec
        Every part that will allocate (target, draft, the decoder's buffers).
    batch : int
    gpu_memory_fraction : float
        In ``(0, 1]``: the share of the GPU's total memory this process may hold.
    free_bytes, total_bytes : int, optional
        The device's figures; read from ``backend``'s GPU (:func:`device_memory`) when absent.
    min_capacity : int
        The smallest useful capacity (a prompt of 1 plus one burst's tokens).
    multiple : int
        Round down to a multiple of this.

    Returns
    -------
    CapacityPlan

    Raises
    ------
    ValueError
        When the smallest useful capacity does not fit (the message names the figures), a
        part caps the capacity below it, or there are no figures (the numpy backend).
    """
    specs = tuple(specs)
    if not specs or not all(isinstance(s, MemorySpec) for s in specs):
        raise TypeError(f"specs must be a non-empty sequence of MemorySpec, got {specs!r:.80}")
    for name, value in (("batch", batch), ("min_capacity", min_capacity), ("multiple", multiple)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    fraction = check_fraction(gpu_memory_fraction)
    if (free_bytes is None) != (total_bytes is None):
        raise ValueError("give both free_bytes and total_bytes, or neither (then the GPU's are read)")
    if free_bytes is None:
        if backend is None:
            raise ValueError("capacity 'auto' needs a GPU backend, or free_bytes and total_bytes")
        free_bytes, total_bytes = device_memory(backend)
    for name, value in (("free_bytes", free_bytes), ("total_bytes", total_bytes)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if free_bytes > total_bytes:
        raise ValueError(f"free_bytes {free_bytes} exceeds total_bytes {total_bytes}")

    def plan(capacity: int, limit=None) -> CapacityPlan:
        return CapacityPlan(int(capacity), int(batch), fraction, int(total_bytes), int(free_bytes), specs, limit)

    ceiling, limit = min(((s.max_capacity, f"the {s.name}'s {s.max_capacity_why}") for s in specs
                          if s.max_capacity is not None),
                         default=(CAPACITY_LIMIT, None), key=lambda pair: pair[0])  # the first part of the lowest
    if ceiling < min_capacity:
        raise ValueError(f"{limit} allows a capacity of {ceiling}, below the {min_capacity} KV entries a slot needs "
                         f"(a prompt of 1 plus one burst's tokens)")
    empty = plan(0)
    budget = empty.available_bytes - empty.fixed_bytes - empty.reserve_bytes  # what the growing part may take
    per_row = sum(batch * s.slot_row_bytes + s.row_bytes for s in specs)
    # Without slack or rounding rows this capacity would fill the budget exactly: an upper bound.
    fits = min(max(budget, 0) // max(per_row, 1), CAPACITY_LIMIT) // multiple * multiple
    while fits > 0 and sum(s.kv_bytes_at(fits, batch) for s in specs) > budget:
        fits -= multiple  # the slack and rounding rows: a step or two
    if fits < min_capacity:
        smallest = -(-min_capacity // multiple) * multiple
        need = sum(s.kv_bytes_at(smallest, batch) for s in specs)
        raise ValueError(f"batch {batch} x {row_text(specs)} needs {gib(need)} GiB for capacity {smallest}; "
                         f"{gib(max(budget, 0))} GiB available at --gpu-memory-fraction {fraction:g} "
                         f"({gib(total_bytes)} GiB x {fraction:g}, less {gib(empty.in_use_bytes)} GiB in use, "
                         f"{gib(empty.fixed_bytes)} GiB of weights and buffers, {gib(empty.reserve_bytes)} GiB "
                         f"reserved for activations)")
    if ceiling < fits:
        return plan(ceiling, limit)
    return plan(fits)
