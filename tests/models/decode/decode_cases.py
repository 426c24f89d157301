"""Awkward-size cases for the decode kernels, shared by the CPU (Triton interpreter) and GPU tests.

Each check builds inputs on ``device``, runs a kernel from ``graphburst.kernels`` and its
plain-torch reference from ``decode.reference`` and raises AssertionError on a mismatch. KV rows
past each sequence's ``length + T`` are poisoned with NaN (and +inf), so a kernel that
reads them fails.
"""

from __future__ import annotations

import itertools

import torch

from graphburst.constants import MAX_K
from graphburst.models.decode import reference as decode_reference

#: KV capacity of the cases (lengths 0, 1, 63 and CAPACITY - 1); rows = CAPACITY + slack
CAPACITY = 96
ROWS = CAPACITY + MAX_K + 2
LENGTHS = (0, 1, 63, CAPACITY - 1)
#: fp32 within float rounding; bf16 within two bf16 ulps of values ~1 (one rounding of p and of the output)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

#: (B, T, KV heads, group, head_dim, dtype, splits): every B, group and head_dim, T from 1 to MAX_K + 1,
#: single and split KV; small enough for Triton's CPU interpreter
CI_ATTENTION = [
    (1, 1, 1, 8, 128, torch.float32, 4), (3, 1, 2, 4, 64, torch.bfloat16, 2), (19, 1, 2, 1, 64, torch.float32, 1),
    (1, 5, 2, 4, 64, torch.bfloat16, 4), (3, 2, 1, 8, 128, torch.float32, 1), (19, 3, 1, 1, 64, torch.bfloat16, 2),
    (1, MAX_K + 1, 1, 4, 64, torch.float32, 2), (3, MAX_K + 1, 1, 1, 128, torch.bfloat16, 1),
    (1, 33, 2, 8, 64, torch.float32, 4), (3, 4, 2, 8, 64, torch.float32, None),
]


def gpu_attention_cases() -> list:
    """Every T in 1..MAX_K + 1 against every B and group; head_dim and dtype rotate; default splits.

    (The split counts 1, 2 and 4 are in CI_ATTENTION; each distinct split count, group,
    head_dim and dtype is one more Triton compile, so the rotation keeps them few.)
    """
    out = []
    for t in range(1, MAX_K + 2):
        for j, (b, g) in enumerate(itertools.product((1, 3, 19), (1, 4, 8))):
            d = (64, 128)[(t + j) % 2]
            dtype = (torch.float32, torch.bfloat16)[(t // 2 + j) % 2]
            out.append((b, t, 2 if b > 1 else 1, g, d, dtype, None))
    return out


def lengths_for(b: int, t: int, salt: int = 0) -> torch.Tensor:
    """[b] int32 cycling through LENGTHS (B = 1 takes one of them by ``salt``)."""
    return torch.tensor([LENGTHS[(i + salt) % len(LENGTHS)] for i in range(b)], dtype=torch.int32)


def poison_tail(kv: torch.Tensor, length: torch.Tensor, t: int) -> None:
    """NaN in every row a forward of T tokens must not read (rows >= length + T), +inf in the first."""
    for i, n in enumerate(length.tolist()):
        kv[:, i, n + t:] = float("nan")
        if n + t < kv.shape[2]:
            kv[:, i, n + t] = float("inf")


#: an idle slot's length may be a sentinel: the kernels read it as 0 (and stay finite)
IDLE_LENGTHS = (-1, 5, -(2**31))
#: (T, dtype, splits) of the idle-slot cases; split KV too (the combine is where a NaN would come from)
CI_IDLE = [(1, torch.float32, 4), (3, torch.bfloat16, 2), (2, torch.float32, 1)]


def check_attention(attention, case, device, seed: int = 0, length: torch.Tensor | None = None) -> None:
    """``length``: [B] int32 to use instead of :func:`lengths_for` (negative: an idle slot, read as 0)."""
    b, t, kvh, g, d, dtype, splits = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, kvh * g, d, generator=gen).to(dtype).to(device)
    kv = torch.randn(2, b, ROWS, kvh, d, generator=gen).to(dtype)
    length = lengths_for(b, t, seed) if length is None else length
    poison_tail(kv, length.clamp(min=0), t)
    kv, length = kv.to(device), length.to(device)
    got = attention(q, kv, length, splits=splits)
    want = decode_reference.decode_attention_ref(q, kv, length)
    assert torch.isfinite(got.float()).all(), f"non-finite output for {case}"
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype], msg=lambda m: f"{case}: {m}")


