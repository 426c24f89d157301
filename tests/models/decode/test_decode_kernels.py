"""The decode kernels on the CPU: references against independent math, the kernels against the
references under Triton's interpreter, and the fused decode forward against the SDPA forward.

GPU twins are in ``tests/models/decode/test_decode_kernels_gpu.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import decode_cases as dc
from graphburst.constants import MAX_K
from graphburst.models.decode import reference as decode_reference
from graphburst.models.llama import Llama
from graphburst.models.llama_config import LlamaConfig
from graphburst.models.rope import apply_rope
from graphburst.models.llama_layers import kv_index

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("t", [1, 2, 5, MAX_K + 1])
@pytest.mark.parametrize("b,g,d", [(1, 8, 128), (3, 4, 64), (19, 1, 64)])
def test_attention_ref_is_sdpa_over_the_mask(b, t, g, d):
    """The reference equals SDPA over the SDPA path's own mask (``kv_index``), and ignores a poisoned tail."""
    kvh = 2
    gen = torch.Generator().manual_seed(t)
    q = torch.randn(b, t, kvh * g, d, generator=gen)
    kv = torch.randn(2, b, dc.ROWS, kvh, d, generator=gen)
    length = dc.lengths_for(b, t, t)
    _, mask = kv_index(length, torch.arange(b), t, dc.ROWS)  # [B, 1, T, S] additive
    want = F.scaled_dot_product_attention(q.transpose(1, 2), kv[0].transpose(1, 2), kv[1].transpose(1, 2),
                                          attn_mask=mask, enable_gqa=True).transpose(1, 2)
    dc.poison_tail(kv, length, t)
    got = decode_reference.decode_attention_ref(q, kv, length)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_refs_are_the_model_ops():
    """add_rmsnorm_ref is add + F.rms_norm; rope_kv_write_ref is HF's rotate-half RoPE and the K/V rows; silu_mul_ref is silu * up."""
    gen = torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(5, 96, generator=gen) for _ in range(3))
    h = x + r
    y = decode_reference.add_rmsnorm_ref(x, r, w[0], 1e-5)
    torch.testing.assert_close(x, h)
    torch.testing.assert_close(y, F.rms_norm(h, (96,), w[0], 1e-5))
    b, t, hq, kvh, d = 3, 4, 4, 2, 64
    qkv = torch.randn(b, t, hq + 2 * kvh, d, generator=gen)
    ang = torch.rand(40, d // 2, generator=gen)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    start, length = torch.tensor([0, 5, 30], dtype=torch.int32), torch.tensor([2, 0, 9], dtype=torch.int32)
    pos = start.long().unsqueeze(1) + torch.arange(t)
    want = apply_rope(qkv[:, :, : hq + kvh], cos[pos], sin[pos])
    kv = torch.zeros(2, b, 16, kvh, d)
    src = qkv.clone()
    decode_reference.rope_kv_write_ref(qkv, cos, sin, start, length, kv, hq)
    torch.testing.assert_close(qkv[:, :, :hq], want[:, :, :hq])
    for i in range(b):
        rows = slice(int(length[i]), int(length[i]) + t)
        torch.testing.assert_close(kv[0, i, rows], want[i, :, hq:])
        torch.testing.assert_close(kv[1, i, rows], src[i, :, hq + kvh:])
    gu = torch.randn(3, 20, generator=gen)
    torch.testing.assert_close(decode_reference.silu_mul_ref(gu), F.silu(gu[:, :10]) * gu[:, 10:])


def test_reference_decode_path_matches_sdpa():
    """The fused forward's wiring (norm folding, residuals, in-place q, KV rows) on the references, fp32."""
    dc.check_model("reference", "cpu", torch.float32, ts=(1, 5, MAX_K + 1))


@pytest.mark.parametrize("switches", [dict(qkv_bias=True), dict(qk_norm=True)], ids=["qwen2-bias", "qwen3-qk-norm"])
def test_reference_decode_path_matches_sdpa_for_every_family(switches):
    """Qwen2's q/k/v biases and Qwen3's per-head q/k norms take the fused path too, to the same function."""
    dc.check_model("reference", "cpu", torch.float32, ts=(1, MAX_K + 1), **switches)


def test_linear_ref_is_f_linear():
    """The GEMV's reference is F.linear: fp32 to float rounding, bf16 one rounding of the fp32 result."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 257, generator=gen), torch.randn(96, 257, generator=gen), torch.randn(96, generator=gen)
    torch.testing.assert_close(decode_reference.linear_ref(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    want = F.linear(xb.double(), wb.double()).bfloat16()
    got = decode_reference.linear_ref(xb, wb)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-3)  # within one bf16 ulp


def test_fused_forward_routes_projections_through_the_gemv():
    """At M = B * T <= gemv_max_m every projection and the head take ops.linear; past it none does; a projection
    with a forward hook (TP's all-reduce) keeps the module call, so the hook runs."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True)
    model = Llama(cfg, batch=2, capacity=16, decode_kernels="reference").init_random_(0)
    calls, hooked = [], []
    ops = model.decode_ops
    model.decode_ops = ops._replace(linear=lambda x, w, b=None, **kw: calls.append(w.shape) or
                                    decode_reference.linear_ref(x, w, b))
    start = torch.zeros(2, dtype=torch.int32)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    with torch.no_grad():
        model(tokens, start, [start] * 2)  # M = 6
        assert len(calls) == 4 * 2 + 1 and calls[-1] == (64, 32), calls
        calls.clear()
        model.decode_ops = model.decode_ops._replace(gemv_max_m=5)
        model(tokens, start, [start] * 2)  # M = 6 > 5: cuBLAS's path (nn.Linear) everywhere
        assert calls == []
        model.decode_ops = model.decode_ops._replace(gemv_max_m=ops.gemv_max_m)
        model.layers[0].self_attn.o_proj.register_forward_hook(lambda mod, inp, out: hooked.append(out.shape))
        model(tokens, start, [start] * 2)
    assert hooked == [(6, 32)] and len(calls) == 4 * 2 + 1 - 1


@pytest.mark.parametrize("pdl", [False, True])
def test_fused_forward_passes_pdl_to_every_op(pdl):
    """Every decode op of every layer, the final norm and the head are called with ``pdl=ops.pdl`` (a
    reference op, which ignores it, stands for each kernel)."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = Llama(cfg, batch=2, capacity=16, decode_kernels="reference").init_random_(0)
    seen = []

    def record(name, fn):
        def call(*args, **kw):
            seen.append((name, kw.get("pdl")))
            return fn(*args, **kw)
        return call

    ops = model.decode_ops._replace(pdl=pdl)
    model.decode_ops = ops._replace(**{name: record(name, getattr(ops, name))
                                       for name in ("attention", "add_rmsnorm", "rope_kv_write", "silu_mul", "linear")})
    start = torch.zeros(2, dtype=torch.int32)
    with torch.no_grad():
        model(torch.zeros(2, 3, dtype=torch.long), start, [start] * 2)
    per_layer = ["add_rmsnorm", "linear", "rope_kv_write", "attention", "linear", "add_rmsnorm", "linear", "silu_mul",
                 "linear"]
    assert [name for name, _ in seen] == per_layer * 2 + ["add_rmsnorm", "linear"]
    assert {flag for _, flag in seen} == {pdl}


def test_decode_kernels_choice():
    cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    assert Llama(cfg, batch=1, capacity=16).decode_ops is None  # auto on the CPU: SDPA, exact HF parity
    for choice in ("triton", "gemv", "pdl"):
        with pytest.raises(ValueError, match="head_dim 12"):
            Llama(cfg, batch=1, capacity=16, decode_kernels=choice)
    with pytest.raises(ValueError, match="decode_kernels"):
        Llama(cfg, batch=1, capacity=16, decode_kernels="fast")


def test_gemv_and_pdl_choices_are_the_gemv_path_with_and_without_pdl():
    """``gemv``: every projection and the head on the GEMV up to its row tile, no PDL; ``pdl``: the same with
    it; ``triton`` and ``auto`` keep theirs (no PDL). On the CPU they build (the interpreter runs them)."""
    pytest.importorskip("triton")
    from graphburst.models import llama_decode
    from graphburst.models.decode import gemv

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    ops = {k: Llama(cfg, batch=1, capacity=16, decode_kernels=k).decode_ops for k in ("triton", "gemv", "pdl")}
    assert (ops["gemv"].gemv_max_m, ops["gemv"].pdl) == (gemv.MAX_M, False)
    assert (ops["pdl"].gemv_max_m, ops["pdl"].pdl) == (gemv.MAX_M, True)
    assert ops["pdl"].linear is gemv.gemv and ops["pdl"]._replace(pdl=False) == ops["gemv"]
    assert (ops["triton"].gemv_max_m, ops["triton"].pdl) == (llama_decode.FORCED_GEMV_MAX_M, False)
    assert llama_decode.pdl_unsupported(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="gemv_max_m"):
        llama_decode.triton_ops(gemv.MAX_M + 1)


@pytest.mark.parametrize("group", ["attention", "idle", "int64", "gemv", "fused", "model", "pdl-kernels", "pdl-model"])
def test_triton_kernels_interpreted(group):
    """Every Triton kernel against its reference on awkward sizes, on the CPU (TRITON_INTERPRET=1)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "decode_interp.py"), group], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ok ")
