"""CUDA graphs of a torch module's fresh prefill, one per (rows, length) bucket.

Eager prefill is host-bound. On an H200 the 1b shape's prefill issued ~430 kernels
and cost the host 8-10 ms whether it admitted 1 prompt of 128 tokens or 11 (torch.profiler),
while the GPU finished 1 x 128 in about
a millisecond: the serving loop's idle under load is that host time. A captured forward is
one launch.

Admissions differ in how many prompts they carry and how long the longest is, so a call is
padded up to a **bucket**: its rows and its length each rounded up the ladders below (at
most 1.5x of waste in each, and none at the common small sizes). A bucket's first call
runs eagerly and unpadded (a capture costs the host about two eager forwards, wasted on a
size seen once); its second call runs the padded forward for real, then captures it; later
calls replay. Buckets past ``max_tokens`` always run eagerly. :meth:`PrefillGraphs.plan`
splits one admission into calls of like length, so a long prompt does not pad short ones.

**Warm-up** (:meth:`PrefillGraphs.warm_up`, before serving): under load most admissions
are of a size not seen yet, and each bucket's first two calls stall the decoding streams
(an eager call, then a capture). Warm-up captures every bucket of up to a few rows
(:func:`warm_sizes`) from calls made of padding rows only, so it writes no KV row a slot
reads; a warmed bucket's first real call replays.

**Padding rows** start at position ``S`` (the KV storage's rows per slot), so every KV row
they write clamps to row ``S - 1`` of their slot (``llama.kv_index``), past ``capacity``
plus the verify's ``k + 1`` rows: a row no attention reads (the adapter requires
``kv_slack >= k + 2``), where a real row's own padding tokens already write. Only a
**fresh** call (every row at position 0: :class:`~graphburst.models.llama_layers.LayerIndex`)
and a **continued** call (one chunk of each row's prompt at its ``start``, behind the rows
its earlier chunks cached: :meth:`PrefillGraphs.run_continued`) are graphed. A continued
call's attention reads each row's cached KV through a mask built on the device from the
bucket's ``start`` input, so it replays for any start; its padding rows start at ``S`` too.

The ladders and the warm-up's sizes are :mod:`~graphburst.models.prefill_buckets`.

Capture runs on a side stream ordered after the decoder's stream by events (no host sync):
the bucket's real forward (which is also the capture's warm-up: lazy kernel loading and
library handles happen outside the capture), then the capture, then the decoder's stream
waits for the side stream. Replays run on the decoder's stream. All graphs share one
memory pool: they replay one at a time on one stream, and each output is read before the
next replay.
"""

from __future__ import annotations

import time

from ..engine.collector import COLLECTOR_PAUSE
from ..engine.torch_capture import end_capture_quietly
from ..validate import check_int
from .prefill_buckets import (CALL_COST_TOKENS, CAPTURE_AT_USE, DEFAULT_MAX_TOKENS, EAGER_CALL_COST_TOKENS,
                              continued_warm_lengths, padded_bucket, warm_sizes)


class _Bucket:
    """Static inputs of one bucket's forward, its graph and its output.

    ``fresh``: every real row starts at position 0 (``start`` zero there); else a continued
    call, whose ``start`` holds each row's cached KV rows (the chunk's first position).
    """

    def __init__(self, torch, rows: int, length: int, s: int, device, fresh: bool = True):
        self.rows, self.length, self.fresh = rows, length, fresh
        self.tokens = torch.zeros((rows, length), dtype=torch.int64, device=device)  # [R_b, P_b] int64
        self.idx = torch.zeros(rows, dtype=torch.int64, device=device)  # [R_b] int64 batch rows
        self.start = torch.full((rows,), s, dtype=torch.int32, device=device)  # [R_b] int32 first position (S: padding)
        self.last = torch.zeros(rows, dtype=torch.int64, device=device)  # [R_b] int64 logits position
        self.graph = None
        self.out = None  # [R_b, 1, V] float32 logits, or None without a head


