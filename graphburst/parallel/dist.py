"""Process groups for multi-GPU bursts: validation first, bounded waits, careful shutdown.

Order of a parallel run (every step bounded in time):

1. :func:`check_layout` on the model config, in every process, *before* any process
   group exists: a bad layout fails alone, never inside a collective.
2. :func:`init` with a timeout (NCCL on GPUs, gloo on the numpy backend).
3. :func:`agree_on` compares a hash of everything the ranks must share (config,
   layout, dtype, k, M, batch) with one tiny all-gather, before any model collective.
4. The bursts.
5. :func:`shutdown`: graphs dropped by the caller, a barrier bounded by the group's
   timeout, then ``destroy_process_group`` in a daemon thread joined with a timeout,
   so a teardown that hangs (seen on the H200 probe) cannot keep the process alive.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field

#: Set in every launcher: NVLink SHARP / multicast stay off (the device README requires it).
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_TIMEOUT_S = 60.0
#: bounded event wait: spin (yielding the GIL) this long, then sleep in growing steps up to POLL_MAX_S
POLL_SPIN_S = 1e-3
POLL_MAX_S = 2e-4


class ParallelError(RuntimeError):
    """A multi-process run failed: another rank died, disagreed or timed out."""


@dataclass(frozen=True)
class Layout:
    """How the target is split: ``tp`` tensor-parallel ranks or ``pp`` pipeline stages (not both, this round)."""

    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def name(self) -> str:
        return f"tp{self.tp}" if self.pp == 1 else f"pp{self.pp}"


def check_layout(cfg, layout: Layout, world_size: int | None = None) -> None:
    """Raise ValueError for a layout the model cannot take (no collective involved).

    Parameters
    ----------
    cfg : graphburst.models.llama.LlamaConfig
    layout : Layout
    world_size : int, optional
        The launcher's process count (``WORLD_SIZE``); must equal ``tp * pp``.
    """
    for name in ("tp", "pp"):
        v = getattr(layout, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if layout.tp > 1 and layout.pp > 1:
        raise ValueError(f"tp={layout.tp} with pp={layout.pp}: combining tensor and pipeline parallelism is not "
                         f"supported yet; use one of them")
    if world_size is not None and world_size != layout.world:
        raise ValueError(f"the launcher started {world_size} process(es) but tp * pp = {layout.world}; start "
                         f"torchrun with --nproc_per_node {layout.world}")
    tp = layout.tp
    for field, value in (("num_attention_heads", cfg.num_attention_heads),
                         ("num_key_value_heads", cfg.num_key_value_heads),
                         ("intermediate_size", cfg.intermediate_size)):
        if value % tp:
            raise ValueError(f"tp={tp} does not divide the model's {field} ({value})")
    if cfg.num_hidden_layers % layout.pp:
        raise ValueError(f"pp={layout.pp} does not divide the model's num_hidden_layers ({cfg.num_hidden_layers})")


def config_hash(*parts) -> int:
    """A 63-bit hash of JSON-able parts (config dicts, layout, dtype names, ints)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@dataclass
class Context:
    """This process's place in the group.

    Attributes
    ----------
    rank, world, local_rank : int
    backend : str, ``"nccl"`` or ``"gloo"``
    device : torch.device, where this rank's tensors live
    timeout_s : float
    """

    rank: int
    world: int
    local_rank: int
    backend: str
    device: object
    timeout_s: float
    #: collectives issued by this process, by kind (eager calls and captures both count)
    calls: dict = field(default_factory=dict)

    def _count(self, kind: str) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1

    @property
    def is_gpu(self) -> bool:
        return self.backend == "nccl"

    # ---------------------------------------------------------------- collectives

    def all_gather_into(self, out, x) -> None:
        """``out [world, *x.shape]`` <- every rank's ``x``; capturable with NCCL, eager on gloo."""
        import torch.distributed as dist

        self._count("all_gather")
        if self.is_gpu:
            dist.all_gather_into_tensor(out, x.contiguous())
        else:
            dist.all_gather(list(out.unbind(0)), x.contiguous())

    def all_reduce_(self, x) -> None:
        """In-place sum over the ranks (the row-parallel reduction)."""
        import torch.distributed as dist

        self._count("all_reduce")
        dist.all_reduce(x)

    def send(self, x, dst: int) -> None:
        """Point-to-point to rank ``dst`` (NCCL send inside a graph; gloo eager)."""
        import torch.distributed as dist

        self._count("send")
        dist.send(x.contiguous(), dst)

    def recv(self, out, src: int) -> None:
        import torch.distributed as dist

        self._count("recv")
        dist.recv(out, src)

    def gather_ints(self, values) -> list[list[int]]:
        """Every rank's small list of ints (host values; eager, outside any graph)."""
        import torch

        x = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        out = torch.empty((self.world, x.numel()), dtype=torch.int64, device=self.device)
        self.all_gather_into(out, x)
        return out.cpu().tolist()

    def agree_on(self, what: str, *parts) -> None:
        """Raise ValueError naming the ranks whose ``parts`` hash differs from rank 0's.

        One tiny all-gather; call it after :func:`init` and before any model collective.
        """
        h = config_hash(*parts)
        hashes = [row[0] for row in self.gather_ints([h])]
        bad = [r for r, v in enumerate(hashes) if v != hashes[0]]
        if bad:
            raise ValueError(f"{what} differs across ranks: rank(s) {bad} disagree with rank 0 (hashes "
                             f"{[hex(v) for v in hashes]}); every rank must load the same model and flags")


