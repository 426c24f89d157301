"""``graphburst bench real --profile forward`` as a user runs it: every config checked, then timed against the
bytes floor, its kernel time split by category; a fused forward that disagrees with SDPA is reported, not timed,
and the command exits 1. Then the parts the CPU cannot reach: the floor at the 1b shape's published figures and
the category of every kernel name a GPU profile shows."""

from __future__ import annotations

import pytest
from real_cli import cli_here, cli_json

torch = pytest.importorskip("torch")

from graphburst.bench import real_forward  # noqa: E402

PATHS = {"sdpa", "fused-reference"}  # on the CPU "auto" is SDPA, timed once


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("forward")
    (tmp / "trace").mkdir()
    doc, stdout = cli_json("--profile", "forward", "--smoke", "--backend", "numpy", "--attention", "gqa,fold",
                           "--trace", tmp / "trace", cwd=tmp)
    return doc, stdout, tmp / "trace"


def test_every_config_is_checked_then_timed(tiny):
    doc, stdout, _ = tiny
    assert doc["meta"]["backend"] == "numpy" and "CPU REFERENCE" in doc["meta"]["label"]
    assert doc["meta"]["failures"] == [] and set(doc["results"]) == {"forward"}
    recs = doc["results"]["forward"]
    assert sorted((r["T"], r["attention"], r["path"]) for r in recs) == sorted(
        (t, a, p) for t in (5, 1) for a in ("gqa", "fold") for p in PATHS)
    for r in recs:
        assert (r["shape"], r["batch"], r["capacity"], r["valid"]) == ("tiny", 1, 64, 32)
        # the floor is rounded to 0.1 µs, and the tiny model's is 0.09 µs: x floor is taken before rounding
        assert r["graph_us"] > 0 and r["x_floor"] == pytest.approx(r["graph_us"] / r["floor_us"], rel=0.15)
        if r["path"] == "sdpa":
            assert r["check_rel_diff"] is None  # SDPA is the reference
        else:
            assert 0 <= r["check_rel_diff"] < 0.05, r  # the references compute SDPA's function: rounding only
    assert "forward: Llama forward" in stdout and "fused-reference" in stdout
    assert stdout.count("tiny B=1 T=") == len(recs)  # one progress line per config


def test_kernel_time_by_category_adds_up(tiny):
    """The categories sum to the kernel total, the gap is graph minus kernels, non-GEMM per layer is
    (graph - GEMM) / layers, and every top kernel carries its own category."""
    layers = 4
    for r in tiny[0]["results"]["forward"]:
        cats = [r[f"{c}_us"] for c in ("gemm", "attention", "fused", "other")]
        assert sum(cats) == pytest.approx(r["kernel_sum_us"], abs=0.3)
        assert r["gemm_us"] > 0 and r["gemm_kernels"] > 0  # aten::mm is a GEMM on the CPU
        assert r["gap_us"] == pytest.approx(r["graph_us"] - r["kernel_sum_us"], abs=0.2)
        assert r["nongemm_per_layer_us"] == pytest.approx((r["graph_us"] - r["gemm_us"]) / layers, abs=0.1)
        assert r["per_layer"] == pytest.approx(r["kernels"] / layers, abs=0.1)
        assert r["profiled_calls"] == 1 and len(r["top"]) == 8
        assert all(real_forward.category(name) == cat for name, cat, _, _ in r["top"])
        assert [us for *_, us in r["top"]] == sorted((us for *_, us in r["top"]), reverse=True)


def test_traces_are_written(tiny):
    doc, _, trace = tiny
    for r in doc["results"]["forward"]:
        assert r["trace"].startswith(str(trace)) and (trace / r["trace"].rsplit("/", 1)[1]).stat().st_size > 0


