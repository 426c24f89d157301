"""The decode kernels on the GPU: every awkward case against the plain-torch references, the fused
forward against SDPA, and the fused forward inside a CUDA graph reading lengths on the device. Then
programmatic dependent launch (PDL, Hopper): every kernel launched back to back with it computes the
bits it computes without, the compiled kernels carry the grid-dependency instructions, and whole
``decode_kernels="pdl"`` forwards, eager and replayed from a CUDA graph, equal ``"gemv"``'s bit for bit.

    PYTHONPATH=. python3 -m pytest -m gpu -q tests/models/decode/test_decode_kernels_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import decode_cases as dc
from graphburst.constants import MAX_K

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops():
    pytest.importorskip("triton")
    from graphburst.models.decode import attention, fused
    return attention, fused


def test_attention_every_case(ops):
    """T = 1..MAX_K + 1 x B 1, 3, 19 x groups 1, 4, 8 x head_dim 64, 128; fp32 and bf16; 1..16 splits."""
    for i, case in enumerate(dc.gpu_attention_cases()):
        dc.check_attention(ops[0].decode_attention, case, "cuda", seed=i)
    for i, case in enumerate(dc.CI_ATTENTION):
        dc.check_attention(ops[0].decode_attention, case, "cuda", seed=i)


def test_attention_idle_slots_and_int64_offsets(ops):
    """Negative (sentinel) lengths come out finite and as length 0; a 12.9 GB cache whose third sequence starts at
    element 2^31 is read and written at the right rows."""
    for i, case in enumerate(dc.CI_IDLE):
        dc.check_attention_idle(ops[0].decode_attention, case, "cuda", seed=i)
    dc.check_int64_offsets(ops[0].decode_attention, ops[1].rope_kv_write, "cuda")
    torch.cuda.empty_cache()


def test_fused_kernels(ops):
    fused = ops[1]
    for i, case in enumerate(dc.CI_NORM + [(64, 4096, torch.bfloat16, True), (5, 2048, torch.float32, True)]):
        dc.check_add_rmsnorm(fused.add_rmsnorm, case, "cuda", seed=i)
    for i, case in enumerate(dc.CI_ROPE + [(64, 5, 32, 8, 64, torch.bfloat16), (1, 5, 32, 8, 128, torch.bfloat16)]):
        dc.check_rope_kv_write(fused.rope_kv_write, case, "cuda", seed=i)
    for i, case in enumerate(dc.CI_SILU + [(64, 8192, torch.bfloat16), (5, 14336, torch.bfloat16)]):
        dc.check_silu_mul(fused.silu_mul, case, "cuda", seed=i)


#: (N, K) of the 1b's projections and head: qkv, o, gate_up, down, head
GEMV_1B = [(2048 + 2 * 512, 2048), (2048, 2048), (2 * 8192, 2048), (2048, 8192), (128256, 2048)]
GEMV_8B = [(4096 + 2 * 1024, 4096), (4096, 4096), (2 * 14336, 4096), (4096, 14336), (128256, 4096)]


def test_gemv_awkward_cases(ops):
    from graphburst.models.decode import gemv

    for i, case in enumerate(dc.CI_GEMV):
        dc.check_gemv(gemv.gemv, case, "cuda", seed=i)


@pytest.mark.parametrize("m", [1, 5, 16])
def test_gemv_model_shapes(ops, m):
    """Every 1b shape (and the 8b's at M = 5, its T = 5 verify) on CONFIGS' tilings, bf16: held to the fp32
    reference within two bf16 ulps and to cuBLAS (F.linear) within three; at M = 1 both the multiply-accumulate
    and the tl.dot path."""
    import torch.nn.functional as F

    from graphburst.models.decode import gemv

    shapes = GEMV_1B + (GEMV_8B if m == 5 else [])
    for i, (n, k) in enumerate(shapes):
        for fma in ((True, False) if m == 1 else (False,)):
            dc.check_gemv(gemv.gemv, (m, n, k, torch.bfloat16, i % 2 == 0, None, fma), "cuda", seed=i)
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(m, k, generator=gen).bfloat16().cuda()
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16().cuda()
        torch.testing.assert_close(gemv.gemv(x, w).float(), F.linear(x, w).float(), rtol=2e-2, atol=4e-2,
                                   msg=lambda s: f"M={m} N={n} K={k} against cuBLAS: {s}")
        del x, w
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kernels", ["gemv", "pdl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_matches_sdpa(ops, dtype, kernels):
    """pdl: GQA group 3; at T = MAX_K + 1 (M = 195) the projections run cuBLAS inside the PDL chain."""
    if kernels == "pdl":
        _pdl_or_skip()
    heads = (8, 2) if kernels == "gemv" else (6, 2)
    dc.check_model(kernels, "cuda", dtype, batch=3, ts=(1, 5, MAX_K + 1), heads=heads[0], kv_heads=heads[1])


def test_fused_forward_in_a_graph(ops):
    """Captured once; replays at other lengths and positions (written on the device) match eager forwards."""
    from graphburst.models.llama import Llama
    from graphburst.models.llama_config import LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    b, t = 3, 5
    model = Llama(cfg, batch=b, capacity=256, dtype=torch.bfloat16, device="cuda").init_random_(0)
    assert model.decode_ops is not None, "auto must pick the Triton kernels on CUDA"
    tokens = torch.randint(0, cfg.vocab_size, (b, t), device="cuda")
    length = torch.zeros(b, dtype=torch.int32, device="cuda")
    for kv in model.kv:
        kv.normal_()
    fill = [kv.clone() for kv in model.kv]
    fwd = lambda: model(tokens, length, [length] * cfg.num_hidden_layers)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        fwd()  # compile and autotune outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        out = fwd()
    for lens in ([0, 1, 63], [200, 17, 251], [5, 5, 5]):
        for kv, f in zip(model.kv, fill):
            kv.copy_(f)
        length.copy_(torch.tensor(lens, dtype=torch.int32))
        g.replay()
        got = out.clone()
        for kv, f in zip(model.kv, fill):
            kv.copy_(f)
        with torch.no_grad():
            want = fwd()
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"lengths {lens}: {m}")


# ---------------------------------------------------------------------- PDL (programmatic dependent launch)

def _pdl_or_skip() -> None:
    from graphburst.models import llama_decode

    why = llama_decode.pdl_unsupported(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def pdl(ops):
    _pdl_or_skip()
    return ops


BF16, FP32 = torch.bfloat16, torch.float32
#: (R, N, dtype): rows 1, 7, 19, 257; hidden 576 (SmolLM2's, BLOCK 1024 masked) and 2048
PDL_NORM = [(1, 576, BF16), (7, 2048, BF16), (19, 576, FP32), (257, 2048, BF16)]
#: (R, F, dtype, steps): F halves at every step
PDL_SILU = [(1, 8192, BF16, 5), (7, 3000, BF16, 3), (19, 1536, FP32, 4), (257, 1000, BF16, 4)]
#: (M, K = N, dtype, bias, config, fma): M = 1, 3, 16; K = 576 (one partial K tile per split) and 2048; split-K
#: 1 and > 1 (default tilings: 576 takes 3 splits on 132 SMs, 2048 the 1b o_proj's 4); the multiply-accumulate
#: path and tl.dot's at M = 1
PDL_GEMV = [(1, 576, BF16, False, None, None), (1, 576, BF16, True, (32, 256, 4, 1), None),
            (1, 2048, BF16, False, None, False), (3, 576, BF16, True, (32, 256, 4, 3), None),
            (3, 2048, BF16, False, (32, 256, 4, 1), None), (16, 2048, BF16, True, None, None),
            (16, 576, FP32, False, None, None)]
#: (B, T, KV heads, group, head_dim, dtype, splits): ragged lengths (0, 1, 63, 95 in turn), 1 to 8 splits (past
#: the valid tiles the programs exit at once, after their wait), groups 1, 3, 4
PDL_ATTENTION = [(3, 5, 2, 3, 64, BF16, 4), (1, 1, 3, 3, 64, BF16, 8), (19, 1, 2, 1, 64, BF16, 2),
                 (3, 5, 2, 4, 64, FP32, 1), (3, 5, 2, 4, 64, BF16, None)]


def test_pdl_norms_back_to_back_are_bit_identical(pdl):
    for i, case in enumerate(PDL_NORM):
        dc.check_pdl_same(dc.chain_add_rmsnorm, pdl[1].add_rmsnorm, case, "cuda", seed=i)


def test_pdl_silu_back_to_back_is_bit_identical(pdl):
    for i, case in enumerate(PDL_SILU):
        dc.check_pdl_same(dc.chain_silu_mul, pdl[1].silu_mul, case, "cuda", seed=i)


def test_pdl_gemv_back_to_back_is_bit_identical(pdl):
    """Including the split-K sum: each partial-sum launch and each GEMV after it are PDL launches too."""
    from graphburst.models.decode import gemv

    for i, case in enumerate(PDL_GEMV):
        dc.check_pdl_same(dc.chain_gemv, gemv.gemv, case, "cuda", seed=i)


def test_pdl_rope_and_attention_back_to_back_are_bit_identical(pdl):
    """RoPE + KV write then attention (and its combine), the output feeding the next round's q, each KV write
    landing on the rows the attention before it read."""
    for i, case in enumerate(PDL_ATTENTION):
        dc.check_pdl_same(dc.chain_rope_attention, pdl[1].rope_kv_write, pdl[0].decode_attention, case, "cuda",
                          seed=i)


def _compiled(fn) -> list:
    """Every compiled variant Triton holds of the jitted ``fn``: its per-device caches, whose first entry maps
    a specialisation key to the kernel (Triton 3.x)."""
    return [k for cache in fn.device_caches.values() for k in cache[0].values()]


def test_pdl_kernels_carry_the_grid_dependency_instructions(pdl):
    """Launched with pdl=True every kernel is compiled with both gdc instructions and launched with the PDL
    attribute; with pdl=False with neither (a constexpr guard that leaked, or a launch_dependents the compiler
    dropped, would show here: the bit-equality tests cannot see a missing overlap)."""
    from graphburst.models.decode import attention, fused, gemv

    for flag in (False, True):
        dc.chain_add_rmsnorm(fused.add_rmsnorm, (3, 576, BF16), "cuda", flag)
        dc.chain_silu_mul(fused.silu_mul, (3, 1000, BF16, 2), "cuda", flag)
        dc.chain_gemv(gemv.gemv, (3, 576, BF16, True, (32, 256, 4, 3), None), "cuda", flag)
        dc.chain_rope_attention(fused.rope_kv_write, attention.decode_attention, (3, 5, 2, 3, 64, BF16, 4), "cuda",
                                flag)
    torch.cuda.synchronize()
    kernels = (fused._add_rmsnorm, fused._rope_kv_write, fused._silu_mul, attention._split_attention,
               attention._combine, gemv._gemv, gemv._split_k_sum)
    for fn in kernels:
        variants = _compiled(fn)
        assert variants, f"{fn.__name__}: no compiled kernel found in Triton's cache"
        for on in (False, True):
            picked = [k for k in variants if bool(getattr(k.metadata, "launch_pdl", False)) == on]
            assert picked, f"{fn.__name__}: no variant launched with launch_pdl={on}"
            for k in picked:
                ptx = k.asm["ptx"]
                for instr in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
                    why = "missing" if on else "present"
                    assert (instr in ptx) == on, f"{fn.__name__} launch_pdl={on}: {instr} {why}"


def _pdl_equals_gemv(model, tokens: torch.Tensor, length: torch.Tensor, replays: int = 3, folded: bool = False) -> None:
    """On ``model``'s weights and KV: the eager ``"pdl"`` forward (twice: compiling, then compiled, its launches
    queued behind a busy GPU), and the ``"pdl"`` forward captured in a CUDA graph and replayed ``replays``
    times, equal the eager ``"gemv"`` forward bit for bit (logits and every KV layer; the KV is restored
    before each run). ``folded``: the folded layer with PDL against itself without."""
    from graphburst.models import llama_decode

    layers = len(model.layers)
    saved = [kv.clone() for kv in model.kv]
    fwd = lambda: model(tokens, length, [length] * layers)  # noqa: E731

    def restore():
        for kv, s in zip(model.kv, saved):
            kv.copy_(s)

    def same(got, what):
        assert torch.equal(got, want), f"{what}: logits differ from gemv's by up to {(got - want).abs().max()}"
        for i, (a, b) in enumerate(zip(model.kv, want_kv)):
            assert torch.equal(a, b), f"{what}: layer {i}'s KV differs from gemv's"

    gemv_ops, pdl_ops = llama_decode.gemv_ops(), llama_decode.gemv_ops(pdl=True)
    if folded:
        gemv_ops, pdl_ops = llama_decode.folded_ops(pdl=False), llama_decode.folded_ops(pdl=True)
    with torch.no_grad():
        model.decode_ops = gemv_ops
        restore()
        want = fwd().clone()
        want_kv = [kv.clone() for kv in model.kv]
        model.decode_ops = pdl_ops
        for run in ("first", "second"):
            restore()
            dc.busy("cuda")
            same(fwd(), f"eager pdl, {run} run")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fwd()  # a capture starts from a warmed-up stream
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fwd()
        for i in range(replays):
            restore()
            graph.replay()
            torch.cuda.synchronize()
            same(out, f"pdl graph replay {i}")


@pytest.mark.parametrize("t", [5, 1])
def test_pdl_forward_in_a_graph_is_gemv_bit_for_bit(pdl, t):
    """bf16, B = 3 (M = 15 and 3: every projection and the head on the GEMV), GQA group 3, hidden 192 (one
    partial K tile), ragged lengths."""
    from graphburst.models.llama import Llama
    from graphburst.models.llama_config import LlamaConfig

    cfg = LlamaConfig(vocab_size=1000, hidden_size=192, intermediate_size=320, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    b = 3
    model = Llama(cfg, batch=b, capacity=128, dtype=BF16, device="cuda", decode_kernels="pdl").init_random_(0)
    assert model.decode_ops.pdl and model.decode_ops.gemv_max_m == 16
    gen = torch.Generator(device="cuda").manual_seed(t)
    for kv in model.kv:
        kv.normal_(generator=gen)
    tokens = torch.randint(0, cfg.vocab_size, (b, t), device="cuda", generator=gen)
    _pdl_equals_gemv(model, tokens, torch.tensor([0, 37, 90], dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pdl_forward_with_cublas_fallbacks_is_gemv_bit_for_bit(pdl, dtype):
    """Eager, B = 3 at T = 1, 5 and MAX_K + 1 (M = 195: every projection on cuBLAS between PDL kernels), and a
    forward hook on o_proj (tensor parallelism's all-reduce; it keeps nn.Linear): the chain breaks there and
    the bits stay."""
    dc.check_pdl_model("cuda", dtype, batch=3, ts=(1, 5, MAX_K + 1), heads=6, kv_heads=2)
    models = dc.model_pair(("gemv", "pdl"), "cuda", dtype, batch=3, heads=6, kv_heads=2)
    for m in models:
        m.layers[0].self_attn.o_proj.register_forward_hook(lambda mod, inp, out: None)
    for t, ((want, want_kv), (got, got_kv)) in dc.model_forwards(models, "cuda", dtype, (1, 5)):
        assert torch.equal(got, want), f"hooked o_proj, T={t}"
        assert all(torch.equal(a, b) for a, b in zip(want_kv, got_kv)), f"hooked o_proj, T={t}: KV"


@pytest.fixture(scope="module")
def smollm2(pdl):
    """SmolLM2-135M's shape (bench real's "smollm2"), random bf16 weights, one slot of 1024 rows."""
    from graphburst.bench.real_models import MODELS, random_target
    from graphburst.models.llama import DEFAULT_KV_SLACK

    model = random_target(MODELS["smollm2"], batch=1, capacity=1024, kv_slack=DEFAULT_KV_SLACK, dtype=BF16,
                          device="cuda", seed=0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for kv in model.kv:
        kv.normal_(generator=gen)
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("t", [1, 5])
def test_pdl_smollm2_shape_is_gemv_bit_for_bit(smollm2, t):
    """30 layers of 9 q / 3 KV heads, hidden 576, FFN 1536, a tied 49152-row head: ~420 PDL launches per forward."""
    gen = torch.Generator(device="cuda").manual_seed(t)
    tokens = torch.randint(0, smollm2.vocab, (1, t), device="cuda", generator=gen)
    _pdl_equals_gemv(smollm2, tokens, torch.tensor([700], dtype=torch.int32, device="cuda"))


# ---------------------------------------------------------------------- the folded layer (decode/folded.py)

#: (N, K) of SmolLM2-135M's projections and head: qkv, o, gate_up, down, head
FOLDED_SMOLLM2 = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536), (49152, 576)]


def test_folded_kernels(ops):
    """Every awkward case, then the SmolLM2 and 1b shapes on their default tilings in bf16 (M = 1, 5, 16;
    deltas of every form), against the plain-torch references; the sum pass and residual bit for bit."""
    from graphburst.models.decode import folded

    for i, case in enumerate(dc.CI_NORM_LINEAR):
        dc.check_norm_linear(folded, case, "cuda", seed=i)
    for i, case in enumerate(dc.CI_SILU_LINEAR):
        dc.check_silu_linear(folded, case, "cuda", seed=i)
    for i, case in enumerate(dc.CI_FOLDED_ROPE + [(1, 5, 9, 3, 64, BF16, 3), (64, 5, 32, 8, 64, BF16, "whole")]):
        dc.check_folded_rope(folded, case, "cuda", seed=i)
    from graphburst.models.decode import attention

    # o_proj over the attention's splits: every awkward case, then SmolLM2's and the 1b's heads at B = 1 over 16
    # splits (a 1024-row cache's), most of them idle at these lengths
    for i, case in enumerate(dc.CI_COMBINE + [(1, 1, 3, 3, 64, BF16, 16, (150,)), (1, 1, 8, 4, 64, BF16, 16, (95,))]):
        dc.check_combine_linear(folded, attention, case, "cuda", seed=i)
    for i, (n, k) in enumerate(FOLDED_SMOLLM2 + GEMV_1B):
        for m, form in ((1, None), (5, 3), (16, "whole")):
            dc.check_norm_linear(folded, (m, k, n, BF16, form, None, None), "cuda", seed=i)
        dc.check_silu_linear(folded, (5, k, n, BF16, 2, None, None), "cuda", seed=i)
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fold", ["default", "row_tile"])
def test_folded_forward_matches_sdpa(pdl, dtype, fold):
    """B = 1 and 3, GQA group 3, T = 1, 5 and MAX_K + 1 (M = 195: the unfolded fallback inside the PDL chain);
    Qwen2's biases with Qwen3's q/k norms at T = 5. By default only B = 1, T = 1 folds; with ``max_m`` 16
    every M up to 16 does (the ``tl.dot`` prologues)."""
    from graphburst.models import llama_decode
    from graphburst.models.decode.gemv import MAX_M

    ops = llama_decode.folded_ops(max_m=None if fold == "default" else MAX_M)
    for batch in (1, 3):
        dc.check_model("folded", "cuda", dtype, batch=batch, ts=(1, 5, MAX_K + 1), heads=6, kv_heads=2, ops=ops)
    dc.check_model("folded", "cuda", dtype, batch=3, ts=(5,), ops=ops, qk_norm=True, qkv_bias=True)


#: (M, hidden, F, dtype, gate/up config, down config): SmolLM2's MLP at M = 1 (split-K 3 partials into the
#: SiLU prologue and the next norm) and M = 5; a 1b-wide one at M = 16
PDL_FOLDED = [(1, 576, 1536, BF16, (32, 256, 4, 3), (32, 256, 4, 3)),
              (5, 576, 1536, BF16, (32, 256, 4, 1), (32, 256, 4, 2)),
              (16, 2048, 8192, BF16, (32, 256, 4, 1), (32, 256, 4, 8))]


def test_pdl_folded_back_to_back_is_bit_identical(pdl):
    from graphburst.models.decode import folded

    for i, case in enumerate(PDL_FOLDED):
        dc.check_pdl_same(dc.chain_folded, folded, case, "cuda", seed=i)


def test_pdl_folded_kernels_carry_the_grid_dependency_instructions(pdl):
    """As the unfolded kernels' test: the folded GEMV (each prologue) and its RoPE kernel."""
    from graphburst.models.decode import folded
    from graphburst.models.decode.partial import Partial

    for flag in (False, True):
        dc.chain_folded(folded, PDL_FOLDED[0], "cuda", flag)
        qkv = Partial.whole(torch.randn(3, 13 * 64, dtype=BF16, device="cuda"))
        kv = torch.zeros(2, 3, 16, 2, 64, dtype=BF16, device="cuda")
        cos = torch.ones(16, 64, device="cuda")
        pos = torch.zeros(3, dtype=torch.int32, device="cuda")
        folded.rope_kv_write(qkv, cos, cos, pos, pos, kv, 9, 1, pdl=flag)
        folded.linear(torch.randn(3, 64, dtype=BF16, device="cuda"), torch.randn(64, 64, dtype=BF16, device="cuda"),
                      pdl=flag)
    torch.cuda.synchronize()
    for fn in (folded._folded_gemv, folded._rope_kv_write):
        variants = _compiled(fn)
        for on in (False, True):
            picked = [k for k in variants if bool(getattr(k.metadata, "launch_pdl", False)) == on]
            assert picked, f"{fn.__name__}: no variant launched with launch_pdl={on}"
            for k in picked:
                for instr in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
                    assert (instr in k.asm["ptx"]) == on, f"{fn.__name__} launch_pdl={on}: {instr}"


