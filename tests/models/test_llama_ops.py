"""How many ops a Llama layer issues, so the count cannot silently grow back.

At batch 1 a captured forward is launch-bound: every op that launches a kernel is a graph
node (the unfused SDPA forward issued 37.8 kernels per layer on the H200). CPU torch stands in for the GPU here:

* **launching ops**: the top-level aten ops of a forward under ``torch.profiler``, less
  views (a top-level ``rms_norm``, ``linear`` or SDPA is one op, as it is one fused
  kernel, or one GEMM, on CUDA);
* **dispatched ops**: every op that reaches a kernel, so work hidden inside a composite
  shows (SDPA turning a boolean mask into an additive one, casts).

A layer's count is the difference between a 2-layer and a 1-layer forward. The fused decode
path (``decode_kernels`` ``gemv`` and ``pdl``) is counted in decode-op calls (its Triton
kernels) and in the torch ops it dispatches between them, which must launch nothing.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig as HFConfig
from transformers import LlamaForCausalLM

from graphburst.models.llama import Llama
from graphburst.models.llama_config import LlamaConfig
from graphburst.models.rope import apply_rope, rope_rotation, rope_tables, rotate

from marks import requires_gpu

torch.set_num_threads(1)

#: per layer: 2 rms_norm, 4 linear (qkv, o, gate_up, down), 2 RoPE (mul, sum), 1 index_copy_,
#: 1 SDPA, silu, mul, 2 residual adds. Was 28 in bf16 before the fused layer (7 linear, 4 casts,
#: cat x2, neg, stack, 5 mul, 3 add, ...).
MAX_LAUNCHING_OPS_PER_LAYER = 14
#: ops that launch nothing (metadata only)
VIEW_OPS = {"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::transpose", "aten::t", "aten::permute",
            "aten::slice", "aten::select", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unsqueeze",
            "aten::squeeze", "aten::expand", "aten::as_strided", "aten::detach", "aten::alias", "aten::unbind"}
#: dispatched ops a layer must not issue: concatenations, negation, bool-mask conversion, copies
FORBIDDEN = {"cat", "stack", "neg", "where", "scalar_tensor", "clone", "copy_", "repeat_interleave", "contiguous"}
CFG = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)


class Dispatched(TorchDispatchMode):
    """Counts every aten op reaching a kernel (below autograd and composite decompositions)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def forward_ops(layers: int, dtype, batch: int, t: int, cfg=CFG, **kw) -> tuple[Counter, Counter]:
    """(launching, dispatched) op counts of one captured-shape forward (all B rows, per-layer lengths)."""
    model = Llama(cfg.replace(num_hidden_layers=layers), batch=batch, capacity=64, dtype=dtype, **kw).init_random_(0)
    tokens = torch.randint(0, CFG.vocab_size, (batch, t), generator=torch.Generator().manual_seed(0))
    start = torch.arange(3, 3 + batch, dtype=torch.int32)
    lengths = [start] * layers
    with torch.no_grad():
        model(tokens, start, lengths)  # warm: first-call work is not the forward's
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(tokens, start, lengths)
        with Dispatched() as d:
            model(tokens, start, lengths)
    top = Counter(e.name for e in prof.events()
                  if e.cpu_parent is None and e.name.startswith("aten::") and e.name not in VIEW_OPS)
    return top, d.ops