def env_world() -> tuple[int, int, int]:
    """``(rank, world, local_rank)`` from torchrun's environment, ``(0, 1, 0)`` without it."""
    def read(name, default):
        raw = os.environ.get(name, str(default))
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name} must be an int, got {raw!r}") from None
    return read("RANK", 0), read("WORLD_SIZE", 1), read("LOCAL_RANK", 0)


def use_device(index: int) -> None:
    """Make CUDA device ``index`` current for torch *and* CuPy in this process (once, at start).

    graphburst's kernels launch on CuPy's current device, and not every burst step enters
    a device context, so a rank on GPU 1 must not leave CuPy on GPU 0.
    """
    import torch

    torch.cuda.set_device(index)
    try:
        import cupy
    except ImportError:
        return
    cupy.cuda.Device(index).use()


def init(*, gpu: bool, timeout_s: float = DEFAULT_TIMEOUT_S) -> Context:
    """Join the process group torchrun describes (``MASTER_ADDR``/``PORT``, ``RANK``, ``WORLD_SIZE``).

    Parameters
    ----------
    gpu : bool
        NCCL on CUDA device ``LOCAL_RANK`` (set current first), else gloo on CPU.
    timeout_s : float
        Every collective and the rendezvous give up after this long.
    """
    import torch
    import torch.distributed as dist

    for key, value in NCCL_SAFE_ENV.items():
        os.environ.setdefault(key, value)
    rank, world, local_rank = env_world()
    if world < 2:
        raise ValueError("a parallel run needs at least 2 processes: launch it with torchrun --nproc_per_node N")
    timeout = datetime.timedelta(seconds=timeout_s)
    if gpu:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", local_rank)
        use_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return Context(rank=rank, world=world, local_rank=local_rank, backend="nccl" if gpu else "gloo", device=device,
                   timeout_s=timeout_s)


def shutdown(ctx: Context | None, *, ok: bool = True) -> bool:
    """Leave the group; True when teardown finished within the timeout.

    Drop every captured graph that holds collectives before calling this. ``ok=False``
    (this rank failed) skips the barrier: the others are not coming.
    """
    import torch
    import torch.distributed as dist

    if ctx is None or not dist.is_initialized():
        return True
    try:
        if ctx.is_gpu and ok:
            # Not when this rank failed: a graph-replayed collective whose peer died never
            # finishes, and neither would this synchronize.
            torch.cuda.synchronize(ctx.device)
        if ok:
            dist.barrier()  # bounded by the group's timeout
    except Exception:  # noqa: BLE001 - teardown goes on; the run's own error is the one to report
        ok = False
    done = threading.Event()

    def destroy():
        try:
            dist.destroy_process_group()
        finally:
            done.set()

    # A daemon thread: if NCCL's teardown hangs, it does not keep the interpreter alive.
    threading.Thread(target=destroy, name="graphburst-destroy-pg", daemon=True).start()
    return done.wait(ctx.timeout_s / 4) and ok


def wait_until(done, timeout_s: float, what: str) -> None:
    """Wait until ``done()`` is true, at most ``timeout_s`` seconds; else ParallelError.

    Replaces a blocking ``event.synchronize()`` where the work before the event holds
    collectives replayed from a CUDA graph: the NCCL watchdog does not watch those, so a
    rank whose peer died mid-graph would block forever. Polling spins for
    :data:`POLL_SPIN_S` (a burst that is nearly done costs no sleep latency), then sleeps
    in steps growing to :data:`POLL_MAX_S`.

    Parameters
    ----------
    done : callable () -> bool
        For a CuPy event, ``lambda: event.done`` (``cudaEventQuery``, no sync).
    timeout_s : float
    what : str
        Names the rank and what it waited for, in the error message.
    """
    if done():
        return
    start = time.monotonic()
    pause = 1e-5
    while not done():
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise ParallelError(f"{what} did not finish within {timeout_s:g} s; another rank probably died "
                                f"mid-graph (collectives replayed from a CUDA graph are not watched by the NCCL "
                                f"watchdog)")
        if waited < POLL_SPIN_S:
            time.sleep(0)  # yield the GIL to the server's threads, no timer latency
        else:
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
