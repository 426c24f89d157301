"""The folded decode kernels compile for the H200 (sm_90) on a machine without a GPU.

Triton's interpreter (``decode_interp.py``) checks what the kernels compute, but not that the
compiler takes them: a construct the interpreter runs and the compiler refuses would only show
on a GPU. Here each kernel variant the folded forward launches is compiled ahead of time through
Triton's NVIDIA backend, down to the GPU binary: its PTX carries the grid-dependency instructions
exactly when it is built for programmatic dependent launch, and (read with the ``cuobjdump`` that
Triton ships) no thread spills registers to its stack at the tiling the launcher picks.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

#: the H200's target: compute capability 9.0, 32-thread warps
H200 = GPUTarget("cuda", 90, 32)
PDL_INSTRUCTIONS = ("griddepcontrol.wait", "griddepcontrol.launch_dependents")


@pytest.fixture(scope="module")
def folded():
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("Triton has no NVIDIA backend here")
    from graphburst.models.decode import folded, launch

    if launch.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1: the kernels are the interpreter's, not the compiler's")
    return folded


#: the resource dump tool Triton ships beside its ptxas (absent: no spill check)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_for_h200(fn, types: dict, constexprs: dict, pdl: bool, aligned=(), num_warps: int = 4):
    """``fn`` compiled for the H200: ``types`` maps every runtime argument to its Triton type, the rest are
    ``constexprs``. Every pointer, and each int in ``aligned``, is specialised as divisible by 16, as a launch
    specialises them: torch's buffers are 16-byte aligned and the model shapes' widths and strides are
    multiples of 16 (the loads are then vectorised, which changes the registers a thread needs). Returns the
    compiled kernel (its ``asm`` holds the PTX and the GPU binary)."""
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    assert set(signature) - set(types) == set(constexprs), "every argument is typed or a constexpr"
    divisible = [name for name, t in types.items() if t.startswith("*")] + list(aligned)
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    # FP fusion on, as the kernels' launches have it (Triton's default, said here so it need not warn)
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=H200,
                          options=dict(num_warps=num_warps, num_stages=3, launch_pdl=pdl, enable_fp_fusion=True))


def stack_bytes(kernel) -> int | None:
    """Bytes of stack a thread of ``kernel`` uses (register spills), from the GPU binary; None without the tool."""
    if not os.path.exists(CUOBJDUMP):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"STACK:(\d+)", out).group(1))


#: (PROLOGUE, D_SPLITS, SPLIT_K, DOT): norm with no delta (the first layer), norm after a split projection's
#: partials (3: SmolLM2's o_proj; 8: the 1b's down_proj) and after a whole delta, SiLU over partials and over
#: a whole gate/up, the plain projection (o_proj), o_proj combining 16 (one row) and 4 attention splits; the
#: multiply-accumulate path (one row) and tl.dot's
GEMV_VARIANTS = [("NORM", "NO_DELTA", 1, False), ("NORM", "NO_DELTA", 3, True), ("NORM", 3, 3, True),
                 ("NORM", 8, 1, True), ("NORM", 8, 1, False), ("NORM", "WHOLE", 1, True), ("SILU", 3, 1, False),
                 ("SILU", 3, 1, True), ("SILU", "WHOLE", 2, True), ("PLAIN", "NO_DELTA", 3, True),
                 ("PLAIN", "NO_DELTA", 1, False), ("COMBINE", 16, 3, False), ("COMBINE", 4, 1, True)]


@pytest.mark.parametrize("prologue, d_splits, split_k, dot, pdl", [v + (True,) for v in GEMV_VARIANTS] +
                         [GEMV_VARIANTS[2] + (False,), GEMV_VARIANTS[6] + (False,)])
def test_the_folded_gemv_compiles_for_sm90_without_spilling(folded, prologue, d_splits, split_k, dot, pdl):
    """At CONFIGS' tiling of the 1b and 8b shapes (32 W rows, 256 K, 4 warps) and the K tile the launcher
    picks for the prologue (``prologue_block_k``); every variant with PDL, two without it."""
    from graphburst.models.decode.gemv import GemvConfig

    d_splits = getattr(folded, d_splits) if isinstance(d_splits, str) else d_splits
    partials = d_splits not in (folded.NO_DELTA, folded.WHOLE) and prologue != "COMBINE"
    config = GemvConfig(32, 256, 4, split_k)
    block_m = 16 if dot else 1
    block_k = folded.prologue_block_k(getattr(folded, prologue), d_splits, block_m, config)
    types = {name: "*bf16" for name in ("x_ptr", "db_ptr", "nw_ptr", "res_ptr", "w_ptr", "b_ptr", "y_ptr")}
    ints = ("M", "N", "K", "sx_m", "sd_m", "sw_n", "sy_m", "k_per_split", "T_att", "s_rows")
    types.update(d_ptr="*fp32" if partials or prologue == "COMBINE" else "*bf16", part_ptr="*fp32", eps="fp32",
                 lse_ptr="*fp32", len_ptr="*i32", **{name: "i32" for name in ints})
    constexprs = dict(PROLOGUE=getattr(folded, prologue), D_SPLITS=d_splits, D_BIAS=partials, HD=64, A_BLOCK=64,
                      BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                      EVEN_K=split_k != 2, HAS_BIAS=prologue == "NORM", DOT=dot, DOT_F32=False, PREC="tf32", PDL=pdl)
    aligned = ("N", "K", "sx_m", "sd_m", "sw_n", "sy_m", "k_per_split", "s_rows")
    kernel = compile_for_h200(folded._folded_gemv, types, constexprs, pdl, aligned, config.num_warps)
    assert all((instr in kernel.asm["ptx"]) == pdl for instr in PDL_INSTRUCTIONS)
    assert stack_bytes(kernel) in (0, None), f"spills {stack_bytes(kernel)} bytes a thread at BLOCK_K {block_k}"


def test_the_prologue_k_tile_shrinks_with_what_it_holds(folded):
    """The multiply-accumulate path and the plain prologue keep the GEMV's K tile; the tl.dot path's norm
    and SiLU halve it as their partials grow, SiLU (gate and up) sooner, never below tl.dot's 16."""
    from graphburst.models.decode.gemv import GemvConfig

    cfg = GemvConfig(32, 256, 4, 1)
    tile = lambda prologue, splits, rows=16: folded.prologue_block_k(prologue, splits, rows, cfg)  # noqa: E731
    assert tile(folded.PLAIN, folded.NO_DELTA) == tile(folded.NORM, 8, rows=1) == 256
    assert tile(folded.NORM, folded.NO_DELTA) == tile(folded.NORM, folded.WHOLE) == tile(folded.SILU, 0) == 256
    assert (tile(folded.NORM, 3), tile(folded.SILU, 2), tile(folded.SILU, 3), tile(folded.COMBINE, 4)) == \
        (128, 128, 64, 64)
    assert (tile(folded.NORM, 8), tile(folded.COMBINE, 16), tile(folded.NORM, 64)) == (32, 16, 16)