def test_folded_pdl_forward_with_fallbacks_is_its_own_bits(pdl):
    """Eager, B = 3 at T = 1, 5 and MAX_K + 1, folding one row (the default) and 16: PDL changes no bit of the
    folded forward."""
    from graphburst.models.decode.gemv import MAX_M

    for max_m in (None, MAX_M):
        dc.check_folded_pdl_model("cuda", BF16, batch=3, ts=(1, 5, MAX_K + 1), heads=6, kv_heads=2, max_m=max_m)


@pytest.mark.parametrize("t", [1, 5])
def test_folded_smollm2_shape_in_a_graph(smollm2, t):
    """SmolLM2's shape on the folded layer with PDL, eager and replayed from a graph, equals it without PDL bit
    for bit, and the SDPA forward within bf16 rounding."""
    gen = torch.Generator(device="cuda").manual_seed(t)
    tokens = torch.randint(0, smollm2.vocab, (1, t), device="cuda", generator=gen)
    length = torch.tensor([700], dtype=torch.int32, device="cuda")
    _pdl_equals_gemv(smollm2, tokens, length, folded=True)
    from graphburst.bench.real_forward import check

    with torch.no_grad():  # against SDPA, within bench real's bound for bf16 through 30 random layers
        check(smollm2, tokens, length, [length] * len(smollm2.layers))
