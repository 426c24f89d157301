"""Prefill graphs of prompts packed end to end: one call per admission, no padding between prompts.

:class:`~graphburst.models.prefill_graphs.PrefillGraphs` pads every prompt of a call to the
call's longest and splits an admission into calls of like length; a mixed admission still
ran about twice its tokens (11 lognormal prompts on the 8b shape: 1402 tokens as 2816).
:class:`PackedPrefillGraphs` lays a fresh admission's prompts end to end in one row
(:class:`~graphburst.models.llama_layers.Packed`): every GEMM runs on the prompts' own
tokens, and attention is causal within each prompt (variable-length flash attention,
:mod:`~graphburst.models.varlen`).

A call is padded only at its end, up to a **bucket** of ``(rows, tokens)``: the tokens
rounded up :data:`TOKEN_LADDER` (at most 1.25x past 256 tokens) and the rows up
:data:`PACKED_ROW_LADDER` (a padding row costs only its logits; a padding token costs a
token's compute). Padding tokens form segments of their own, of at most ``S`` tokens, at
position ``S`` in slot 0, so their KV writes clamp to row ``S - 1`` of slot 0, which no
attention reads, as the padding rows of the padded buckets do. Capture, replay, the eager first use and warm-up are
:class:`PrefillGraphs`' own.

The host builds each call's index block (the source of each token in the prompt staging,
its position and slot, each prompt's last token, the segment offsets) from the prompt
lengths it already has, and uploads it in one pinned, non-blocking copy: nothing reads the
device.

:func:`prefill_graphs_for` picks an adapter's prefill graphs, padded or packed.
"""

from __future__ import annotations

import numpy as np

from .prefill_buckets import DEFAULT_MAX_TOKENS, _ladder_to, _up
from .prefill_graphs import PrefillGraphs

#: tokens of a packed bucket (then doubling past the last). A padding token costs a whole
#: token's compute, so past 256 the steps are at most 1.25x (an admission's mixed prompts of 1622
#: tokens ran 12% slower in a bucket of 2048 than the same tokens padded per call, 8b, H200)
TOKEN_LADDER = (16, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792,
                2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192)
#: prompts of a packed bucket: a padding row costs one row of logits, so the steps are coarse
PACKED_ROW_LADDER = (1, 2, 4, 8, 16, 32, 64)


def packed_warm_sizes(max_rows: int, max_tokens: int = DEFAULT_MAX_TOKENS, max_length: int | None = None) -> list:
    """The ``(rows, tokens)`` buckets a packed warm-up of ``max_rows`` makes, largest first: rows up
    the ladder to ``max_rows``' bucket, tokens from the fewest a call of those rows can have (one
    more prompt than the rows bucket below, one token each) up to ``max_tokens`` and to ``rows``
    times ``max_length``'s bucket (a prompt never exceeds the capacity, nor a chunk the chunk size)."""
    if max_rows <= 0:
        return []
    sizes, below = [], 0  # below: the rows bucket under r (a call in bucket r has more prompts)
    for r in _ladder_to(PACKED_ROW_LADDER, _up(PACKED_ROW_LADDER, max_rows)):
        top = max_tokens if max_length is None else min(max_tokens, r * _up(TOKEN_LADDER, max_length))
        # a call of below + 1 prompts of one token each is the bucket's smallest
        sizes += [(r, t) for t in _ladder_to(TOKEN_LADDER, top) if t > below]
        below = r
    return sorted(sizes, key=lambda rt: (-rt[1], -rt[0]))