class PrefillGraphs:
    """Bucketed prefill forwards of one torch module, captured on a GPU.

    Parameters
    ----------
    module
        A module with ``accepts_fresh``, ``accepts_logits_at`` and ``accepts_head``
        (:class:`~graphburst.models.llama.Llama`), and ``kv_layers()``.
    kv_layers : list of bool
        Which layers hold KV (the adapter's lengths list is None elsewhere).
    capture : bool
        Capture and replay CUDA graphs. False runs each bucket's padded forward eagerly
        (the CPU path, so the bucketing and padding are tested without a GPU).
    max_tokens : int
        Buckets past this many rows x tokens run unpadded and eagerly (``run`` returns
        ``NotImplemented``: the caller's own path).
    capture_at : int, optional
        The call of a bucket that makes it (captured on a GPU); earlier calls run eagerly
        and unpadded. Default :data:`CAPTURE_AT_USE` with ``capture``, else 1 (every call
        padded, the path CPU tests hold); CPU tests give the GPU's policy to hold it too.
    """

    #: calls pad each prompt to the call's longest (False) or pack them end to end (the subclass)
    packed = False

    def __init__(self, module, *, kv_layers, capture: bool, max_tokens: int = DEFAULT_MAX_TOKENS,
                 capture_at: int | None = None):
        import torch

        self.torch = torch
        self.module = module
        self.kv_layers = list(kv_layers)
        self.capture = bool(capture)
        self.max_tokens = max_tokens
        storage = next(s for s in module.kv_layers() if s is not None)  # [2, B, S, KV, D]
        self.s, self.device = storage.shape[2], storage.device
        self._buckets: dict = {}  # (rows, length, head) -> _Bucket
        self._uses: dict = {}  # (rows, length) -> calls so far, graphed or not
        self._warm: set = set()  # (rows, length) made by warm_up: no eager first call
        # eagerly padded on the CPU from the first call (the path tests hold); on a GPU a
        # bucket is captured at its CAPTURE_AT_USE-th call
        default = CAPTURE_AT_USE if self.capture else 1
        self.capture_at = default if capture_at is None else check_int("capture_at", capture_at, minimum=1)
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._side = torch.cuda.Stream(self.device) if self.capture else None
        self.captures = 0

    def bucket(self, rows: int, length: int) -> tuple[int, int] | None:
        """``(rows, length)`` of the bucket a call of that size runs in, or None (eager)."""
        return padded_bucket(rows, length, self.max_tokens)

    def run(self, tokens, idx, last, head: bool):
        """The fresh prefill forward of ``tokens`` in its bucket, on the current torch stream.

        Parameters
        ----------
        tokens : [R, P] int64 valid ids (every row at position 0)
        idx : [R] int64 batch rows
        last : [R] int64, each row's last prompt token (its logits' position)
        head : bool
            Compute the logits at ``last`` (else only the KV).

        Returns
        -------
        [R, V] float32 logits (a view into the bucket's output, valid until its next run),
        None without a head, or ``NotImplemented`` when the caller is to run the call
        eagerly and unpadded (past every bucket, or the bucket's first use unless
        :meth:`warm_up` made its size: then the other head's bucket is made at once too,
        as :meth:`plan` prices it).
        """
        r, p = tokens.shape
        size = self.bucket(r, p)
        b = None if size is None else self._use_bucket(size, head, lambda: self._new_bucket(size))
        if b is None:
            return NotImplemented
        b.tokens[:r, :p].copy_(tokens)  # columns past p keep earlier (valid) ids: padding, causal
        b.idx[:r].copy_(idx)
        b.start[:r].zero_()
        b.last[:r].copy_(last)
        self._pad(b, r)
        out = self._call(b, head)
        return None if out is None else out[:r, 0]

    def run_continued(self, tokens, idx, start, last, head: bool):
        """The prefill forward of one chunk per row at ``start``, behind the KV its earlier
        chunks cached, in a padded bucket (the same ladders as :meth:`run`, whatever this
        class packs: a continued call is padded), on the current torch stream.

        Parameters
        ----------
        tokens : [R, P] int64 valid ids, row r's chunk at positions ``start[r] + [0, P)``
        idx : [R] int64 batch rows
        start : [R] int32 or int64 device tensor, each row's cached KV rows (its chunk's first position)
        last : [R] int64, each row's last chunk token (its logits' position)
        head : bool
            Compute the logits at ``last`` (else only the KV).

        Returns
        -------
        As :meth:`run`: ``[R, V]`` float32 logits (a view, valid until the bucket's next run),
        None without a head, or ``NotImplemented`` for the caller's eager call (past every
        bucket, or the bucket's first use unless :meth:`warm_up` made its size).
        """
        r, p = tokens.shape
        size = padded_bucket(r, p, self.max_tokens)
        b = None if size is None else self._use_bucket(
            ("continued", *size), head, lambda: _Bucket(self.torch, *size, self.s, self.device, fresh=False))
        if b is None:
            return NotImplemented
        # Columns past p keep earlier ids: they write KV rows past each row's chunk (or clamp
        # to row S - 1), which no attention reads before a later chunk or burst rewrites them.
        b.tokens[:r, :p].copy_(tokens)
        b.idx[:r].copy_(idx)
        b.start[:r].copy_(start)
        b.last[:r].copy_(last)
        self._pad_rows(b, r)  # padded rows whatever the subclass's own buckets are
        out = self._call(b, head)
        return None if out is None else out[:r, 0]

    def _use_bucket(self, use: tuple, head: bool, make):
        """Count one call of the size ``use`` (``(rows, length)``, or a continued call's
        ``("continued", rows, length)``) and return its bucket with ``head``, made by ``make()``
        if need be; None while the call is to run eagerly (a size's first use, unless warmed)."""
        self._uses[use] = uses = self._uses.get(use, 0) + 1
        key = (*use, bool(head))
        b = self._buckets.get(key)
        if b is None:
            if uses < self.capture_at and use not in self._warm:
                return None
            b = self._buckets[key] = make()
        return b

    def _new_bucket(self, size: tuple[int, int]) -> _Bucket:
        return _Bucket(self.torch, *size, self.s, self.device)

    def warm_sizes(self, max_rows: int, max_length: int | None = None) -> list:
        """The buckets :meth:`warm_up` makes (:func:`warm_sizes`)."""
        return warm_sizes(max_rows, self.max_tokens, max_length)

    def _pad(self, b: _Bucket, r: int) -> None:
        """Rows ``r:`` of one of this class's own buckets become padding (:meth:`_pad_rows`)."""
        self._pad_rows(b, r)

    def _pad_rows(self, b: _Bucket, r: int) -> None:
        """Rows ``r:`` of a padded bucket become padding rows: they write only row S - 1 of slot 0."""
        if r < b.rows:
            b.start[r:].fill_(self.s)
            b.idx[r:].zero_()
            b.last[r:].zero_()

    def _call(self, b: _Bucket, head: bool):
        """``b``'s forward: eager without capture, else captured at its first call, then replayed."""
        if not self.capture:
            return self._forward(b, head)
        if b.graph is None:
            return self._capture(b, head)
        b.graph.replay()
        return b.out

    def warm_up(self, max_rows: int, head: bool, max_length: int | None = None, continued: bool = False) -> dict:
        """Make, before serving, every bucket of :func:`warm_sizes` (captured on a GPU), and with
        ``continued`` the one-row continued buckets of :func:`continued_warm_lengths`.

        Each warm-up call is padding rows only (position ``S``, slot 0), so every KV row it
        writes clamps to row ``S - 1`` of slot 0, which no attention reads: no cache
        content a slot can read changes. A warmed bucket's first real call then replays
        (no eager call, no capture at serving time), and :meth:`plan` prices it so. On a
        GPU it runs on the current torch stream and waits for the device at the end (at
        start-up, outside any capture).

        Parameters
        ----------
        max_rows : int
            Rows of the largest admission to warm (0: nothing).
        head : bool
            The head the caller's fresh prefills use (a target's final chunk: True; a draft: False).
        max_length : int, optional
            The longest call's tokens per row (the KV capacity, or a prefill chunk).
        continued : bool
            Prompts arrive in chunks of ``max_length`` (a serving loop's ``prefill_chunk``):
            also make the continued buckets a later chunk runs in, with both heads when
            ``head`` (a target's non-final chunks compute none), and then the one-row fresh
            buckets without a head too (a long prompt's first chunk).

        Returns
        -------
        dict: ``buckets`` (made now), ``seconds`` (host time, device work included), and
        ``device_bytes`` (GPU memory it keeps, from ``cudaMemGetInfo``, after the blocks its
        real forwards left cached are released; None on the CPU).
        """
        torch, key_head = self.torch, bool(head)
        sizes = self.warm_sizes(max_rows, max_length)
        t0 = time.perf_counter()
        free = None
        if self.capture:  # measured from an empty cache, so device_bytes is what warm-up keeps
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(self.device)[0]
        # (bucket key, size marked warm, head, a new bucket of it, its padding): fresh ones, then continued
        jobs = [((*size, key_head), size, key_head, lambda size=size: self._new_bucket(size), self._pad)
                for size in sizes]
        if continued and max_rows:
            if key_head:  # a long prompt's first chunk: fresh, one row, and no head (it is not the last)
                jobs += [((*size, False), size, False, lambda size=size: self._new_bucket(size), self._pad)
                         for size in sizes if size[0] == 1]
            jobs += [(("continued", 1, p, h), ("continued", 1, p), h,
                      lambda p=p: _Bucket(torch, 1, p, self.s, self.device, fresh=False), self._pad_rows)
                     for p in continued_warm_lengths(max_length, self.max_tokens) for h in sorted({key_head, False})]
        made = 0
        with torch.no_grad():
            for key, warm, h, new_bucket, pad in jobs:
                b = self._buckets.get(key)
                if b is not None and (b.graph is not None or not self.capture):
                    self._warm.add(warm)
                    continue  # made by an earlier call already
                if b is None:
                    b = self._buckets[key] = new_bucket()
                pad(b, 0)  # padding rows only
                self._call(b, h)
                self._warm.add(warm)
                made += 1
        used = None
        if self.capture:
            torch.cuda.synchronize(self.device)
            # Each capture's real forward ran on the side stream, and the caching allocator keeps
            # those blocks for that stream alone: no prefill on the decoder's stream could reuse
            # them (on the 1b shape, 0.76 GB beside the graphs' 0.74 GB pool). Give them back,
            # so what warm-up holds is the graphs' pool, the figure --capacity auto reserves.
            torch.cuda.empty_cache()
            used = free - torch.cuda.mem_get_info(self.device)[0]
        return {"buckets": made, "seconds": time.perf_counter() - t0, "device_bytes": used}

    def _forward(self, b: _Bucket, head: bool):
        # KV rows before the call: 0 on a fresh call's real rows, the chunk's start on a continued one's
        lengths = [b.start if has_kv else None for has_kv in self.kv_layers]
        if not head:
            return self.module(b.tokens, b.start, lengths, b.idx, head=False, fresh=b.fresh)
        return self.module(b.tokens, b.start, lengths, b.idx, logits_at=b.last, fresh=b.fresh)

    def _capture(self, b: _Bucket, head: bool):
        """Run ``b``'s forward for real on the side stream, then capture it there; ordered by
        events only. Returns the real forward's output."""
        torch = self.torch
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)  # the inputs just copied in, and every write before
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._side):
            # the real call, and the capture's warm-up: lazy first-call work (kernel loading,
            # library handles for this stream) happens here, outside the capture
            real = self._forward(b, head)
            with COLLECTOR_PAUSE:
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    out = self._forward(b, head)
                    graph.capture_end()
                except Exception:
                    end_capture_quietly(graph, self.device)
                    raise
        main.wait_stream(self._side)
        if real is not None:
            real.record_stream(main)  # made on the side stream, read on the decoder's
        b.graph, b.out = graph, out
        self.captures += 1
        return real

    def plan(self, lengths: dict) -> list[list[int]]:
        """Split one fresh admission (slot -> prompt length) into calls of like length.

        Rows sorted longest first are cut into runs that minimise the padded tokens of
        their buckets plus :data:`CALL_COST_TOKENS` per call and
        :data:`EAGER_CALL_COST_TOKENS` per call that would run eagerly (an O(n^2) dynamic
        program over at most a batch of rows): one long prompt among short ones no longer
        pads them all to its length, rows of like length stay in one call, and sizes
        never seen are not split into several eager calls. A split that avoided the whole
        admission's bucket only for its eager first use counts as that use
        (:meth:`_note_avoided`).
        """
        items = sorted(lengths.items(), key=lambda kv: (-kv[1], kv[0]))
        n = len(items)
        best, cut = [0] + [float("inf")] * n, [0] * (n + 1)
        for j in range(1, n + 1):
            for i in range(j):  # the run items[i:j], whose longest is items[i]
                best_i = best[i] + self._call_cost(j - i, items[i][1])
                if best_i < best[j]:
                    best[j], cut[j] = best_i, i
        groups, j = [], n
        while j:
            groups.append(sorted(slot for slot, _ in items[cut[j]: j]))
            j = cut[j]
        if len(groups) > 1 and n:
            self._note_avoided(n, items[0][1])
        return groups[::-1]

    def _note_avoided(self, rows: int, length: int) -> None:
        """The admission was split though one call would have served it: if its bucket was
        passed over only for its eager first use, count this as that use. Otherwise a size
        that smaller captured buckets can cover is never used, so never captured, and is split
        at every admission (four calls of 1 x 128 for 4 x 128, at twice the GPU time); counted,
        its next admission captures it at once (no eager call)."""
        size = self.bucket(rows, length)
        if size is not None and size not in self._warm and self._uses.get(size, 0) + 1 < self.capture_at:
            self._uses[size] = self._uses.get(size, 0) + 1

    def _call_cost(self, rows: int, length: int) -> int:
        """A call's cost in padded tokens for :meth:`plan`; an eager one (a bucket's first
        use, or past every bucket; never a warmed one) also pays for its launches."""
        size = self.bucket(rows, length)
        if size is None:
            return CALL_COST_TOKENS + EAGER_CALL_COST_TOKENS + rows * length
        eager = size not in self._warm and self._uses.get(size, 0) + 1 < self.capture_at
        return CALL_COST_TOKENS + EAGER_CALL_COST_TOKENS * eager + size[0] * size[1]

    def info(self) -> dict:
        """Buckets made so far, as ``{(rows, length, head): captured}``."""
        return {k: b.graph is not None for k, b in self._buckets.items()}