def test_graph_timings_only_against_the_floor(tmp_path):
    """``--profile-calls 0``: no kernel split. The floor of the small shape, by hand: every parameter in bf16
    plus the valid KV rows read and the new ones written, over 4.8 TB/s."""
    doc, _ = cli_json("--profile", "forward", "--backend", "numpy", "--models", "small", "--kernels", "off",
                      "--tokens", "3", "--capacities", "40", "--valid", "20", "--trials", "1", "--profile-calls", "0",
                      cwd=tmp_path)
    (r,) = doc["results"]["forward"]
    d, f, layers, vocab, kv_heads, hd = 768, 3072, 12, 32000, 4, 64
    params = layers * (d * hd * (2 * 12 + 2 * kv_heads) + 3 * d * f + 2 * d) + d + 2 * vocab * d  # untied head
    row = 2 * kv_heads * hd * 2 * layers  # K and V of one position, every layer, bf16
    want = (2 * params + (20 + 3) * row + 3 * row) / 4.8e12 * 1e6
    assert r["floor_us"] == round(want, 1) and (r["T"], r["valid"], r["path"]) == (3, 20, "sdpa")
    assert r["x_floor"] == pytest.approx(r["graph_us"] / want, rel=0.01)
    assert "gemm_us" not in r and "top" not in r


def test_a_fused_forward_that_disagrees_is_reported_not_timed(tmp_path, capsys, monkeypatch):
    """A wiring bug (here: every norm scaling by 40 instead of by its weight) fails the check against SDPA:
    the config has no timings, the run goes on, the JSON names the failure and the command exits 1."""
    from graphburst.models import llama_decode

    ref = llama_decode.reference_ops()
    broken = ref._replace(add_rmsnorm=lambda x, delta, w, eps, **kw: ref.add_rmsnorm(x, delta, torch.ones_like(w) * 40,
                                                                                       eps))
    monkeypatch.setattr(llama_decode, "reference_ops", lambda: broken)
    out = tmp_path / "f.json"
    rc, stdout = cli_here("--profile", "forward", "--smoke", "--backend", "numpy", "--tokens", "1", "--json", out,
                          capsys=capsys)
    import json

    doc = json.loads(out.read_text())
    assert rc == 1
    bad, good = (next(r for r in doc["results"]["forward"] if r["path"] == p) for p in ("fused-reference", "sdpa"))
    assert "disagrees with SDPA" in bad["failed"] and "graph_us" not in bad
    assert good["graph_us"] > 0 and "failed" not in good
    assert len(doc["meta"]["failures"]) == 1 and "fused-reference" in doc["meta"]["failures"][0]
    assert "FAILED" in stdout and "correctness failure" in stdout


def test_gemv_and_pdl_kernels_on_the_cpu(tmp_path):
    """``--kernels auto,gemv,pdl,folded``: on the CPU the GEMV paths are Triton's, so without the interpreter they
    are SDPA as auto is (timed once); under ``TRITON_INTERPRET=1`` all run (PDL off there), checked against SDPA."""
    args = ("--profile", "forward", "--smoke", "--backend", "numpy", "--kernels", "auto,gemv,pdl,folded",
            "--tokens", "1", "--trials", "1", "--profile-calls", "0")
    doc, _ = cli_json(*args, cwd=tmp_path)
    assert [r["path"] for r in doc["results"]["forward"]] == ["sdpa"]
    pytest.importorskip("triton")
    doc, stdout = cli_json(*args, cwd=tmp_path, env={"TRITON_INTERPRET": "1"})
    recs = doc["results"]["forward"]
    assert [r["path"] for r in recs] == ["sdpa", "fused-gemv", "fused-pdl", "fused-folded"]
    assert doc["meta"]["failures"] == []
    assert all(0 <= r["check_rel_diff"] < 0.05 for r in recs[1:]), recs
    assert "fused-pdl" in stdout