def padding_segments(tokens: int, s: int) -> int:
    """Segments a bucket of ``tokens`` keeps for its padding tokens: pieces of at most ``s``
    tokens (the storage rows per slot, which bounds a prompt too), so the attention's
    ``max_len``, which sizes its grid, is at most ``s`` whatever the bucket."""
    return max(1, -(-tokens // s))


class _PackedBucket:
    """Static inputs of one packed bucket's forward (``R_b`` prompts, ``T_b`` tokens), its graph and output.

    ``index`` is one int64 block, uploaded whole: ``[src (T_b) | pos (T_b) | slot (T_b) | last (R_b) |
    cu (R_b + 1 + padding_segments)]``; ``cu`` is then cast into its int32 buffer.
    """

    def __init__(self, torch, rows: int, tokens: int, s: int, device):
        from .llama_layers import Packed  # needs torch: imported on use, as graphburst imports without it

        self.rows, self.length = rows, tokens
        n_cu = rows + 1 + padding_segments(tokens, s)
        self.index = torch.zeros(3 * tokens + rows + n_cu, dtype=torch.int64, device=device)  # int64 block
        self.src, self.pos, self.slot = self.index[:tokens], self.index[tokens: 2 * tokens], \
            self.index[2 * tokens: 3 * tokens]  # [T_b] int64 each
        self.last = self.index[3 * tokens: 3 * tokens + rows]  # [R_b] int64
        self.cu = torch.zeros(n_cu, dtype=torch.int32, device=device)  # [R_b + 1 + pad segments] int32 offsets
        self.tokens = torch.zeros((1, tokens), dtype=torch.int64, device=device)  # [1, T_b] int64
        self.packed = Packed(self.pos, self.slot, self.cu, min(tokens, s), self.last)
        self.graph = None
        self.out = None  # [R_b, 1, V] float32 logits, or None without a head

    def upload(self, torch, host, pinned: bool) -> None:
        """Copy the host index block in (pinned and non-blocking on a GPU: torch's caching host
        allocator keeps the block until the copy has run, and the host moves on), then ``cu``."""
        self.index.copy_(host.pin_memory() if pinned else host, non_blocking=True)
        self.cu.copy_(self.index[3 * self.length + self.rows:])


def packed_index(rows, lengths, width: int, t_b: int, r_b: int, s: int) -> np.ndarray:
    """The host index block of one packed call (:class:`_PackedBucket`'s layout).

    Parameters
    ----------
    rows : [R] int, the prompts' slots; lengths : [R] int, their tokens (>= 1)
    width : int, the prompt staging's row width (a token's source is ``slot * width + i``)
    t_b, r_b : int, the bucket (>= the tokens, >= R)
    s : int, the KV storage's rows per slot (the padding tokens' position)
    """
    rows, lengths = np.asarray(rows, np.int64), np.asarray(lengths, np.int64)
    r, t = rows.size, int(lengths.sum())
    pads = padding_segments(t_b, s)
    block = np.zeros(3 * t_b + 2 * r_b + 1 + pads, np.int64)
    src, pos, slot = block[:t_b], block[t_b: 2 * t_b], block[2 * t_b: 3 * t_b]
    last, cu = block[3 * t_b: 3 * t_b + r_b], block[3 * t_b + r_b:]  # [R_b], [R_b + 1 + pads]
    ends = np.cumsum(lengths)
    seg = np.repeat(np.arange(r), lengths)  # [T] the prompt of each token
    pos[:t] = np.arange(t) - (ends - lengths)[seg]
    slot[:t] = rows[seg]
    src[:t] = slot[:t] * width + pos[:t]
    pos[t:] = s  # padding: clamped to row S - 1 of slot 0 (src 0: any valid id)
    last[:r] = ends - 1
    cu[1: r + 1] = ends
    cu[r + 1: r_b + 1] = t  # empty segments for the padding rows,
    cu[r_b + 1:] = np.minimum(t + s * np.arange(1, pads + 1), t_b)  # then the padding tokens, s at most each
    return block


class PackedPrefillGraphs(PrefillGraphs):
    """:class:`PrefillGraphs` over packed calls (module docstring); the module needs ``accepts_packed``.

    Use :meth:`run_packed` (the padded :meth:`run` is not for this class) and :meth:`plan`;
    continued chunks (a prompt's chunks after its first) run the parent's padded
    :meth:`~PrefillGraphs.run_continued`.
    """

    packed = True

    @property
    def vocab(self) -> int | None:
        return getattr(self.module, "vocab", None)

    def bucket(self, rows: int, tokens: int) -> tuple[int, int] | None:
        """``(rows, tokens)`` of the bucket a packed call runs in, or None (eager, unpadded)."""
        t = _up(TOKEN_LADDER, tokens)
        return (_up(PACKED_ROW_LADDER, rows), t) if t <= self.max_tokens else None

    def warm_sizes(self, max_rows: int, max_length: int | None = None) -> list:
        return packed_warm_sizes(max_rows, self.max_tokens, max_length)

    def _new_bucket(self, size: tuple[int, int]) -> _PackedBucket:
        return _PackedBucket(self.torch, *size, self.s, self.device)

    def _pad(self, b: _PackedBucket, r: int) -> None:
        """Only :meth:`warm_up` calls this (``r == 0``): every token is padding."""
        assert r == 0, r
        b.upload(self.torch, self.torch.from_numpy(packed_index([], [], 1, b.length, b.rows, self.s)), False)

    def run(self, *args, **kwargs):
        raise TypeError("PackedPrefillGraphs runs packed calls: use run_packed")

    def run_packed(self, staging, rows, lengths, head: bool):
        """The fresh prefill of the prompts ``staging[rows[i], :lengths[i]]``, packed, on the current stream.

        Parameters
        ----------
        staging : [B', P] int32 or int64 tensor, each slot's prompt left-aligned in its row
        rows : [R] host int array, the prompts' slots (rows of ``staging``)
        lengths : [R] host int array, their tokens (>= 1)
        head : bool
            Compute the logits after each prompt's last token (else only the KV).

        Returns
        -------
        [R, V] float32 logits (a view into the bucket's output, valid until its next run), or
        None without a head. A call past every bucket, or a bucket's first use (unless warmed),
        runs eagerly and unpadded.
        """
        torch = self.torch
        rows, lengths = np.asarray(rows, np.int64), np.asarray(lengths, np.int64)
        r, t = rows.size, int(lengths.sum())
        size = self.bucket(r, t)
        b = None if size is None else self._use_bucket(size, head, lambda: self._new_bucket(size))
        graphed = b is not None
        if not graphed:  # unpadded, eager: a bucket of exactly this call
            b = _PackedBucket(torch, r, t, self.s, self.device)
        host = torch.from_numpy(packed_index(rows, lengths, staging.shape[1], b.length, b.rows, self.s))
        b.upload(torch, host, pinned=self.device.type == "cuda")
        b.tokens[0].copy_(staging.reshape(-1)[b.src])
        if self.vocab is not None:  # prompts are validated at submission; a stray id must not index past the table
            b.tokens.clamp_(0, self.vocab - 1)
        out = self._call(b, head) if graphed else self._forward(b, head, max_len=int(lengths.max()))
        return None if out is None else out[:r, 0]

    def _forward(self, b: _PackedBucket, head: bool, max_len: int | None = None):
        if not isinstance(b, _PackedBucket):  # a continued call's padded bucket (run_continued)
            return super()._forward(b, head)
        packed = b.packed if max_len is None else b.packed._replace(max_len=max_len)
        return self.module(b.tokens, None, [None] * len(self.kv_layers), packed=packed, head=head)

    def plan(self, lengths: dict) -> list[list[int]]:
        """One call per admission, split only past ``max_tokens``: rows taken longest first while
        the call stays within it (a prompt longer than that alone, eagerly); slots sorted per call."""
        groups, current, total = [], [], 0
        for slot, n in sorted(lengths.items(), key=lambda kv: (-kv[1], kv[0])):
            if current and total + n > self.max_tokens:
                groups.append(sorted(current))
                current, total = [], 0
            current.append(slot)
            total += n
        if current:
            groups.append(sorted(current))
        return groups


def prefill_graphs_for(module, wanted: bool | None, kv_layers, *, gpu: bool,
                       packed: bool | None = None) -> PrefillGraphs | None:
    """An adapter's prefill graphs: ``wanted`` None means on a GPU for a module that can.

    ``packed``: the prompts of a call end to end (:mod:`~graphburst.models.packed_prefill`);
    None means where the module ``accepts_packed`` and its KV's dtype and device take the
    flash kernel (:func:`~graphburst.models.varlen.flash_varlen_available`), or on the CPU.

    Raises TypeError for a ``wanted`` or ``packed`` that is not a bool or None, ValueError for
    True with a module that lacks ``accepts_fresh``, ``accepts_logits_at`` or ``accepts_head``
    (or ``accepts_packed``), and for ``packed`` True without prefill graphs. On numpy, True
    gives the buckets run eagerly (the path CPU tests hold).
    """
    for name, value in (("prefill_graphs", wanted), ("packed_prefill", packed)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool or None, got {type(value).__name__}")
    able = all(getattr(module, f"accepts_{what}", False) for what in ("fresh", "logits_at", "head"))
    if wanted and not able:
        raise ValueError(f"prefill_graphs=True needs a module with accepts_fresh, accepts_logits_at and "
                         f"accepts_head ({type(module).__name__} lacks one)")
    can_pack = bool(getattr(module, "accepts_packed", False))
    if packed and not can_pack:
        raise ValueError(f"packed_prefill=True needs a module with accepts_packed ({type(module).__name__} "
                         "lacks it, or runs deterministic attention)")
    if not (wanted or (wanted is None and able and gpu)):
        if packed:
            raise ValueError("packed_prefill=True needs prefill graphs (they run on a GPU by default; "
                             "pass prefill_graphs=True elsewhere)")
        return None
    if packed is None:  # by default only where the flash kernel serves it (else the O(T^2) reference would)
        from .varlen import flash_varlen_available  # needs torch: imported on use, as graphburst imports without it

        storage = next(s for s in module.kv_layers() if s is not None)
        packed = can_pack and (storage.device.type == "cpu" or flash_varlen_available(storage.dtype, storage.device))
    if packed:
        return PackedPrefillGraphs(module, kv_layers=kv_layers, capture=gpu)
    return PrefillGraphs(module, kv_layers=kv_layers, capture=gpu)
