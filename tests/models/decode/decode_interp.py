"""Runs the decode kernels' checks under Triton's CPU interpreter (``tests/models/decode/test_decode_kernels.py`` starts it).

``TRITON_INTERPRET=1`` must be set before ``triton.jit`` decorates the kernels, so this
runs in its own process: ``python tests/models/decode/decode_interp.py GROUP`` with GROUP one of
``attention``, ``idle``, ``int64``, ``gemv``, ``fused``, ``model``, ``pdl-kernels``, ``pdl-model``, ``folded``,
``folded-model``. Exit status 0
and ``ok N`` on success.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # decode_cases
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # graphburst

import torch  # noqa: E402

import decode_cases as dc  # noqa: E402


#: the PDL chains at interpreter sizes (the GPU runs larger ones): norms (R, N, dtype), SiLU (R, F, dtype,
#: steps), GEMVs (M, K, dtype, bias, config, fma: split-K 2 and 1, the multiply-accumulate path), attention
#: as CI_ATTENTION's cases (split and not)
PDL_NORM = [(3, 96, torch.float32), (7, 64, torch.bfloat16)]
PDL_SILU = [(3, 200, torch.bfloat16, 3)]
PDL_GEMV = [(1, 96, torch.float32, True, None, None), (3, 96, torch.bfloat16, False, (16, 32, 4, 2), None),
            (5, 64, torch.float32, False, (16, 32, 4, 1), False)]
PDL_ATTENTION = [(3, 2, 1, 3, 64, torch.float32, 2), (1, 1, 1, 1, 64, torch.bfloat16, 1)]


def check_pdl_kernels() -> int:
    """The PDL chains' wiring where PDL itself cannot run (the interpreter launches the kernels without it):
    every kernel's ``pdl=True`` chain against its ``pdl=False`` one."""
    from graphburst.models.decode import attention, fused, gemv, launch

    assert not launch.pdl_on(True), "the interpreter cannot run the gdc ops"
    for i, case in enumerate(PDL_NORM):
        dc.check_pdl_same(dc.chain_add_rmsnorm, fused.add_rmsnorm, case, "cpu", seed=i)
    for i, case in enumerate(PDL_SILU):
        dc.check_pdl_same(dc.chain_silu_mul, fused.silu_mul, case, "cpu", seed=i)
    for i, case in enumerate(PDL_GEMV):
        dc.check_pdl_same(dc.chain_gemv, gemv.gemv, case, "cpu", seed=i)
    for i, case in enumerate(PDL_ATTENTION):
        dc.check_pdl_same(dc.chain_rope_attention, fused.rope_kv_write, attention.decode_attention, case, "cpu",
                          seed=i)
    return len(PDL_NORM) + len(PDL_SILU) + len(PDL_GEMV) + len(PDL_ATTENTION)


def check_pdl_model() -> int:
    """``decode_kernels="gemv"`` and ``"pdl"`` forwards against SDPA on awkward shapes: B = 1 and 3, T = 1
    and 5, GQA groups 1 and 3 (M = 1 to 15: the multiply-accumulate GEMV and tl.dot's), fp32 and bf16."""
    dc.check_model("gemv", "cpu", torch.float32, batch=1, heads=3, kv_heads=3)  # group 1, M = 1 and 5
    dc.check_model("pdl", "cpu", torch.float32, batch=3, heads=6, kv_heads=2)  # group 3, M = 3 and 15
    dc.check_model("pdl", "cpu", torch.bfloat16, batch=1, ts=(5,), heads=6, kv_heads=2)
    dc.check_pdl_model("cpu", torch.float32, batch=1, ts=(5,), heads=6, kv_heads=2)
    return 4


def check_folded_kernels() -> int:
    """The folded kernels (``decode/folded.py``) against their references on awkward sizes, and the folded
    MLP chain launched with ``pdl=True`` against ``pdl=False`` (the interpreter runs both without it)."""
    from graphburst.models.decode import folded

    for i, case in enumerate(dc.CI_NORM_LINEAR):
        dc.check_norm_linear(folded, case, "cpu", seed=i)
    for i, case in enumerate(dc.CI_SILU_LINEAR):
        dc.check_silu_linear(folded, case, "cpu", seed=i)
    for i, case in enumerate(dc.CI_FOLDED_ROPE):
        dc.check_folded_rope(folded, case, "cpu", seed=i)
    from graphburst.models.decode import attention

    for i, case in enumerate(dc.CI_COMBINE):
        dc.check_combine_linear(folded, attention, case, "cpu", seed=i)
    dc.check_pdl_same(dc.chain_folded, folded, (3, 96, 80, torch.float32, (16, 32, 4, 2), (16, 32, 4, 3)), "cpu")
    return len(dc.CI_NORM_LINEAR) + len(dc.CI_SILU_LINEAR) + len(dc.CI_FOLDED_ROPE) + len(dc.CI_COMBINE) + 1