def check_attention_idle(attention, case, device, seed: int = 0) -> None:
    """B = 3 with lengths IDLE_LENGTHS: finite, and equal to the reference (which reads them as 0)."""
    t, dtype, splits = case
    check_attention(attention, (len(IDLE_LENGTHS), t, 2, 4, 64, dtype, splits), device, seed,
                    length=torch.tensor(IDLE_LENGTHS, dtype=torch.int32))


#: rows per sequence of the int64 case: batch index 2 times the batch stride (2^24 rows x 64) is 2^31 elements
HUGE_ROWS = 2**24


def check_int64_offsets(attention, rope_kv_write, device) -> None:
    """A bf16 cache of 3 x 2^24 rows (12.9 GB, untouched but for a few rows: the CPU commits only those pages)
    where sequence 2 starts at element 2^31: the RoPE write and the attention reach its rows, not a wrapped
    int32 offset. Held to the same kernels on a small copy of the rows they touch, and to the reference."""
    b, t, h, kvh, d, small = 3, 2, 4, 1, 64, 32
    gen = torch.Generator().manual_seed(7)
    length = torch.tensor([5, 0, 9], dtype=torch.int32)
    kv_small = torch.randn(2, b, small, kvh, d, generator=gen).to(torch.bfloat16)
    poison_tail(kv_small, length, t)
    qkv = torch.randn(b, t, h + 2 * kvh, d, generator=gen).to(torch.bfloat16).to(device)
    ang = torch.rand(small, d // 2, generator=gen)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(device), torch.cat((ang.sin(), ang.sin()), -1).to(device)
    kv = torch.empty(2, b, HUGE_ROWS, kvh, d, dtype=torch.bfloat16, device=device)
    assert (b - 1) * kv.stride(1) == 2**31 and kv.stride(1) < 2**31  # an int32 product wraps; the stride does not
    kv_small, length = kv_small.to(device), length.to(device)
    kv[:, :, :small] = kv_small
    qkv_small = qkv.clone()
    rope_kv_write(qkv, cos, sin, length, length, kv, h)
    rope_kv_write(qkv_small, cos, sin, length, length, kv_small, h)
    torch.testing.assert_close(kv[:, :, :small].float(), kv_small.float(), rtol=0, atol=0, equal_nan=True)
    for splits in (1, 2):
        got = attention(qkv[:, :, :h], kv, length, splits=splits)
        want = decode_reference.decode_attention_ref(qkv_small[:, :, :h], kv_small, length)
        assert torch.isfinite(got.float()).all(), f"non-finite output, splits {splits}"
        torch.testing.assert_close(got.float(), want.float(), **TOL[torch.bfloat16],
                                   msg=lambda m: f"splits {splits}: {m}")


#: (rows R, hidden N, dtype, with residual)
CI_NORM = [(1, 64, torch.float32, False), (7, 96, torch.float32, True), (19, 2048, torch.bfloat16, True),
           (3, 257, torch.bfloat16, False)]


def check_add_rmsnorm(add_rmsnorm, case, device, seed: int = 0) -> None:
    r, n, dtype, has_res = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(r, n, generator=gen).to(dtype).to(device)
    res = torch.randn(r, n, generator=gen).to(dtype).to(device) if has_res else None
    w = torch.randn(n, generator=gen).to(dtype).to(device)
    x_ref = x.clone()
    got = add_rmsnorm(x, res, w, 1e-5)
    want = decode_reference.add_rmsnorm_ref(x_ref, res, w, 1e-5)
    torch.testing.assert_close(x.float(), x_ref.float(), **TOL[dtype], msg=lambda m: f"{case} residual: {m}")
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype], msg=lambda m: f"{case}: {m}")


#: (B, T, H, KV heads, head_dim, dtype)
CI_ROPE = [(1, 1, 8, 1, 128, torch.float32), (3, 5, 4, 1, 64, torch.bfloat16), (19, 2, 8, 8, 64, torch.float32),
           (3, MAX_K + 1, 8, 2, 64, torch.float32)]