def per_layer(dtype, batch, t, **kw) -> tuple[Counter, Counter]:
    one, two = forward_ops(1, dtype, batch, t, **kw), forward_ops(2, dtype, batch, t, **kw)
    return two[0] - one[0], two[1] - one[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch,t", [(1, 5), (3, 1)], ids=["verify_b1", "draft_b3"])
def test_launching_ops_per_layer_are_bounded(dtype, batch, t):
    launching, _ = per_layer(dtype, batch, t)
    n = sum(launching.values())
    assert n <= MAX_LAUNCHING_OPS_PER_LAYER, f"{n} launching ops per layer: {dict(launching)}"
    assert launching["aten::linear"] == 4, dict(launching)  # qkv, o, gate_up, down: one GEMM each


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_layer_dispatches_no_concat_cast_or_mask_conversion(dtype):
    _, dispatched = per_layer(dtype, 1, 5)
    assert not FORBIDDEN & set(dispatched), dict(dispatched)
    # The only casts are those this build's rms_norm issues itself (CPU upcasts bf16 inside
    # it; CUDA's fused kernel does not): none of the model's own.
    x, w = torch.randn(1, 5, CFG.hidden_size, dtype=dtype), torch.ones(CFG.hidden_size, dtype=dtype)
    with Dispatched() as norm:
        F.rms_norm(x, (CFG.hidden_size,), w, 1e-6)
    assert dispatched["_to_copy"] == 2 * norm.ops["_to_copy"], dict(dispatched)


#: a fused decode layer's calls of its ops: two add+RMSNorms, four projections (qkv, o, gate_up, down) on
#: the GEMV at these M, one RoPE + KV write, one attention (its combine is inside the call), one SiLU x up
FUSED_LAYER_CALLS = Counter(add_rmsnorm=2, linear=4, rope_kv_write=1, attention=1, silu_mul=1)
#: the folded layer's (``decode_kernels="folded"``): the norms inside qkv and gate/up, SiLU inside down
FOLDED_LAYER_CALLS = Counter(norm_linear=2, linear=1, silu_linear=1, rope_kv_write=1, attention=1)
#: dispatched ops that launch no kernel: metadata, and the stubs' own allocations
NON_LAUNCHING = {"view", "_unsafe_view", "slice", "alias", "as_strided", "empty", "empty_like", "empty_strided"}


def fused_layer_ops(choice: str, layers: int, batch: int, t: int, fold_max_m: int | None = None
                    ) -> tuple[Counter, Counter, set]:
    """(decode-op calls, dispatched torch ops, the ``pdl`` values the ops saw) of one ``decode_kernels=choice``
    forward whose ops are stubs: they allocate their outputs and compute nothing, so the torch ops counted
    are fused_forward's own (the CPU cannot launch Triton outside the interpreter). ``fold_max_m``: the
    folded ops' ``max_m`` (default ``gemv.MAX_M``: every M here folds)."""
    from graphburst.models import llama_decode
    from graphburst.models.decode.gemv import MAX_M
    from graphburst.models.decode.partial import Partial

    # built on the references (a CPU model refuses the Triton choices), then given the choice's own ops
    model = Llama(CFG.replace(num_hidden_layers=layers), batch=batch, capacity=64,
                  decode_kernels="reference").init_random_(0)
    calls, flags = Counter(), set()

    def stub(name, make):
        def call(*args, pdl=False, **kw):
            calls[name] += 1
            flags.add(pdl)
            return make(*args)
        return call

    def out(x, w):  # a projection's output, allocated and not computed
        return torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)

    attention = stub("attention", lambda q, *_: torch.empty(q.shape, dtype=q.dtype))
    if choice == "folded":
        model.decode_ops = llama_decode.folded_ops(max_m=MAX_M if fold_max_m is None else fold_max_m)._replace(
            add_rmsnorm=stub("add_rmsnorm", lambda x, *_: torch.empty_like(x)),
            silu_mul=stub("silu_mul", lambda gu, *_: torch.empty(gu.shape[0], gu.shape[1] // 2, dtype=gu.dtype)),
            norm_linear=stub("norm_linear", lambda x, d, nw, eps, w, *_: (Partial.whole(out(x, w)), x)),
            linear=stub("linear", lambda x, w, *_: Partial.whole(out(x, w))),
            silu_linear=stub("silu_linear", lambda gu, w, *_: Partial.whole(torch.empty(gu.shape[0], w.shape[0]))),
            rope_kv_write=stub("rope_kv_write", lambda qkv, cos, sin, pos, length, kv, h, t: torch.empty(
                qkv.shape[0] // t, t, h, kv.shape[4])),
            attention=attention, materialize=stub("materialize", lambda p: p.parts))
    else:
        model.decode_ops = llama_decode.gemv_ops(pdl=choice == "pdl")._replace(
            add_rmsnorm=stub("add_rmsnorm", lambda x, *_: torch.empty_like(x)),
            linear=stub("linear", lambda x, w, *_: out(x, w)), rope_kv_write=stub("rope_kv_write", lambda *_: None),
            attention=attention,
            silu_mul=stub("silu_mul", lambda gu, *_: torch.empty(gu.shape[0], gu.shape[1] // 2, dtype=gu.dtype)))
    tokens = torch.randint(0, CFG.vocab_size, (batch, t), generator=torch.Generator().manual_seed(0))
    start = torch.arange(3, 3 + batch, dtype=torch.int32)
    with torch.no_grad(), Dispatched() as d:
        model(tokens, start, [start] * layers)
    return calls, d.ops, flags


@pytest.mark.parametrize("choice", ["gemv", "pdl", "folded"])
@pytest.mark.parametrize("batch,t", [(1, 5), (3, 1)], ids=["verify_b1", "draft_b3"])
def test_a_fused_layer_is_its_decode_ops_and_nothing_between(choice, batch, t):
    """Per layer: FUSED_LAYER_CALLS (FOLDED_LAYER_CALLS) and no torch op that launches a kernel. Under PDL each
    kernel overlaps the one before; a torch kernel between two would end the overlap there (and one is the price
    of Qwen3's q/k norms, not of a Llama layer)."""
    pytest.importorskip("triton")
    one, two = fused_layer_ops(choice, 1, batch, t), fused_layer_ops(choice, 2, batch, t)
    want = FOLDED_LAYER_CALLS if choice == "folded" else FUSED_LAYER_CALLS
    assert two[0] - one[0] == want, dict(two[0] - one[0])
    launching = {op for op, n in (two[1] - one[1]).items() if n and op not in NON_LAUNCHING}
    assert not launching, dict(two[1] - one[1])
    assert one[2] == two[2] == {choice != "gemv"}  # every op launched with PDL, or none


#: the default folded layer past one row: the unfolded kernels, the four projections on cuBLAS (``nn.Linear``)
UNFOLDED_LAYER_CALLS = Counter(add_rmsnorm=2, rope_kv_write=1, attention=1, silu_mul=1, materialize=3)


def test_the_default_folded_layer_folds_one_row_only():
    """``folded_ops()`` folds at M = 1; at M = 3 (a draft of three slots) and 5 (a verify) its layer is the
    unfolded one, the projections on cuBLAS (mm) between its kernels."""
    pytest.importorskip("triton")
    from graphburst.models import llama_decode

    fold_max_m = llama_decode.folded_ops().max_m
    assert fold_max_m == 1
    one, two = fused_layer_ops("folded", 1, 1, 1, fold_max_m), fused_layer_ops("folded", 2, 1, 1, fold_max_m)
    assert two[0] - one[0] == FOLDED_LAYER_CALLS, dict(two[0] - one[0])
    for batch, t in ((3, 1), (1, 5)):
        one, two = (fused_layer_ops("folded", n, batch, t, fold_max_m) for n in (1, 2))
        assert two[0] - one[0] == UNFOLDED_LAYER_CALLS, dict(two[0] - one[0])
        mms = sum(n for op, n in (two[1] - one[1]).items() if op in ("mm", "addmm"))
        assert mms == 4, dict(two[1] - one[1])


def test_the_counter_sees_the_plain_rope_as_more_ops():
    """The counting itself can fail: HF's formula issues more ops than the two of ``rotate``."""
    cos, sin = rope_tables(CFG, 8, "cpu")
    x = torch.randn(1, 8, 6, CFG.head_dim)
    c, s = cos[None], sin[None]
    m = rope_rotation(c, s, 4, 2)
    with Dispatched() as plain:
        apply_rope(x[:, :, :4], c, s)
    with Dispatched() as fused:
        rotate(x, m)
    assert sum(fused.ops.values()) - fused.ops["view"] == 2
    assert {"cat", "neg"} <= set(plain.ops) and sum(plain.ops.values()) > 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}],
                         ids=["default", "llama3"])
def test_rotate_is_bit_identical_to_rotate_half(dtype, scaling):
    """q and k heads equal HF's ``x*cos + rotate_half(x)*sin`` bit for bit; v heads pass unchanged."""
    cfg = CFG.replace(rope_scaling=scaling, rope_theta=500000.0)
    cos, sin = rope_tables(cfg, 300, "cpu")
    gen = torch.Generator().manual_seed(3)
    pos = torch.randint(0, 300, (3, 7), generator=gen)
    c, s = cos[pos].to(dtype), sin[pos].to(dtype)
    x = (torch.randn(3, 7, 8, cfg.head_dim, generator=gen) * 4).to(dtype)
    got = rotate(x, rope_rotation(c, s, 6, 2))
    assert torch.equal(got[:, :, :6], apply_rope(x[:, :, :6], c, s))
    assert torch.equal(got[:, :, 6:], x[:, :, 6:])


def test_hf_tensors_are_views_named_as_transformers_names_them():
    cfg = HFConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, attention_bias=True)
    want = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    model = Llama(LlamaConfig.from_hf(cfg.to_dict()), batch=1, capacity=8).init_random_(0)
    parts = model.hf_tensors()
    ours = {("lm_head." + n[8:] if n.startswith("lm_head.") else "model." + n): tuple(t.shape)
            for n, t in parts.items()}
    assert ours == want
    qkv = model.layers[1].self_attn.qkv_proj
    with torch.no_grad():
        parts["layers.1.self_attn.k_proj.bias"].fill_(7.0)
        parts["layers.1.mlp.up_proj.weight"][0, 0] = 5.0
    h, kv = 4 * 16, 2 * 16
    assert torch.all(qkv.bias[h:h + kv] == 7.0) and not torch.any(qkv.bias[:h] == 7.0)
    assert model.layers[1].mlp.gate_up_proj.weight[128, 0] == 5.0


def test_folded_gqa_is_the_same_function_and_copy_free_at_t1():
    """``fold_gqa``: the same logits (other SDPA shapes, so up to rounding) and KV, and no copies at T = 1."""
    cfg = CFG.replace(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    plain = Llama(cfg, batch=3, capacity=64).init_random_(4)
    fold = Llama(cfg, batch=3, capacity=64, fold_gqa=True).init_random_(4)
    gen = torch.Generator().manual_seed(4)
    zero = torch.zeros(3, dtype=torch.int32)
    start = torch.tensor([20, 13, 6], dtype=torch.int32)
    with torch.no_grad():
        for tokens, at in [(torch.randint(0, 512, (3, 20), generator=gen), zero),
                           (torch.randint(0, 512, (3, 5), generator=gen), start),
                           (torch.randint(0, 512, (3, 1), generator=gen), start)]:
            want, got = plain(tokens, at, [at] * 2), fold(tokens, at, [at] * 2)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain.kv, fold.kv))
    launching, dispatched = per_layer(torch.float32, 3, 1, cfg=cfg, fold_gqa=True)
    assert not FORBIDDEN & set(dispatched), dict(dispatched)
    assert sum(launching.values()) <= MAX_LAUNCHING_OPS_PER_LAYER, dict(launching)


def test_deterministic_attention_is_the_same_function_through_the_pinned_kernels(monkeypatch):
    """``deterministic_attention``: folded groups, SDPA only under DETERMINISTIC_SDPA, the
    same logits as the default up to rounding; the backend flags are restored after."""
    from torch.nn.attention import SDPBackend

    from graphburst.models import llama as llama_mod
    from graphburst.models import llama_layers

    cfg = CFG.replace(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    plain = Llama(cfg, batch=3, capacity=64).init_random_(5)
    det = Llama(cfg, batch=3, capacity=64, deterministic_attention=True).init_random_(5)
    assert all(b.self_attn.fold and b.self_attn.backends == llama_layers.DETERMINISTIC_SDPA for b in det.layers)
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*a, **kw):  # which backends SDPA may pick at each call
        seen.append((torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled(),
                     torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
        return real(*a, **kw)
    monkeypatch.setattr(llama_mod.F, "scaled_dot_product_attention", spy)
    before = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled())
    start = torch.tensor([20, 13, 6], dtype=torch.int32)
    tokens = torch.randint(0, 512, (3, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = plain(tokens, start, [start] * 2)
        seen.clear()
        got = det(tokens, start, [start] * 2)
    assert SDPBackend.EFFICIENT_ATTENTION in llama_layers.DETERMINISTIC_SDPA
    assert seen == [(False, False, True, True)] * 2  # flash and cuDNN off inside both layers
    assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()) == before
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kind", ["gqa", "fold", "deterministic"])
def test_a_fresh_prefill_is_the_masked_prefill_over_its_own_tokens(monkeypatch, kind):
    """``fresh=True`` (every row at position 0): the same logits up to rounding and the same
    KV as the masked forward over each slot's capacity; SDPA sees no mask (causal) unless
    folded, and cuDNN is off inside it (PREFILL_SDPA) unless the model pins its own kernels."""
    from graphburst.models import llama as llama_mod

    cfg = CFG.replace(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    kw = {"gqa": {}, "fold": {"fold_gqa": True}, "deterministic": {"deterministic_attention": True}}[kind]
    masked, fresh = (Llama(cfg, batch=4, capacity=64, **kw).init_random_(7) for _ in range(2))
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*a, **kwargs):
        seen.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal", False),
                     torch.backends.cuda.cudnn_sdp_enabled(), a[1].shape[2]))
        return real(*a, **kwargs)
    monkeypatch.setattr(llama_mod.F, "scaled_dot_product_attention", spy)
    tokens = torch.randint(0, 512, (3, 19), generator=torch.Generator().manual_seed(7))
    rows = torch.tensor([3, 0, 2])
    zero = torch.zeros(3, dtype=torch.int32)
    with torch.no_grad():
        want = masked(tokens, zero, [zero] * 2, rows)
        seen.clear()
        got = fresh(tokens, zero, [zero] * 2, rows, fresh=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(masked.kv[0][:, rows, :19], fresh.kv[0][:, rows, :19])  # layer 0 sees the same inputs
    torch.testing.assert_close(fresh.kv[1][:, rows, :19], masked.kv[1][:, rows, :19], atol=1e-5, rtol=1e-5)
    folded = kind != "gqa"
    # keys: the 19 new tokens, not the 64-row capacity; no mask and causal unless folded
    assert seen == [(not folded, not folded, False, 19)] * 2, seen  # cuDNN off in all three


# ---------------------------------------------------------------------- GPU (H200)

@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("fold", [False, True], ids=["gqa", "fold"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [5, 1])
def test_gpu_forward_captures_and_replays_bit_identically(dtype, fold, t):
    """A forward captures (torch.cuda.graph) and replays what eager computes; RoPE on CUDA equals rotate_half."""
    dev = "cuda"
    cfg = CFG.replace(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                      hidden_size=128, intermediate_size=256)
    model = Llama(cfg, batch=3, capacity=64, dtype=dtype, device=dev, fold_gqa=fold).init_random_(2)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (3, t), generator=gen).to(dev)
    start = torch.tensor([20, 13, 6], dtype=torch.int32, device=dev)
    with torch.no_grad():
        eager = model(tokens, start, [start] * 2)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(tokens, start, [start] * 2)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(tokens, start, [start] * 2)
        graph.replay()
        first = out.clone()
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, first)  # a replay is deterministic
    # cuBLAS may pick another algorithm under capture (another workspace): equal up to rounding.
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, eager, atol=tol, rtol=tol)
    cos, sin = rope_tables(cfg, 64, dev)
    pos = torch.randint(0, 64, (3, t), generator=gen).to(dev)
    c, s = cos[pos].to(dtype), sin[pos].to(dtype)
    x = torch.randn(3, t, 12, 16, generator=gen).to(dev, dtype)
    assert torch.equal(rotate(x, rope_rotation(c, s, 10, 2))[:, :, :10], apply_rope(x[:, :, :10], c, s))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [5, 1])
