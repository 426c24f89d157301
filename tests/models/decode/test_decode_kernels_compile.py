"""The folded decode kernels compile for the H200 (sm_90) on a machine without a GPU.

Triton's interpreter (``decode_interp.py``) checks what the kernels compute, but not that the
compiler takes them: a construct the interpreter runs and the compiler refuses would only show
on a GPU. Here each kernel variant the folded forward launches is compiled ahead of time through
Triton's NVIDIA backend, down to the GPU binary, and its PTX carries the grid-dependency
instructions exactly when it is built for programmatic dependent launch.
"""

from __future__ import annotations

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


def compile_ptx(fn, types: dict, constexprs: dict, pdl: bool) -> str:
    """PTX of ``fn`` for the H200: ``types`` maps every runtime argument to its Triton type, the rest are
    ``constexprs``."""
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    assert set(signature) - set(types) == set(constexprs), "every argument is typed or a constexpr"
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=H200,
                            options=dict(num_warps=4, num_stages=3, launch_pdl=pdl))
    return kernel.asm["ptx"]


#: (PROLOGUE, D_SPLITS, SPLIT_K, DOT): norm with no delta (the first layer, M = 1), norm after partials (3 splits)
#: and after a whole delta, SiLU over partials and over a whole gate/up, the plain projection (o_proj)
GEMV_VARIANTS = [("NORM", "NO_DELTA", 1, False), ("NORM", 3, 3, True), ("NORM", "WHOLE", 1, True),
                 ("SILU", 2, 1, False), ("SILU", "WHOLE", 2, True), ("PLAIN", "NO_DELTA", 3, True)]


@pytest.mark.parametrize("prologue, d_splits, split_k, dot", GEMV_VARIANTS)
@pytest.mark.parametrize("pdl", [False, True])
def test_the_folded_gemv_compiles_for_sm90(folded, prologue, d_splits, split_k, dot, pdl):
    d_splits = getattr(folded, d_splits) if isinstance(d_splits, str) else d_splits
    partials = d_splits not in (folded.NO_DELTA, folded.WHOLE)
    types = {name: "*bf16" for name in ("x_ptr", "db_ptr", "nw_ptr", "res_ptr", "w_ptr", "b_ptr", "y_ptr")}
    types.update(d_ptr="*fp32" if partials else "*bf16", part_ptr="*fp32", eps="fp32",
                 **{name: "i32" for name in ("M", "N", "K", "sx_m", "sd_m", "sw_n", "sy_m", "k_per_split")})
    constexprs = dict(PROLOGUE=getattr(folded, prologue), D_SPLITS=d_splits, D_BIAS=partials,
                      BLOCK_M=16 if dot else 1, BLOCK_N=32, BLOCK_K=256, SPLIT_K=split_k, EVEN_K=split_k != 2,
                      HAS_BIAS=prologue == "NORM", DOT=dot, DOT_F32=False, PREC="tf32", PDL=pdl)
    ptx = compile_ptx(folded._folded_gemv, types, constexprs, pdl)
    assert all((instr in ptx) == pdl for instr in PDL_INSTRUCTIONS)


@pytest.mark.parametrize("splits", [0, 3])
@pytest.mark.parametrize("pdl", [False, True])
def test_the_folded_rope_kv_write_compiles_for_sm90(folded, splits, pdl):
    """SmolLM2's heads (9 q, 3 KV, head_dim 64), from a whole qkv and from partials with a bias."""
    types = dict(p_ptr="*fp32" if splits else "*bf16", pb_ptr="*bf16", q_ptr="*bf16", cos_ptr="*fp32",
                 sin_ptr="*fp32", pos_ptr="*i32", len_ptr="*i32", kv_ptr="*bf16",
                 **{name: "i32" for name in ("skv_2", "skv_b", "skv_s", "skv_h", "s_rows", "n_pos", "T", "R", "sp_m")})
    constexprs = dict(SPLITS=splits, HAS_BIAS=splits > 0, H=9, KVH=3, D=64, BLOCK_H=16, PDL=pdl)
    ptx = compile_ptx(folded._rope_kv_write, types, constexprs, pdl)
    assert all((instr in ptx) == pdl for instr in PDL_INSTRUCTIONS)
