"""A weight-streaming skinny GEMM for decode: ``y[M, N] = x[M, K] @ W[N, K]^T (+ bias)`` at M <= 16.

At decode shapes (M = B * T rows, 1 to 16) a projection is a read of its weight and
little else: the 1b's GEMMs and head at B = 1 are 2.4 GB, 518 µs at 4.8 TB/s, and
cuBLAS took 776 µs for them on the H200 (docs/benchmarks.md, "The decode forward against
the bytes floor"). Here the weight is streamed once, split over programs by output columns N:

* program ``(n, s, m)`` owns ``BLOCK_N`` rows of W and the ``s``-th of ``split_k`` equal
  runs of whole ``BLOCK_K`` tiles along K; it loads each ``[BLOCK_N, BLOCK_K]`` tile of
  W (K contiguous: wide vector loads) once and accumulates, in fp32, every x row of its
  ``BLOCK_M`` tile against it (``tl.dot`` with ``BLOCK_M = 16``; a plain
  multiply-accumulate when M = 1, which wastes no tensor-core rows);
* ``split_k > 1`` (for narrow outputs like the 1b's o_proj, N = K = 2048, whose
  ``N / BLOCK_N`` programs alone cannot keep 132 SMs streaming) writes fp32 partial sums
  ``[split_k, M, N]`` and a second launch, :func:`_split_k_sum`, adds them in split
  order (no atomics: the same bits on every run), adds the bias and rounds once.

Tile sizes come per weight shape from :data:`CONFIGS` (``(next_pow2(N), next_pow2(K))``
buckets, set from ``tools/gemv_bench.py``'s H200 sweep), else :func:`default_config`.
Offsets are int64 (a row index times K passes 2^31 for heads of 256k x 8192).
:func:`graphburst.models.decode.reference.linear_ref` is the plain-torch reference.

Each program loads its first W tile before anything else, then accumulates it against x:
with ``pdl=True`` (programmatic dependent launch, ``decode/launch.py``) that load comes
before the wait on the previous kernel, so the weight stream starts while the norm or
SiLU before the projection finishes. The tile order and the accumulation are the same
with and without PDL, so both give the same bits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import INTERPRETED, launch_options, pdl_on, pdl_wait

#: the rows the kernel is built for: one ``tl.dot`` row tile (more rows take more m tiles, each
#: streaming W again, where cuBLAS's tiled GEMM is the better tool)
MAX_M = 16
#: ``tl.dot`` needs 16 rows on the GPU; fewer rows are masked loads (zeros) in the same tile
DOT_BLOCK_M = 16
#: M up to which the multiply-accumulate path runs instead of ``tl.dot`` (it keeps a
#: ``[BLOCK_N, BLOCK_K]`` fp32 accumulator per x row, so only one row)
FMA_MAX_M = 1
#: output columns per program of the split-K sum
SUM_BLOCK = 1024
#: programs the default split-K aims for per SM (two per SM keeps every SM's loads in flight)
PROGRAMS_PER_SM = 2
#: the most K splits (the sum pass reads this many partials per output)
MAX_SPLIT_K = 16
# Under the interpreter (``launch.INTERPRETED``) the bf16 ``tl.dot`` operands are widened to fp32 first.


class GemvConfig(NamedTuple):
    """One launch's tiling (see the module docstring)."""

    block_n: int  # W rows (output columns) per program, a power of two >= 16
    block_k: int  # K per tile, a power of two >= 16 (elements: 256 bf16 = 512 bytes per row per tile)
    num_warps: int
    split_k: int  # programs along K; 1: no sum pass
    num_stages: int = 3  # tiles in flight per program (Triton's software pipelining)