def check_rope_kv_write(rope_kv_write, case, device, seed: int = 0) -> None:
    b, t, h, kvh, d, dtype = case
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, t, h + 2 * kvh, d, generator=gen).to(dtype).to(device)
    ang = torch.rand(ROWS, d // 2, generator=gen) * 6.0
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(device), torch.cat((ang.sin(), ang.sin()), -1).to(device)
    start = (lengths_for(b, t, seed) + 3).to(device)  # positions differ from the rows written
    length = lengths_for(b, t, seed + 1).to(device)
    kv = torch.full((2, b, ROWS, kvh, d), float("nan"), dtype=dtype, device=device)  # untouched rows stay NaN
    qkv_ref, kv_ref = qkv.clone(), kv.clone()
    rope_kv_write(qkv, cos, sin, start, length, kv, h)
    decode_reference.rope_kv_write_ref(qkv_ref, cos, sin, start, length, kv_ref, h)
    torch.testing.assert_close(qkv.float(), qkv_ref.float(), **TOL[dtype], msg=lambda m: f"{case} q: {m}")
    torch.testing.assert_close(kv.float(), kv_ref.float(), **TOL[dtype], equal_nan=True,
                               msg=lambda m: f"{case} kv: {m}")


#: (rows R, F, dtype)
CI_SILU = [(1, 64, torch.float32), (7, 1000, torch.bfloat16), (19, 2050, torch.float32)]


def check_silu_mul(silu_mul, case, device, seed: int = 0) -> None:
    r, f, dtype = case
    gu = torch.randn(r, 2 * f, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
    torch.testing.assert_close(silu_mul(gu).float(), decode_reference.silu_mul_ref(gu).float(), **TOL[dtype],
                               msg=lambda m: f"{case}: {m}")


def model_pair(kernels, device, dtype=torch.float32, batch: int = 3, heads: int = 8, kv_heads: int = 2,
               **switches) -> list:
    """2-layer Llamas of the same random weights, one per entry of ``kernels`` (``decode_kernels`` choices).

    ``heads`` / ``kv_heads`` set the GQA group. ``switches``: architecture switches of LlamaConfig
    (``qkv_bias``, ``qk_norm``), whose biases and norm weights are drawn away from 0 and 1 so they
    change the function.
    """
    from graphburst.models.llama import Llama
    from graphburst.models.llama_config import LlamaConfig

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64, **switches)
    models = [Llama(cfg, batch=batch, capacity=CAPACITY, dtype=dtype, device=device, decode_kernels=k).init_random_(0)
              for k in kernels]
    for m in models:
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, t in m.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
                elif name.endswith("bias"):
                    t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
    return models


def model_forwards(models, device, dtype, ts, seed: int = 1):
    """Per T of ``ts``: (T, [(logits, [KV per layer]) per model]) of one forward of every model from the same
    tokens, positions and KV (rows ``>= length`` of every slot random, lengths 0, 7 and CAPACITY - T in turn)."""
    batch, layers = models[0].batch, len(models[0].layers)
    gen = torch.Generator().manual_seed(seed)
    for t in ts:
        tokens = torch.randint(0, models[0].vocab, (batch, t), generator=gen).to(device)
        start = torch.tensor([(0, 7, CAPACITY - t)[i % 3] for i in range(batch)], dtype=torch.int32, device=device)
        fill = torch.randn(models[0].kv[0].shape, generator=gen).to(dtype)
        outs = []
        for m in models:
            for kv in m.kv:
                kv.copy_(fill)
            busy(device)  # the forward's launches queue up, then run back to back
            with torch.no_grad():
                outs.append((m(tokens, start, [start] * layers), [kv.clone() for kv in m.kv]))
        yield t, outs


def check_model(decode_kernels: str, device, dtype=torch.float32, batch: int = 3, ts=(1, 5), heads: int = 8,
                kv_heads: int = 2, ops=None, **switches) -> None:
    """A 2-layer Llama on ``decode_kernels`` against the same weights on SDPA: logits and every KV row
    (:func:`model_pair`'s arguments). ``ops``: decode ops to run instead of the choice's own."""
    models = model_pair(("off", decode_kernels), device, dtype, batch, heads, kv_heads, **switches)
    if ops is not None:
        models[1].decode_ops = ops
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    for t, ((want, want_kv), (got, got_kv)) in model_forwards(models, device, dtype, ts):
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{decode_kernels} T={t} logits: {m}")
        for a, b in zip(want_kv, got_kv):
            torch.testing.assert_close(b.float(), a.float(), **tol, msg=lambda m: f"{decode_kernels} T={t} kv: {m}")


def check_pdl_model(device, dtype=torch.float32, batch: int = 3, ts=(1, 5), heads: int = 8, kv_heads: int = 2,
                    **switches) -> None:
    """``decode_kernels="pdl"`` computes ``"gemv"``'s bits: logits and every KV row, torch.equal."""
    models = model_pair(("gemv", "pdl"), device, dtype, batch, heads, kv_heads, **switches)
    assert (models[0].decode_ops.pdl, models[1].decode_ops.pdl) == (False, True)
    for t, ((want, want_kv), (got, got_kv)) in model_forwards(models, device, dtype, ts):
        assert torch.equal(got, want), f"pdl T={t}: logits differ from gemv's by up to {(got - want).abs().max()}"
        assert all(torch.equal(a, b) for a, b in zip(want_kv, got_kv)), f"pdl T={t}: the KV differs from gemv's"


#: (M, N, K, dtype, bias, GemvConfig or None, fma or None): M = 1, 3, 7, 16 (and 19, past one row tile), K
#: whole tiles and not (257), split-K 1 to 4, the multiply-accumulate path (M = 1) and tl.dot; tuple configs
#: are GemvConfig fields (this module does not import Triton)
CI_GEMV = [
    (1, 96, 64, torch.float32, False, None, None), (1, 96, 257, torch.bfloat16, True, (16, 64, 4, 3), None),
    (1, 257, 96, torch.float32, True, (32, 32, 4, 2), False), (3, 96, 257, torch.float32, True, (16, 32, 4, 4), None),
    (7, 257, 64, torch.bfloat16, False, (64, 16, 4, 1), None), (16, 96, 64, torch.bfloat16, True, (16, 32, 4, 2), None),
    (16, 257, 257, torch.float32, False, None, None), (19, 96, 64, torch.float32, True, (16, 32, 4, 1), None),
]


def check_gemv(gemv, case, device, seed: int = 0, tol: dict | None = None) -> None:
    """``gemv(x, W, b)`` into a view of a NaN buffer (rows and columns past it must stay NaN), x a strided view,
    against ``decode_reference.linear_ref``. W is scaled by 1/sqrt(K), so outputs are ~1 and TOL's bf16 bound is
    about two bf16 ulps (both round one fp32 sum once; the sums differ only in order)."""
    from graphburst.models.decode.gemv import GemvConfig

    m, n, k, dtype, has_bias, cfg, fma = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + 3, generator=gen).to(dtype).to(device)[:, :k]  # row stride k + 3
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if has_bias else None
    buf = torch.full((m + 2, n + 5), float("nan"), dtype=dtype, device=device)
    out = buf[:m, :n]
    got = gemv(x, w, b, out=out, config=None if cfg is None else GemvConfig(*cfg), fma=fma)
    assert got.data_ptr() == out.data_ptr(), "gemv must write into out"
    want = decode_reference.linear_ref(x, w, b)
    assert buf[m:].isnan().all() and buf[:, n:].isnan().all(), f"{case}: wrote outside out"
    torch.testing.assert_close(out.float(), want.float(), **(tol or TOL[dtype]), msg=lambda s: f"{case}: {s}")