def test_gpu_deterministic_attention_runs_the_memory_efficient_kernel_not_cudnn(t):
    """bf16 on the H200: torch's default attention is cuDNN's; ``deterministic_attention`` runs
    the memory-efficient kernel instead, and equals the default up to bf16 rounding."""
    dev = "cuda"
    cfg = CFG.replace(num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      hidden_size=512, intermediate_size=256)

    def kernels(model, tokens, start):
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = model(tokens, start, [start])
            torch.cuda.synchronize()
        return out, " ".join(ev.name for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)

    # decode_kernels="off": this test is about which SDPA kernel runs (the fused decode path has no SDPA).
    plain = Llama(cfg, batch=2, capacity=256, dtype=torch.bfloat16, device=dev, decode_kernels="off").init_random_(6)
    det = Llama(cfg, batch=2, capacity=256, dtype=torch.bfloat16, device=dev,
                deterministic_attention=True).init_random_(6)
    tokens = torch.randint(0, cfg.vocab_size, (2, t), device=dev)
    start = torch.tensor([100, 37], dtype=torch.int32, device=dev)
    want, names_plain = kernels(plain, tokens, start)
    got, names_det = kernels(det, tokens, start)
    assert "cudnn" in names_plain.lower()  # the default this option avoids (if torch stops picking it, revisit)
    assert "cudnn" not in names_det.lower() and "fmha" in names_det.lower(), names_det
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@requires_gpu
def test_gpu_a_fresh_prefill_runs_flash_attention_not_cudnn():
    """bf16 prompts at position 0 on the H200: flash attention over the prompt's own tokens,
    not cuDNN over each slot's capacity, and the same logits up to bf16 rounding."""
    dev = "cuda"
    cfg = CFG.replace(num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      hidden_size=512, intermediate_size=256)
    model = Llama(cfg, batch=4, capacity=512, dtype=torch.bfloat16, device=dev, decode_kernels="off").init_random_(8)
    tokens = torch.randint(0, cfg.vocab_size, (3, 257), device=dev)
    rows = torch.tensor([1, 3, 0], device=dev)
    zero = torch.zeros(3, dtype=torch.int32, device=dev)
    with torch.no_grad():
        want = model(tokens, zero, [zero], rows)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = model(tokens, zero, [zero], rows, fresh=True)
            torch.cuda.synchronize()
    names = " ".join(ev.name for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA).lower()
    assert "cudnn" not in names and "flash" in names, names
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@requires_gpu
def test_gpu_a_float32_gqa_prompt_never_materialises_its_scores():
    """float32 with grouped KV heads on the H200: torch's GQA path there is the math kernel, whose
    [R, H, T, T] scores grow with the square of the prompt. The layer repeats the KV heads and runs
    the memory-efficient kernel instead: the peak stays far below one copy of the scores, and the
    logits equal the math kernel's (the same attention, another summation order)."""
    dev = "cuda"
    cfg = CFG.replace(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      hidden_size=64, intermediate_size=128)
    t = 4096
    model = Llama(cfg, batch=1, capacity=t, dtype=torch.float32, device=dev, decode_kernels="off").init_random_(3)
    tokens = torch.randint(0, cfg.vocab_size, (1, t), device=dev)
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    scores = cfg.num_attention_heads * t * t * 4  # one float32 copy of the scores: 256 MiB
    with torch.no_grad():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        got = model(tokens, zero, [zero], fresh=True, logits_at=torch.tensor([t - 1], device=dev))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        q = torch.randn(1, cfg.num_attention_heads, t, 16, device=dev)
        kv = torch.randn(2, 1, cfg.num_key_value_heads, t, 16, device=dev)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            want = F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=True, enable_gqa=True)
        y = model.layers[0].self_attn._attend(q.transpose(1, 2), kv[0].transpose(1, 2), kv[1].transpose(1, 2),
                                               None, 1, t).transpose(1, 2)
    assert got.shape[-1] == cfg.vocab_size and torch.isfinite(got).all()
    assert peak < scores // 2, (peak, scores)  # the math kernel holds the scores and their softmax
    torch.testing.assert_close(y, want, atol=2e-5, rtol=2e-5)