#: Chosen tilings per ``(next_pow2(N), next_pow2(K))`` for the 1b and 8b shapes (bf16, H200, 132 SMs).
#: Starting points from the reasoning in the module docstring (>= 2 programs per SM, 512-byte rows
#: per tile); a maintainer replaces them with ``tools/gemv_bench.py``'s best per shape. Other shapes
#: take :func:`default_config`.
CONFIGS: dict[tuple[int, int], GemvConfig] = {
    # 1b: hidden 2048, qkv 2048 + 2 x 512, gate_up 2 x 8192, vocab 128256
    (4096, 2048): GemvConfig(32, 256, 4, 3),  # qkv: 96 column programs x 3
    (2048, 2048): GemvConfig(32, 256, 4, 4),  # o_proj: 64 x 4
    (16384, 2048): GemvConfig(32, 256, 4, 1),  # gate_up: 512
    (2048, 8192): GemvConfig(32, 256, 4, 8),  # down: 64 x 8
    (131072, 2048): GemvConfig(32, 256, 4, 1),  # head: 4008
    # 8b: hidden 4096, qkv 4096 + 2 x 1024, gate_up 2 x 14336, vocab 128256
    (8192, 4096): GemvConfig(32, 256, 4, 2),  # qkv: 192 x 2
    (4096, 4096): GemvConfig(32, 256, 4, 3),  # o_proj: 128 x 3
    (32768, 4096): GemvConfig(32, 256, 4, 1),  # gate_up: 896
    (4096, 16384): GemvConfig(32, 256, 4, 4),  # down: 128 x 4
    (131072, 4096): GemvConfig(32, 256, 4, 1),  # head: 4008
}


def default_config(n: int, k: int, sms: int) -> GemvConfig:
    """A tiling for a shape not in :data:`CONFIGS`: 32 W rows x 256 K per tile, split along K until
    ``PROGRAMS_PER_SM * sms`` programs stream (each split keeping at least one whole tile)."""
    block_n, block_k = 32, 256
    cols = triton.cdiv(n, block_n)
    split = min(MAX_SPLIT_K, triton.cdiv(k, block_k), max(1, triton.cdiv(PROGRAMS_PER_SM * sms, cols)))
    return GemvConfig(block_n, block_k, 4, split)