# ---------------------------------------------------------------------- PDL: the same bits, back to back

#: kernels launched back to back per chain of the PDL checks: each reads what the one before wrote
#: (and writes what it read), so a kernel that loaded or stored before its wait would race somewhere
PDL_CHAIN = 8
#: GPU cycles a chain keeps the device busy before its first kernel (~10 ms at the H200's ~2 GHz). The
#: host issues a launch in about the time a small kernel runs, so unqueued each kernel would end before
#: the next one is issued and PDL would overlap nothing; behind the spin the chain's launches queue up,
#: then run back to back.
BUSY_CYCLES = 20_000_000


def busy(device) -> None:
    """Keep a CUDA device busy for BUSY_CYCLES so the launches that follow queue up (nothing elsewhere)."""
    if torch.device(device).type == "cuda":
        torch.cuda._sleep(BUSY_CYCLES)


def chain_add_rmsnorm(add_rmsnorm, case, device, pdl: bool, seed: int = 0) -> list:
    """PDL_CHAIN norms, each one's output the next one's residual, x updated in place by every one (a new
    output may reuse the buffer two calls back, which the previous norm read). Returns [x, last output].

    ``case``: (rows R, hidden N, dtype)."""
    r, n, dtype = case
    gen = torch.Generator().manual_seed(seed)
    x, out, w = (torch.randn(shape, generator=gen).to(dtype).to(device) for shape in ((r, n), (r, n), (n,)))
    busy(device)
    for _ in range(PDL_CHAIN):
        out = add_rmsnorm(x, out, w, 1e-5, pdl=pdl)
    return [x, out]


