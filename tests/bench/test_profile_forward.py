"""scripts/profile_forward.py on the CPU: the bytes floor against the issue's figures, the per-kernel split of
a hand-built profile, and the table
renders every record kind (a profiled record once broke it after the measurements were taken)."""

from __future__ import annotations

import pytest
from rich.console import Console
from scripts_import import import_script


@pytest.fixture(scope="module")
def pf():
    return import_script("profile_forward")  # it imports its sibling tp_floor


@pytest.mark.parametrize("b,t,want", [(1, 1, 518), (1, 5, 519), (64, 1, 739), (64, 5, 741)])
def test_floor_is_the_issues(pf, b, t, want):
    """Issue 20's floors: (weights + valid KV read + KV written) / 4.8 TB/s for the 1b shape, 512 valid rows."""
    import torch

    from graphburst.bench.real_models import MODELS
    from graphburst.models.llama import Llama

    cfg = MODELS["1b"].cfg
    with torch.device("meta"):
        model = Llama(cfg.replace(num_hidden_layers=cfg.num_hidden_layers), batch=1, capacity=16, device="meta")
    wbytes = sum(p.numel() * 2 for p in model.parameters())  # bf16
    assert pf.floor_us(cfg, wbytes, b, t, 512, 2) == pytest.approx(want, rel=0.01)


#: one forward of a 2-layer model as the H200's profiler names its kernels, with device µs
FORWARD = [
    ("indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>", 2.0),  # embedding
    *[ev for _ in range(2) for ev in (
        ("_add_rmsnorm", 2.0),
        ("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", 10.0),  # qkv (cuBLAS)
        ("_rope_kv_write", 1.5),
        ("_split_attention", 4.0),
        ("_combine", 1.0),
        ("_gemv", 5.0),  # o_proj (the Triton GEMV) and its split-K sum
        ("_split_k_sum", 1.0),
        ("_add_rmsnorm", 2.0),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", 20.0),  # gate_up
        ("_silu_mul", 1.5),
        ("gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4>", 8.0),  # down
    )],
    ("_add_rmsnorm", 2.0),  # final norm
    ("nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT", 30.0),  # head
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps>>", 1.0),
]
#: names that must not land where their substrings suggest
TRAPS = [("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"), ("flash_fwd_splitkv_kernel", "attention"),
         ("flash_fwd_splitkv_combine_kernel", "attention"),
         ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
         ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>", "fused"),
         ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<float>>", "other"),
         ("Memcpy DtoD (Device -> Device)", "other"), ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64", "gemm")]


@pytest.mark.parametrize("name,want", TRAPS)
def test_kernel_categories(pf, name, want):
    assert pf.category(name) == want


def test_breakdown_of_a_hand_built_profile(pf):
    """Three profiled forwards of a 2-layer model, graph replay 150 µs: every figure by hand."""
    got = pf.breakdown(FORWARD * 3, layers=2, calls=3, graph_us=150.0, top=3)
    gemm = 2 * (10 + 5 + 1 + 20 + 8) + 30  # 118
    attention, fused, other = 2 * (4 + 1), 2 * (2 + 1.5 + 2 + 1.5) + 2, 2 + 1  # 10, 16, 3
    total = gemm + attention + fused + other  # 147
    assert (got["gemm_us"], got["attention_us"], got["fused_us"], got["other_us"]) == (gemm, attention, fused, other)
    assert got["kernel_sum_us"] == total and got["gap_us"] == 150 - total
    assert got["kernels"] == len(FORWARD) and got["per_layer"] == round(len(FORWARD) / 2, 1)
    assert got["gemm_kernels"] == 11 and got["attention_kernels"] == 4
    assert got["gemm_per_layer_us"] == gemm / 2 and got["gap_per_layer_us"] == (150 - total) / 2
    # issue 20's figure: (graph - GEMM) / layers, gaps included; and the kernels alone
    assert got["nongemm_per_layer_us"] == (150 - gemm) / 2 == 16.0
    assert got["nongemm_kernel_per_layer_us"] == (total - gemm) / 2
    assert got["top"] == [("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "gemm", 2, 40.0),
                          ("nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT", "gemm", 1, 30.0),
                          ("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "gemm", 2, 20.0)]
    with pytest.raises(ValueError, match="calls"):
        pf.breakdown(FORWARD, layers=2, calls=0, graph_us=150.0, top=3)


def test_table_renders_every_record(pf):
    plain = {"shape": "1b", "batch": 1, "T": 5, "capacity": 1024, "valid": 512, "attention": "gqa", "path": "fused",
             "graph_us": 700.0, "floor_us": 519.0, "x_floor": 1.35, "check_rel_diff": 0.01}
    profiled = {**plain, "path": "sdpa", **pf.breakdown(FORWARD, layers=2, calls=1, graph_us=150.0, top=3)}
    console = Console(width=200, record=True)
    console.print(pf.table_of([plain, profiled]))
    text = console.export_text()
    assert "fused" in text and "sdpa" in text and "16.0" in text and "118" in text
    assert "non-GEMM 16.0 µs/layer" in pf.summary(profiled) and "GEMM" not in pf.summary(plain)