@pytest.mark.parametrize("splits", [0, 3])
@pytest.mark.parametrize("pdl", [False, True])
def test_the_folded_rope_kv_write_compiles_for_sm90(folded, splits, pdl):
    """SmolLM2's heads (9 q, 3 KV, head_dim 64), from a whole qkv and from partials with a bias."""
    types = dict(p_ptr="*fp32" if splits else "*bf16", pb_ptr="*bf16", q_ptr="*bf16", cos_ptr="*fp32",
                 sin_ptr="*fp32", pos_ptr="*i32", len_ptr="*i32", kv_ptr="*bf16",
                 **{name: "i32" for name in ("skv_2", "skv_b", "skv_s", "skv_h", "s_rows", "n_pos", "T", "R", "sp_m")})
    constexprs = dict(SPLITS=splits, HAS_BIAS=splits > 0, H=9, KVH=3, D=64, BLOCK_H=16, PDL=pdl)
    kernel = compile_for_h200(folded._rope_kv_write, types, constexprs, pdl, ("skv_2", "skv_b", "skv_s", "skv_h"))
    assert all((instr in kernel.asm["ptx"]) == pdl for instr in PDL_INSTRUCTIONS)
    assert stack_bytes(kernel) in (0, None)


@pytest.mark.parametrize("pdl", [False, True])
def test_the_unfolded_rope_kv_write_compiles_for_sm90(folded, pdl):
    """``fused._rope_kv_write`` shares its rotation and placement with the folded one (``fused.rope_place``)."""
    from graphburst.models.decode import fused

    types = dict(qkv_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i32", len_ptr="*i32", kv_ptr="*bf16",
                 **{name: "i32" for name in ("skv_2", "skv_b", "skv_s", "skv_h", "s_rows", "n_pos", "T")})
    constexprs = dict(H=9, KVH=3, D=64, BLOCK_H=16, PDL=pdl)
    kernel = compile_for_h200(fused._rope_kv_write, types, constexprs, pdl, ("skv_2", "skv_b", "skv_s", "skv_h"))
    assert all((instr in kernel.asm["ptx"]) == pdl for instr in PDL_INSTRUCTIONS)
    assert stack_bytes(kernel) in (0, None)