def check_folded_model() -> int:
    """``Llama(decode_kernels=...)``'s Triton choices build their ops on the CPU here; ``"folded"`` forwards
    against SDPA: by default (one row folds) B = 1 at T = 1 and 5, GQA group 1; folding the row tile (16
    rows, the ``tl.dot`` prologues) B = 3 at T = 1 and 5 and B = 1 at T = 5, GQA group 3, Qwen2's biases with
    Qwen3's q/k norms, and bf16; B = 4 at T = 5 (M = 20) takes the unfolded fallback. (Its wiring at T = MAX_K + 1 is checked on
    the references, without the interpreter.)"""
    from graphburst.models import llama_decode
    from graphburst.models.decode import gemv

    for choice, want in (("gemv", (False, gemv.MAX_M)), ("pdl", (True, gemv.MAX_M)),
                         ("folded", (True, gemv.FMA_MAX_M))):
        ops = dc.model_pair((choice,), "cpu")[0].decode_ops  # under the interpreter the CPU builds them
        assert isinstance(ops, llama_decode.FoldedOps) == (choice == "folded")
        assert (ops.pdl, ops.max_m if choice == "folded" else ops.gemv_max_m) == want, (choice, ops)
    tile = llama_decode.folded_ops(max_m=gemv.MAX_M)
    dc.check_model("folded", "cpu", torch.float32, batch=1, heads=3, kv_heads=3)  # group 1, M = 1 folds, 5 not
    dc.check_model("folded", "cpu", torch.float32, batch=3, heads=6, kv_heads=2, ops=tile)  # group 3, M = 3, 15
    dc.check_model("folded", "cpu", torch.float32, batch=4, ts=(5,), heads=6, kv_heads=2, ops=tile)  # M = 20
    dc.check_model("folded", "cpu", torch.float32, ts=(5,), ops=tile, qk_norm=True, qkv_bias=True)
    dc.check_model("folded", "cpu", torch.bfloat16, batch=1, ts=(5,), heads=6, kv_heads=2, ops=tile)
    return 5


def main(group: str) -> int:
    torch.set_num_threads(1)
    from graphburst.models.decode import attention, fused

    assert attention.INTERPRETED, "TRITON_INTERPRET was not seen by the kernels"
    n = 0
    if group == "attention":
        for i, case in enumerate(dc.CI_ATTENTION):
            dc.check_attention(attention.decode_attention, case, "cpu", seed=i)
            n += 1
    elif group == "idle":
        for i, case in enumerate(dc.CI_IDLE):
            dc.check_attention_idle(attention.decode_attention, case, "cpu", seed=i)
            n += 1
    elif group == "int64":
        dc.check_int64_offsets(attention.decode_attention, fused.rope_kv_write, "cpu")
        n = 1
    elif group == "gemv":
        from graphburst.models.decode import gemv

        for i, case in enumerate(dc.CI_GEMV):
            dc.check_gemv(gemv.gemv, case, "cpu", seed=i)
        n = len(dc.CI_GEMV)
    elif group == "fused":
        for i, case in enumerate(dc.CI_NORM):
            dc.check_add_rmsnorm(fused.add_rmsnorm, case, "cpu", seed=i)
        for i, case in enumerate(dc.CI_ROPE):
            dc.check_rope_kv_write(fused.rope_kv_write, case, "cpu", seed=i)
        for i, case in enumerate(dc.CI_SILU):
            dc.check_silu_mul(fused.silu_mul, case, "cpu", seed=i)
        n = len(dc.CI_NORM) + len(dc.CI_ROPE) + len(dc.CI_SILU)
    elif group == "model":
        dc.check_model("gemv", "cpu", torch.float32)
        # Qwen3's q/k norms and the bias switches reach the Triton path too (ts: a verify only, to stay quick)
        dc.check_model("gemv", "cpu", torch.float32, ts=(5,), qk_norm=True, qkv_bias=True)
        n = 2
    elif group == "pdl-kernels":
        n = check_pdl_kernels()
    elif group == "pdl-model":
        n = check_pdl_model()
    elif group == "folded":
        n = check_folded_kernels()
    elif group == "folded-model":
        n = check_folded_model()
    else:
        raise SystemExit(f"unknown group {group!r}")
    print(f"ok {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