def test_floor_of_the_smollm2_shape():
    """SmolLM2-135M's shape ties its head to the embedding table: the floor reads that table once (as the head),
    the model's parameters hold it once, and the config's bytes count it once."""
    from graphburst.bench.real_models import MODELS, weight_bytes
    from graphburst.models.llama import Llama

    cfg = MODELS["smollm2"].cfg
    assert cfg.tie_word_embeddings and (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    d, f, layers, vocab, h, kv_heads, hd = 576, 1536, 30, 49152, 9, 3, 64
    params = layers * (d * hd * (2 * h + 2 * kv_heads) + 3 * d * f + 2 * d) + d + vocab * d  # one table
    with torch.device("meta"):
        model = Llama(cfg, batch=1, capacity=16, dtype=torch.bfloat16, device="meta")
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # as the forward view counts them
    assert wbytes == real_forward.param_bytes(cfg, 2) == weight_bytes(model) == 2 * params
    assert params == 134_515_008  # SmolLM2-135M's parameter count
    row = 2 * kv_heads * hd * 2 * layers
    want = (2 * params + (512 + 1) * row + row) / 4.8e12 * 1e6
    assert real_forward.floor_us(cfg, wbytes, 1, 1, 512, 2) == pytest.approx(want) == pytest.approx(58.5, abs=0.1)


@pytest.mark.parametrize("b,t,want", [(1, 1, 518), (1, 5, 519), (64, 1, 739), (64, 5, 741)])
def test_floor_of_the_1b_shape(b, t, want):
    """The published 1b floors (512 valid rows): the config's parameter bytes equal the model's, and
    (weights + valid KV read + KV written) / 4.8 TB/s."""
    from graphburst.bench.real_models import MODELS
    from graphburst.models.llama import Llama

    cfg = MODELS["1b"].cfg
    with torch.device("meta"):
        model = Llama(cfg, batch=1, capacity=16, device="meta")
    wbytes = sum(p.numel() * 2 for p in model.parameters())  # bf16
    assert real_forward.param_bytes(cfg, 2) == wbytes
    assert real_forward.floor_us(cfg, wbytes, b, t, 512, 2) == pytest.approx(want, rel=0.01)


#: one forward of a 2-layer model as the H200's profiler names its kernels, with (launches, device µs)
FORWARD = {
    "indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>": (1, 2.0),  # embedding
    "_add_rmsnorm": (5, 10.0),  # two per layer and the final norm
    "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT": (2, 20.0),  # qkv (cuBLAS)
    "_rope_kv_write": (2, 3.0),
    "_split_attention": (2, 8.0),
    "_combine": (2, 2.0),
    "_gemv": (2, 10.0),  # o_proj (the Triton GEMV) and its split-K sum
    "_split_k_sum": (2, 2.0),
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": (2, 40.0),  # gate_up
    "_silu_mul": (2, 3.0),
    "gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4>": (2, 16.0),  # down
    "nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT": (1, 30.0),  # head
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps>>": (1, 1.0),
}
#: names that must not land where their substrings suggest (GPU kernels, then the CPU's aten ops)
TRAPS = [("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"), ("flash_fwd_splitkv_kernel", "attention"),
         ("flash_fwd_splitkv_combine_kernel", "attention"),
         ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
         ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>", "fused"),
         ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<float>>", "other"),
         ("Memcpy DtoD (Device -> Device)", "other"), ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64", "gemm"),
         ("aten::mm", "gemm"), ("aten::addmm", "gemm"), ("aten::_scaled_dot_product_flash_attention_for_cpu",
                                                         "attention"),
         ("aten::silu", "fused"), ("aten::copy_", "other")]


@pytest.mark.parametrize("name,want", TRAPS)
def test_kernel_categories(name, want):
    assert real_forward.category(name) == want


def test_breakdown_of_a_hand_built_profile():
    """Three profiled forwards of a 2-layer model, graph replay 150 µs: every figure by hand."""
    thrice = {name: (3 * n, 3 * us) for name, (n, us) in FORWARD.items()}
    got = real_forward.breakdown(thrice, layers=2, calls=3, graph_us=150.0, top=3)
    gemm = 20 + 10 + 2 + 40 + 16 + 30  # 118
    attention, fused, other = 8 + 2, 10 + 3 + 3, 2 + 1  # 10, 16, 3
    total = gemm + attention + fused + other  # 147
    assert (got["gemm_us"], got["attention_us"], got["fused_us"], got["other_us"]) == (gemm, attention, fused, other)
    assert got["kernel_sum_us"] == total and got["gap_us"] == 150 - total
    launches = sum(n for n, _ in FORWARD.values())
    assert got["kernels"] == launches and got["per_layer"] == round(launches / 2, 1)
    assert got["gemm_kernels"] == 11 and got["attention_kernels"] == 4
    assert got["gemm_per_layer_us"] == gemm / 2 and got["gap_per_layer_us"] == (150 - total) / 2
    # (graph - GEMM) / layers, gaps included; and the kernels alone
    assert got["nongemm_per_layer_us"] == (150 - gemm) / 2 == 16.0
    assert got["nongemm_kernel_per_layer_us"] == (total - gemm) / 2
    assert got["top"] == [("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "gemm", 2, 40.0),
                          ("nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT", "gemm", 1, 30.0),
                          ("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "gemm", 2, 20.0)]
    with pytest.raises(ValueError, match="calls"):
        real_forward.breakdown(FORWARD, layers=2, calls=0, graph_us=150.0, top=3)


@pytest.mark.gpu
def test_forward_view_on_the_gpu(tmp_path):
    """On CUDA: the fused Triton path, with and without the GEMV, against SDPA; CUDA-graph replays and the
    kernels' device time, every category present on the fused path."""
    from graphburst.backend import cuda_available

    if not cuda_available() or not torch.cuda.is_available():
        pytest.skip("needs cupy, a CUDA device and CUDA torch")
    doc, _ = cli_json("--profile", "forward", "--smoke", "--backend", "cupy", "--kernels", "auto,cublas,off",
                      cwd=tmp_path)
    recs = doc["results"]["forward"]
    assert {r["path"] for r in recs} == {"fused", "fused-cublas", "sdpa"} and doc["meta"]["failures"] == []
    for r in recs:
        assert r["graph_us"] > 0 and r["floor_us"] > 0 and r["kernel_sum_us"] > 0 and r["gemm_us"] > 0
        assert r["attention_us"] > 0, r
        if r["path"] != "sdpa":
            assert r["fused_us"] > 0 and 0 <= r["check_rel_diff"] <= 0.25
    for t in (5, 1):  # the fused path exists to launch fewer kernels per layer than SDPA's
        per_layer = {r["path"]: r["per_layer"] for r in recs if r["T"] == t}
        assert per_layer["fused"] < per_layer["sdpa"], per_layer


@pytest.mark.gpu
def test_forward_view_gemv_and_pdl_on_the_gpu(tmp_path):
    """``--kernels auto,gemv,pdl,folded`` on a Hopper GPU with SmolLM2-135M's shape: every GEMV path checked
    against SDPA and timed, PDL's with as many kernels per layer as the plain GEMV's, the folded layer's with
    fewer."""
    from graphburst.backend import cuda_available
    from graphburst.models.llama_decode import pdl_unsupported

    if not cuda_available() or not torch.cuda.is_available():
        pytest.skip("needs cupy, a CUDA device and CUDA torch")
    why = pdl_unsupported(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)
    doc, _ = cli_json("--profile", "forward", "--backend", "cupy", "--models", "smollm2", "--capacities", "256",
                      "--kernels", "auto,gemv,pdl,folded", "--trials", "3", "--profile-calls", "1", cwd=tmp_path)
    recs = doc["results"]["forward"]
    assert {r["path"] for r in recs} == {"fused", "fused-gemv", "fused-pdl", "fused-folded"}
    assert doc["meta"]["failures"] == []
    for r in recs:
        assert r["graph_us"] > 0 and 0 <= r["check_rel_diff"] <= 0.25, r
    for t in (5, 1):
        per_layer = {r["path"]: r["per_layer"] for r in recs if r["T"] == t}
        assert per_layer["fused-pdl"] == per_layer["fused-gemv"], per_layer
        assert per_layer["fused-folded"] < per_layer["fused-pdl"], per_layer
