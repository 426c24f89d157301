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


def test_folded_refs_are_the_unfolded_ops():
    """A Partial's dense value is its partials summed in split order plus the bias, rounded once; the folded
    references are the unfolded ones in sequence (norm then linear, SiLU then linear, RoPE then q)."""
    from graphburst.models.decode.partial import WHOLE, Partial, dense

    gen = torch.Generator().manual_seed(0)
    parts, bias = torch.randn(3, 5, 40, generator=gen), torch.randn(40, generator=gen).bfloat16()
    p = Partial(parts, 3, bias, torch.bfloat16)
    assert p.shape == (5, 40)
    assert torch.equal(dense(p), (parts[0] + parts[1] + parts[2] + bias.float()).bfloat16())
    y = torch.randn(5, 40, generator=gen)
    assert Partial.whole(y).splits == WHOLE and dense(Partial.whole(y)) is y
    x, w, nw = torch.randn(5, 40, generator=gen), torch.randn(24, 40, generator=gen), torch.rand(40, generator=gen)
    delta = Partial(parts, 3, None, torch.float32)
    out, res = decode_reference.norm_linear_ref(x, delta, nw, 1e-5, w)
    h = x.clone()
    want = decode_reference.linear_ref(decode_reference.add_rmsnorm_ref(h, dense(delta), nw, 1e-5), w)
    assert torch.equal(res, h) and torch.equal(dense(out), want) and not torch.equal(x, h)
    out, res = decode_reference.norm_linear_ref(x, None, nw, 1e-5, w)
    assert res is x and torch.equal(dense(out), decode_reference.linear_ref(F.rms_norm(x, (40,), nw, 1e-5), w))
    gu = Partial(torch.randn(2, 5, 48, generator=gen), 2, None, torch.float32)
    torch.testing.assert_close(dense(decode_reference.silu_linear_ref(gu, w[:, :24])),
                               F.linear(F.silu(dense(gu)[:, :24]) * dense(gu)[:, 24:], w[:, :24]))
    b, t, hq, kvh, d = 2, 3, 4, 2, 16
    qkv = torch.randn(b * t, (hq + 2 * kvh) * d, generator=gen)
    ang = torch.rand(40, d // 2, generator=gen)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    start, length = torch.tensor([3, 9], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    kv, kv_want = torch.zeros(2, b, 16, kvh, d), torch.zeros(2, b, 16, kvh, d)
    q = decode_reference.folded_rope_kv_write_ref(Partial.whole(qkv), cos, sin, start, length, kv, hq, t)
    full = qkv.view(b, t, hq + 2 * kvh, d).clone()
    decode_reference.rope_kv_write_ref(full, cos, sin, start, length, kv_want, hq)
    assert torch.equal(q, full[:, :, :hq]) and torch.equal(kv, kv_want)


@pytest.mark.parametrize("switches", [dict(), dict(qkv_bias=True), dict(qk_norm=True)],
                         ids=["llama", "qwen2-bias", "qwen3-qk-norm"])
def test_folded_reference_path_matches_sdpa(switches):
    """The folded forward's wiring (the residual passed on, deltas into the next norm, SiLU into down, q out of
    RoPE, the final norm into the head) on the references, fp32; T = MAX_K + 1 takes the unfolded fallback."""
    from graphburst.models import llama_decode

    dc.check_model("reference", "cpu", torch.float32, ts=(1, 5, MAX_K + 1), ops=llama_decode.folded_reference_ops(),
                   **switches)


def _recorded(ops, seen: list):
    """``ops`` with every op recording (name, its ``pdl``) into ``seen`` before it runs."""
    def record(name, fn):
        def call(*args, **kw):
            seen.append((name, kw.get("pdl")))
            return fn(*args, **kw)
        return call
    names = [f for f in ops._fields if callable(getattr(ops, f))]
    return ops._replace(**{name: record(name, getattr(ops, name)) for name in names})


@pytest.mark.parametrize("pdl", [False, True])
def test_folded_forward_runs_six_ops_a_layer(pdl):
    """Per layer at M <= max_m: norm + qkv, RoPE, attention, o_proj, norm + gate/up, SiLU + down, each with
    ``pdl=ops.pdl``; then norm + head and the head's materialize. A hooked o_proj keeps its module call (the
    hook runs) and the next norm still folds; past max_m the norms and SiLU run on their own."""
    from graphburst.models import llama_decode

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = Llama(cfg, batch=2, capacity=16, decode_kernels="reference").init_random_(0)
    seen, hooked = [], []
    model.decode_ops = _recorded(llama_decode.folded_reference_ops()._replace(pdl=pdl), seen)
    start = torch.zeros(2, dtype=torch.int32)
    tokens = torch.zeros(2, 3, dtype=torch.long)  # M = 6
    per_layer = ["norm_linear", "rope_kv_write", "attention", "linear", "norm_linear", "silu_linear"]
    with torch.no_grad():
        model(tokens, start, [start] * 2)
        assert [name for name, _ in seen] == per_layer * 2 + ["norm_linear", "materialize"]
        assert {flag for _, flag in seen} == {pdl}
        seen.clear()
        model.layers[0].self_attn.o_proj.register_forward_hook(lambda mod, inp, out: hooked.append(out.shape))
        model(tokens, start, [start] * 2)
        assert hooked == [(6, 32)]
        assert [name for name, _ in seen] == [n for n in per_layer if n != "linear"] + per_layer + \
            ["norm_linear", "materialize"]
        seen.clear()
        model.decode_ops = model.decode_ops._replace(max_m=5)  # M = 6 > 5: nothing folds
        model(tokens, start, [start] * 2)
    # each norm and SiLU on its own (a whole Partial's materialize launches nothing); no fold
    layer = ["add_rmsnorm", "rope_kv_write", "attention", "materialize", "add_rmsnorm", "materialize", "silu_mul"]
    head = ["materialize", "add_rmsnorm", "materialize"]
    assert [name for name, _ in seen] == layer + ["materialize"] + layer + head


def test_folded_forward_under_tensor_parallel_hooks_matches_sdpa():
    """Forward hooks on every o_proj and down_proj (where tensor parallelism all-reduces): those keep their module
    calls, down's input is SiLU x up of the materialised gate/up, the norms after them still fold; logits and
    every KV row equal SDPA's, and the hooks saw every call."""
    from graphburst.models import llama_decode

    models = dc.model_pair(("off", "reference"), "cpu", torch.float32, batch=3, heads=6, kv_heads=2)
    models[1].decode_ops = llama_decode.folded_reference_ops()
    calls = []
    for block in models[1].layers:
        for proj in (block.self_attn.o_proj, block.mlp.down_proj):
            proj.register_forward_hook(lambda mod, inp, out: calls.append(out.shape))
    for t, ((want, want_kv), (got, got_kv)) in dc.model_forwards(models, "cpu", torch.float32, (1, 5)):
        torch.testing.assert_close(got, want, **dc.TOL[torch.float32], msg=lambda m: f"T={t} logits: {m}")
        for a, b in zip(want_kv, got_kv):
            torch.testing.assert_close(b, a, **dc.TOL[torch.float32], msg=lambda m: f"T={t} kv: {m}")
    assert calls == [(3 * t, 128) for t in (1, 5) for _ in range(2 * 2)]


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
    for choice in ("gemv", "pdl", "folded"):
        with pytest.raises(ValueError, match="head_dim 12"):
            Llama(cfg, batch=1, capacity=16, decode_kernels=choice)
    with pytest.raises(ValueError, match="decode_kernels"):
        Llama(cfg, batch=1, capacity=16, decode_kernels="fast")


def test_gemv_and_pdl_choices_are_the_gemv_path_with_and_without_pdl():
    """``gemv``: every projection and the head on the GEMV up to its row tile, no PDL; ``pdl``: the same with
    it; ``folded`` the folded layer with it. A model on the CPU refuses them outside Triton's interpreter (they
    would fail at their first forward); the interpreter's groups build them (``decode_interp.py``)."""
    pytest.importorskip("triton")
    from graphburst.models import llama_decode
    from graphburst.models.decode import gemv

    ops = {"gemv": llama_decode.gemv_ops(), "pdl": llama_decode.gemv_ops(pdl=True)}
    assert (ops["gemv"].gemv_max_m, ops["gemv"].pdl) == (gemv.MAX_M, False)
    assert (ops["pdl"].gemv_max_m, ops["pdl"].pdl) == (gemv.MAX_M, True)
    assert ops["pdl"].linear is gemv.gemv and ops["pdl"]._replace(pdl=False) == ops["gemv"]
    assert llama_decode.pdl_unsupported(torch.device("cpu")) is None
    folded = llama_decode.folded_ops()
    assert isinstance(folded, llama_decode.FoldedOps) and (folded.max_m, folded.pdl) == (gemv.FMA_MAX_M, True)
    assert llama_decode.folded_ops(max_m=gemv.MAX_M).max_m == gemv.MAX_M
    for bad in (-1, gemv.MAX_M + 1):
        with pytest.raises(ValueError, match=f"max_m must be in .*got {bad}"):
            llama_decode.folded_ops(max_m=bad)
    with pytest.raises(ValueError, match="gemv_max_m"):
        llama_decode.triton_ops(gemv.MAX_M + 1)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    for choice in ("gemv", "pdl", "folded"):
        with pytest.raises(ValueError, match=f"decode_kernels='{choice}' runs Triton kernels.*TRITON_INTERPRET"):
            Llama(cfg, batch=1, capacity=16, decode_kernels=choice)


@pytest.mark.parametrize("group", ["attention", "idle", "int64", "gemv", "fused", "model", "pdl-kernels", "pdl-model",
                                   "folded", "folded-model"])
def test_triton_kernels_interpreted(group):
    """Every Triton kernel against its reference on awkward sizes, on the CPU (TRITON_INTERPRET=1)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "decode_interp.py"), group], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ok ")
