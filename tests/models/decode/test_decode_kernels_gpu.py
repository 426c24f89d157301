"""The decode kernels on the GPU: every awkward case against the plain-torch references, the fused
forward against SDPA, and the fused forward inside a CUDA graph reading lengths on the device.

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_matches_sdpa(ops, dtype):
    dc.check_model("triton", "cuda", dtype, batch=3, ts=(1, 5, MAX_K + 1))


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