def pick_config(n: int, k: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> GemvConfig:
    """:data:`CONFIGS`'s entry for the shape's bucket, else :func:`default_config` for the device's SMs.

    The tilings are sized for bf16: a 4-byte dtype takes half the K per tile (the same bytes, so
    the pipeline's shared memory still fits).
    """
    cfg = CONFIGS.get((triton.next_power_of_2(n), triton.next_power_of_2(k)))
    if cfg is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        cfg = default_config(n, k, sms)
    if dtype.itemsize == 4 and cfg.block_k > 16:
        cfg = cfg._replace(block_k=cfg.block_k // 2)
    return cfg


@triton.jit
def _tile(rows, ks, row_ok, k_hi, EVEN_K: tl.constexpr):
    """The ``[rows, BLOCK_K]`` tile at K offsets ``ks`` of a row-major operand (W or x); zeros past its rows
    and, unless every tile is whole, past ``k_hi``."""
    if EVEN_K:  # every tile whole: no K mask, so the loads stay full-width vectors
        tile = tl.load(rows + ks[None, :], mask=row_ok[:, None], other=0.0)
    else:
        tile = tl.load(rows + ks[None, :], mask=row_ok[:, None] & (ks < k_hi)[None, :], other=0.0)
    return tile


@triton.jit
def _accumulate(acc, x, w, DOT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """One K tile into the accumulator: ``[BLOCK_M, BLOCK_N]`` through ``tl.dot``, or (M = 1) the
    ``[BLOCK_N, BLOCK_K]`` products, summed over K once after the loop."""
    if DOT:
        if DOT_F32:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=PREC)
    else:
        acc += w.to(tl.float32) * x.to(tl.float32)  # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]
    return acc


@triton.jit
def _gemv(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N, K, sx_m, sw_n, sy_m, k_per_split,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
          EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr, DOT_F32: tl.constexpr,
          PREC: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n[:, None] * sw_n  # [BLOCK_N, 1]
    x_rows = x_ptr + offs_m[:, None] * sx_m  # [BLOCK_M, 1]
    k_lo = split * k_per_split  # k_per_split: whole tiles, so a split's tiles never straddle another's
    k_hi = tl.minimum(k_lo + k_per_split, K)  # > k_lo: the launcher runs no split past K
    # The first W tile, peeled off the loop: a weight, which no kernel writes, so it is loaded before the
    # PDL wait and the stream starts while the previous kernel finishes; the loop then takes tiles 1...
    w = _tile(w_rows, k_lo + offs_k, n_ok, k_hi, EVEN_K)  # [BLOCK_N, BLOCK_K]
    pdl_wait(PDL)  # x is the previous kernel's output; every store comes after
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # M = 1: products summed over K once, after the loop
    acc = _accumulate(acc, _tile(x_rows, k_lo + offs_k, m_ok, k_hi, EVEN_K), w, DOT, DOT_F32, PREC)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        ks = k0 + offs_k
        acc = _accumulate(acc, _tile(x_rows, ks, m_ok, k_hi, EVEN_K), _tile(w_rows, ks, n_ok, k_hi, EVEN_K), DOT,
                          DOT_F32, PREC)
    if not DOT:
        acc = tl.sum(acc, 1)[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * sy_m + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + (split * M + offs_m)[:, None] * N + offs_n[None, :], acc, mask=ok)


@triton.jit
def _split_k_sum(part_ptr, b_ptr, y_ptr, M, N, sy_m, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK: tl.constexpr, PDL: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    pdl_wait(PDL)  # the partials are the GEMV's output
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):  # split order: the same bits on every run
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * sy_m + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         config: GemvConfig | None = None, fma: bool | None = None, pdl: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias``, streaming ``weight`` once (fp32 accumulation, one rounding to x's dtype).

    Parameters
    ----------
    x : [M, K] float32 or bfloat16, last dim contiguous; built for M <= :data:`MAX_M` (more rows work,
        each 16-row tile streaming W again)
    weight : [N, K] x's dtype, last dim contiguous (an ``nn.Linear`` weight)
    bias : [N] x's dtype, optional
    out : [M, N] x's dtype, optional, last dim contiguous (a view into a larger buffer is fine: nothing
        outside it is written)
    config : GemvConfig, optional
        The tiling; default :func:`pick_config` (the benchmark passes its candidates here).
    fma : bool, optional
        The multiply-accumulate path instead of ``tl.dot``; default ``M <= FMA_MAX_M`` (needs M == 1).
    pdl : bool
        Programmatic dependent launch of both kernels (``decode/launch.py``; off under the interpreter):
        the first W tile is loaded before the wait. The same bits as without.

    Returns
    -------
    out : [M, N]

    grid ``(cdiv(N, block_n), split_k, cdiv(M, BLOCK_M))``, ``config.num_warps`` warps; with
    ``split_k > 1`` a second launch, grid ``(M, cdiv(N, SUM_BLOCK))``, 4 warps, sums the partials.
    """
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1 and weight.dtype == x.dtype, \
        "shapes checked by the model"
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1
    cfg = config or pick_config(n, k, x.device, x.dtype)
    fma = m <= FMA_MAX_M if fma is None else fma
    assert not fma or m == 1, "the multiply-accumulate path keeps one x row"
    block_m = 1 if fma else DOT_BLOCK_M
    tiles = triton.cdiv(k, cfg.block_k)
    split_k = max(1, min(cfg.split_k, tiles))
    k_per_split = triton.cdiv(tiles, split_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)  # no split past K (its partial would be all zeros)
    part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    has_bias = bias is not None
    pdl = pdl_on(pdl)
    grid = (triton.cdiv(n, cfg.block_n), split_k, triton.cdiv(m, block_m))
    _gemv[grid](x, weight, bias if has_bias else x, out, part, m, n, k, x.stride(0), weight.stride(0),
                out.stride(0), k_per_split, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                SPLIT_K=split_k, EVEN_K=k % cfg.block_k == 0, HAS_BIAS=has_bias, DOT=not fma,
                DOT_F32=INTERPRETED and x.dtype != torch.float32,
                PREC="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, **launch_options(pdl))
    if split_k > 1:
        grid = (m, triton.cdiv(n, SUM_BLOCK))
        _split_k_sum[grid](part, bias if has_bias else x, out, m, n, out.stride(0), SPLIT_K=split_k,
                           HAS_BIAS=has_bias, BLOCK=SUM_BLOCK, PDL=pdl, num_warps=4, **launch_options(pdl))
    return out