def chain_silu_mul(silu_mul, case, device, pdl: bool, seed: int = 0) -> list:
    """``steps`` SiLU products, each one's ``[R, F]`` output read as the next one's ``[gate | up]`` of F / 2.
    Returns every output. ``case``: (rows R, F of the first, dtype, steps); F a multiple of 2^(steps - 1)."""
    r, f, dtype, steps = case
    gu = torch.randn(r, 2 * f, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
    outs = []
    busy(device)
    for _ in range(steps):
        gu = silu_mul(gu, pdl=pdl)
        outs.append(gu)
    return outs


def chain_gemv(gemv, case, device, pdl: bool, seed: int = 0) -> list:
    """PDL_CHAIN square projections, each one's output the next one's x (two weights in turn, scaled by
    1/sqrt(K) so the values stay ~1). Returns every output.

    ``case``: (M, K = N, dtype, bias, GemvConfig fields or None, fma or None)."""
    from graphburst.models.decode.gemv import GemvConfig

    m, k, dtype, has_bias, cfg, fma = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    ws = [(torch.randn(k, k, generator=gen) / k ** 0.5).to(dtype).to(device) for _ in range(2)]
    b = torch.randn(k, generator=gen).to(dtype).to(device) if has_bias else None
    outs = []
    busy(device)
    for i in range(PDL_CHAIN):
        x = gemv(x, ws[i % 2], b, config=None if cfg is None else GemvConfig(*cfg), fma=fma, pdl=pdl)
        outs.append(x)
    return outs


def chain_rope_attention(rope_kv_write, attention, case, device, pdl: bool, seed: int = 0) -> list:
    """PDL_CHAIN / 2 rounds of RoPE + KV write then attention, each attention writing its output into the
    next round's q (so the next RoPE reads it) and each KV write landing on the rows the attention before
    read. Returns every qkv buffer, the cache and the last output.

    ``case``: (B, T, KV heads, group, head_dim, dtype, splits) as CI_ATTENTION's."""
    b, t, kvh, g, d, dtype, splits = case
    h = kvh * g
    rounds = PDL_CHAIN // 2
    gen = torch.Generator().manual_seed(seed)
    qkvs = [torch.randn(b, t, h + 2 * kvh, d, generator=gen).to(dtype).to(device) for _ in range(rounds)]
    kv = torch.randn(2, b, ROWS, kvh, d, generator=gen).to(dtype).to(device)
    ang = torch.rand(ROWS, d // 2, generator=gen) * 6.0
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(device), torch.cat((ang.sin(), ang.sin()), -1).to(device)
    length = lengths_for(b, t, seed).to(device)  # ragged: 0, 1, 63, CAPACITY - 1 in turn
    start = (length + 3).to(torch.int32)
    last = torch.empty(b, t, h, d, dtype=dtype, device=device)
    busy(device)
    for i in range(rounds):
        rope_kv_write(qkvs[i], cos, sin, start, length, kv, h, pdl=pdl)
        out = qkvs[i + 1][:, :, :h] if i + 1 < rounds else last
        attention(qkvs[i][:, :, :h], kv, length, out=out, splits=splits, pdl=pdl)
    return qkvs + [kv, last]


def check_pdl_same(chain, *args, seed: int = 0) -> None:
    """``chain(*args, pdl=False)`` and ``chain(*args, pdl=True)`` return the same tensors, bit for bit. The PDL
    chain runs twice: the first run compiles its kernels between launches, the second runs back to back."""
    case = next(a for a in args if isinstance(a, tuple))
    want = chain(*args, pdl=False, seed=seed)
    for run in ("first", "second"):
        got = chain(*args, pdl=True, seed=seed)
        assert len(want) == len(got)
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), \
                f"{chain.__name__} {case} ({run} run) tensor {i}: PDL differs by up to {(a - b).abs().max()}"


# ---------------------------------------------------------------------- the folded kernels (decode/folded.py)

#: a Partial's form in the folded cases: None (no delta), "whole" (an output already summed), or its split count
#: (fp32 partials plus a bias)
#: (M, K, N, dtype, delta, config fields or None, fma or None): M = 1, 3, 7, 16, 19 (past one row tile); K whole
#: tiles and not (257); the projection's split-K 1 to 3; deltas of every form; the multiply-accumulate path and
#: tl.dot's at M = 1; a K tile the prologue shrinks (``folded.prologue_block_k``)
CI_NORM_LINEAR = [
    (1, 64, 96, torch.float32, None, None, None), (1, 257, 96, torch.bfloat16, 2, (16, 64, 4, 3), None),
    (1, 96, 257, torch.float32, "whole", (32, 32, 4, 2), False), (3, 257, 96, torch.float32, 3, (16, 32, 4, 4), None),
    (7, 96, 64, torch.bfloat16, "whole", (64, 16, 4, 1), None), (16, 64, 96, torch.float32, 1, (16, 32, 4, 2), None),
    (19, 96, 64, torch.float32, 2, (16, 32, 4, 1), None),
    (7, 257, 96, torch.float32, 3, (32, 256, 4, 2), None),  # the prologue halves the K tile (256 -> 128)
]
#: (M, F, N, dtype, gate_up form, config fields or None, fma or None): the down projection of F inputs
CI_SILU_LINEAR = [
    (1, 96, 64, torch.float32, "whole", None, None), (3, 257, 96, torch.bfloat16, 3, (16, 32, 4, 2), None),
    (7, 64, 257, torch.float32, 2, (32, 16, 4, 3), None), (19, 96, 64, torch.bfloat16, "whole", (16, 32, 4, 1), None),
    (7, 96, 64, torch.float32, 3, (16, 128, 4, 1), None),  # the prologue halves the K tile (128 -> 64)
]
#: (B, T, H, KV heads, head_dim, dtype, qkv form)
CI_FOLDED_ROPE = [(1, 1, 8, 1, 128, torch.float32, "whole"), (3, 5, 4, 1, 64, torch.bfloat16, 3),
                  (19, 2, 8, 8, 64, torch.float32, 2), (3, MAX_K + 1, 8, 2, 64, torch.float32, 1)]
#: what the residual and a sum pass are held to: fp32 exactly; bf16 within two ulps of values up to ~4 (2^-6
#: each), where the interpreter's fp32 -> bf16 casts may round the delta other than to nearest
RESIDUAL_TOL = {torch.float32: dict(rtol=0, atol=0), torch.bfloat16: dict(rtol=2e-2, atol=4e-2)}


def exact_on(device, dtype) -> dict:
    """Bit for bit, but for bf16 under the interpreter (whose fp32 -> bf16 casts need not round to nearest)."""
    return RESIDUAL_TOL[dtype] if torch.device(device).type == "cpu" else RESIDUAL_TOL[torch.float32]


def make_partial(form, m: int, n: int, dtype, device, gen):
    """A Partial of [M, N] in ``form`` (None, "whole" or a split count), values ~1 per output."""
    from graphburst.models.decode.partial import Partial

    if form is None:
        return None
    if form == "whole":
        return Partial.whole(torch.randn(m, n, generator=gen).to(dtype).to(device))
    parts = (torch.randn(form, m, n, generator=gen) / form ** 0.5).to(device)
    return Partial(parts, form, (torch.randn(n, generator=gen) * 0.5).to(dtype).to(device), dtype)


def _weights(n: int, k: int, dtype, device, gen, bias: bool):
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    return w, b


def check_norm_linear(folded, case, device, seed: int = 0) -> None:
    """``norm_linear`` against ``norm_linear_ref``: the output (through ``materialize``, the kernel's own sum
    pass), the new residual, x untouched; then ``linear`` (no norm) on the same x."""
    from graphburst.models.decode.gemv import GemvConfig
    from graphburst.models.decode.partial import WHOLE, dense

    m, k, n, dtype, form, cfg, fma = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    delta = make_partial(form, m, k, dtype, device, gen)
    nw = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(device)
    w, b = _weights(n, k, dtype, device, gen, bias=seed % 2 == 0)
    config = None if cfg is None else GemvConfig(*cfg)
    x0 = x.clone()
    got, res = folded.norm_linear(x, delta, nw, 1e-5, w, b, config=config, fma=fma)
    want, want_res = decode_reference.norm_linear_ref(x0, delta, nw, 1e-5, w, b)
    assert torch.equal(x, x0), f"{case}: x was written"
    assert (res is x) == (delta is None), f"{case}: the residual is x exactly when there is no delta"
    torch.testing.assert_close(res.float(), want_res.float(), **exact_on(device, dtype),
                               msg=lambda s: f"{case} res: {s}")
    if config is not None:  # the splits the GEMV makes of K: whole tiles each, none past K
        tiles = -(-k // config.block_k)
        per = -(-tiles // min(config.split_k, tiles)) * config.block_k
        splits = -(-k // per)
        assert got.splits == (WHOLE if splits == 1 else splits), f"{case}: {got.splits} splits, not {splits}"
    out = folded.materialize(got)
    torch.testing.assert_close(out.float(), dense(want).float(), **TOL[dtype], msg=lambda s: f"{case}: {s}")
    torch.testing.assert_close(out.float(), dense(got).float(), **exact_on(device, dtype),
                               msg=lambda s: f"{case}: the sum pass against the partials' sum: {s}")
    plain = folded.materialize(folded.linear(x, w, b, config=config, fma=fma))
    torch.testing.assert_close(plain.float(), decode_reference.linear_ref(x, w, b).float(), **TOL[dtype],
                               msg=lambda s: f"{case} linear: {s}")


def check_silu_linear(folded, case, device, seed: int = 0) -> None:
    from graphburst.models.decode.gemv import GemvConfig
    from graphburst.models.decode.partial import dense

    m, f, n, dtype, form, cfg, fma = case
    gen = torch.Generator().manual_seed(seed)
    gate_up = make_partial(form, m, 2 * f, dtype, device, gen)
    w, b = _weights(n, f, dtype, device, gen, bias=seed % 2 == 1)
    got = folded.silu_linear(gate_up, w, b, config=None if cfg is None else GemvConfig(*cfg), fma=fma)
    want = decode_reference.silu_linear_ref(gate_up, w, b)
    torch.testing.assert_close(folded.materialize(got).float(), dense(want).float(), **TOL[dtype],
                               msg=lambda s: f"{case}: {s}")


def check_folded_rope(folded, case, device, seed: int = 0) -> None:
    """RoPE from a Partial: q and every KV row against the reference; rows not written stay NaN."""
    b, t, h, kvh, d, dtype, form = case
    gen = torch.Generator().manual_seed(seed)
    qkv = make_partial(form, b * t, (h + 2 * kvh) * d, dtype, device, gen)
    ang = torch.rand(ROWS, d // 2, generator=gen) * 6.0
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(device), torch.cat((ang.sin(), ang.sin()), -1).to(device)
    start = (lengths_for(b, t, seed) + 3).to(device)
    length = lengths_for(b, t, seed + 1).to(device)
    kv = torch.full((2, b, ROWS, kvh, d), float("nan"), dtype=dtype, device=device)
    kv_ref = kv.clone()
    q = folded.rope_kv_write(qkv, cos, sin, start, length, kv, h, t)
    q_ref = decode_reference.folded_rope_kv_write_ref(qkv, cos, sin, start, length, kv_ref, h, t)
    assert q.shape == (b, t, h, d) and q.is_contiguous()
    torch.testing.assert_close(q.float(), q_ref.float(), **TOL[dtype], msg=lambda m: f"{case} q: {m}")
    torch.testing.assert_close(kv.float(), kv_ref.float(), **TOL[dtype], equal_nan=True,
                               msg=lambda m: f"{case} kv: {m}")


def chain_folded(folded, case, device, pdl: bool, seed: int = 0) -> list:
    """PDL_CHAIN / 2 MLP sublayers back to back, as the folded forward runs them: norm + gate/up (the delta
    the last down projection's Partial), SiLU + down; the residual passed on. Returns every residual and the
    last output, summed at the end. ``case``: (M, hidden, F, dtype, gate/up config fields, down config fields)."""
    from graphburst.models.decode.gemv import GemvConfig

    m, hidden, f, dtype, cfg_gu, cfg_down = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=gen).to(dtype).to(device)
    nw = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)
    w_gu, _ = _weights(2 * f, hidden, dtype, device, gen, bias=False)
    w_down, b_down = _weights(hidden, f, dtype, device, gen, bias=True)
    delta, outs = None, []
    busy(device)
    for _ in range(PDL_CHAIN // 2):
        gate_up, x = folded.norm_linear(x, delta, nw, 1e-5, w_gu, config=GemvConfig(*cfg_gu), pdl=pdl)
        delta = folded.silu_linear(gate_up, w_down, b_down, config=GemvConfig(*cfg_down), pdl=pdl)
        outs.append(x)
    return outs + [folded.materialize(delta, pdl=pdl)]


def check_folded_pdl_model(device, dtype=torch.float32, batch: int = 3, ts=(1, 5), heads: int = 8,
                           kv_heads: int = 2, max_m: int | None = None, **switches) -> None:
    """``decode_kernels="folded"`` (with PDL) computes the folded path's bits without PDL: logits and KV.
    ``max_m``: the rows up to which both fold (default ``folded_ops``'s own)."""
    from graphburst.models import llama_decode

    models = model_pair(("folded", "folded"), device, dtype, batch, heads, kv_heads, **switches)
    models[0].decode_ops = llama_decode.folded_ops(pdl=False, max_m=max_m)
    models[1].decode_ops = llama_decode.folded_ops(pdl=True, max_m=max_m)
    for t, ((want, want_kv), (got, got_kv)) in model_forwards(models, device, dtype, ts):
        assert torch.equal(got, want), f"folded T={t}: PDL changes the logits by up to {(got - want).abs().max()}"
        assert all(torch.equal(a, b) for a, b in zip(want_kv, got_kv)), f"folded T={t}: PDL changes the KV"


#: (B, T, KV heads, group, head_dim, dtype, splits, lengths or None): the o projection combining the attention's
#: splits (``decode_attention(..., combine=False)``): one row (how the folded forward uses it) with 4 and 16
#: splits, three rows whose lengths leave later splits idle, an idle slot's sentinel, and five rows (tl.dot)
CI_COMBINE = [(1, 1, 3, 3, 64, torch.float32, 4, None), (1, 1, 2, 4, 128, torch.bfloat16, 16, None),
              (3, 1, 2, 1, 64, torch.float32, 8, (0, 1, 63)), (3, 1, 1, 4, 64, torch.float32, 2, (-1, 95, 5)),
              (1, 5, 2, 3, 64, torch.float32, 4, None)]


def check_combine_linear(folded, attention, case, device, seed: int = 0) -> None:
    """``folded.linear`` over the attention's splits against the projection of the reference attention; the
    torch ``combined`` of the same splits against the reference attention too."""
    from graphburst.models.decode.partial import AttentionSplits, combined

    b, t, kvh, g, d, dtype, splits, lens = case
    gen = torch.Generator().manual_seed(seed)
    h = kvh * g
    q = torch.randn(b, t, h, d, generator=gen).to(dtype).to(device)
    kv = torch.randn(2, b, ROWS, kvh, d, generator=gen).to(dtype)
    length = lengths_for(b, t, seed) if lens is None else torch.tensor(lens, dtype=torch.int32)
    poison_tail(kv, length.clamp(min=0), t)
    kv, length = kv.to(device), length.to(device)
    w, bias = _weights(40, h * d, dtype, device, gen, bias=True)
    att = attention.decode_attention(q, kv, length, splits=splits, combine=False)
    assert isinstance(att, AttentionSplits) and att.splits == splits and att.shape == (b * t, h * d)
    want_y = decode_reference.decode_attention_ref(q, kv, length).view(b * t, h * d)
    torch.testing.assert_close(combined(att).float(), want_y.float(), **TOL[dtype], msg=lambda m: f"{case} y: {m}")
    got = folded.materialize(folded.linear(att, w, bias))
    want = decode_reference.linear_ref(want_y, w, bias)
    assert torch.isfinite(got.float()).all(), f"{case}: non-finite output"
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype], msg=lambda m: f"{case}: {m}")
