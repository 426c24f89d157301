"""Packed prefill (graphburst.models.packed_prefill, models.varlen): prompts end to end, no padding between them.

Held on the CPU: the index block by hand, the variable-length attention's reference against
per-prompt SDPA, a packed forward against each prompt run alone (Llama and Qwen3 switches),
the buckets, the plan, warm-up writing no KV row a slot reads, and the adapter's switches.
The decoder-level check (the same KV rows and first tokens as the plain prefill, nothing
else moved but rows no attention reads) is ``test_prefill_graphs.py``'s, parametrized over
packing. On the H200: torch's flash kernel against the reference, in bf16 inside captured
buckets (eager first use, capture, replay; padding in several segments; one-prompt buckets)
against each prompt run alone, and, in fp32 (the reference path), a bucket that runs
eagerly, is captured, then replays with no host sync and decodes the greedy tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from graphburst import SpecDecoder
from graphburst.backend import Backend
from graphburst.models.checkpoint import tiny_random_configs
from graphburst.models.llama import Llama
from graphburst.models.llama_layers import Packed
from graphburst.models.packed_prefill import (PACKED_ROW_LADDER, TOKEN_LADDER, PackedPrefillGraphs, packed_index,
                                              packed_warm_sizes, padding_segments)
from graphburst.models.prefill_buckets import CAPTURE_AT_USE
from graphburst.models.torch_adapter import TorchDraft, TorchTarget
from graphburst.models.varlen import causal_varlen, flash_varlen_ok, segment_ids, varlen_reference

from marks import requires_gpu
from prefill_cases import assert_decodes_greedy, check_untouched, poison, prefill_fresh, tiny_adapters

torch.set_num_threads(1)

BATCH, CAPACITY = 7, 300


# ---------------------------------------------------------------------- the index block


def test_packed_index_by_hand():
    # two prompts (slot 5: 3 tokens, slot 2: 1) in a bucket of 2 rows x 6 tokens, staging width 4, S = 10
    block = packed_index([5, 2], [3, 1], width=4, t_b=6, r_b=2, s=10)
    src, pos, slot, last, cu = block[:6], block[6:12], block[12:18], block[18:20], block[20:]
    assert src.tolist() == [20, 21, 22, 8, 0, 0]  # slot * width + position; padding reads token 0
    assert pos.tolist() == [0, 1, 2, 0, 10, 10]  # padding at S: its KV clamps to row S - 1
    assert slot.tolist() == [5, 5, 5, 2, 0, 0]
    assert last.tolist() == [2, 3]
    assert cu.tolist() == [0, 3, 4, 6]  # the two prompts, then the padding tokens' own segment
    # two padding rows (empty segments) and padding longer than S: pieces of at most S tokens
    block = packed_index([1], [4], width=8, t_b=25, r_b=3, s=10)
    assert padding_segments(25, 10) == 3
    assert block[75:78].tolist() == [3, 0, 0]  # last: the prompt's, then 0 for the padding rows
    assert block[78:].tolist() == [0, 4, 4, 4, 14, 24, 25]
    assert block.size == 3 * 25 + 2 * 3 + 1 + 3


def test_segment_ids_skip_empty_segments():
    cu = torch.tensor([0, 3, 3, 7, 8])
    assert segment_ids(cu, 8).tolist() == [0, 0, 0, 2, 2, 2, 2, 3]


# ---------------------------------------------------------------------- attention


def _qkv(gen, t, h=4, kv=2, d=16, dtype=torch.float32, device="cpu"):
    return [torch.randn(t, n, d, generator=gen).to(device=device, dtype=dtype) for n in (h, kv, kv)]


def _per_segment(q, k, v, cu):
    out = torch.zeros_like(q)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                                      v[a:b].transpose(0, 1)[None], is_causal=True,
                                                      enable_gqa=True)[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("lengths", [[1], [7, 0, 19], [1, 257, 0, 0, 7]], ids=["one", "awkward", "long_and_empty"])
def test_varlen_reference_is_causal_sdpa_per_segment(lengths):
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    q, k, v = _qkv(gen, int(cu[-1]))
    assert not flash_varlen_ok(q)  # the CPU takes the reference
    torch.testing.assert_close(causal_varlen(q, k, v, cu, max(lengths)), _per_segment(q, k, v, cu),
                               atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(varlen_reference(q, k, v, cu), _per_segment(q, k, v, cu), atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_flash_varlen_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 7, 0, 19, 257, 0]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device="cuda")
    q, k, v = _qkv(gen, int(cu[-1]), h=8, kv=2, d=64, dtype=dtype, device="cuda")
    assert flash_varlen_ok(q)
    got = causal_varlen(q, k, v, cu, 300)  # a bound past the longest segment
    want = _per_segment(q.float(), k.float(), v.float(), cu.cpu())
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    assert not flash_varlen_ok(q.float())  # fp32 on the GPU: the reference
    torch.testing.assert_close(causal_varlen(q.float(), k.float(), v.float(), cu, 300), want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- the forward


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("slots, lengths, r_b", [([3, 0, 2], [19, 1, 7], 4), ([2], [19], 1)],
                         ids=["three_prompts", "one_prompt"])
def test_a_packed_forward_is_each_prompt_run_alone(rng, family, slots, lengths, r_b):
    """Several prompts attend by variable-length attention; one (a bucket of one row) by causal SDPA
    over the whole row, padding included (Llama.packed_index)."""
    from graphburst.bench.real_models import QWEN3_TINY

    cfg = tiny_random_configs()[0] if family == "llama" else QWEN3_TINY
    m = Llama(cfg, batch=4, capacity=64).init_random_(5)
    alone = Llama(cfg, batch=4, capacity=64).init_random_(5)
    prompts = [torch.from_numpy(rng.integers(0, cfg.vocab_size, n)) for n in lengths]
    s = m.kv[0].shape[2]
    block = torch.from_numpy(packed_index(slots, lengths, 1, 32, r_b, s))
    cu = block[3 * 32 + r_b:].to(torch.int32)
    packed = Packed(block[32:64], block[64:96], cu, 32, block[96: 96 + r_b])
    assert (m.packed_index(packed, torch.float32).cu is None) == (r_b == 1)
    tokens = torch.zeros(1, 32, dtype=torch.int64)
    tokens[0, : sum(lengths)] = torch.cat(prompts)
    tokens[0, sum(lengths):] = 7  # padding tokens: any valid id
    n_layers = len(m.layers)
    with torch.no_grad():
        got = m(tokens, None, [None] * n_layers, packed=packed)  # [R_b, 1, V]
        for i, (b, p) in enumerate(zip(slots, prompts)):
            zero = torch.zeros(1, dtype=torch.int32)
            want = alone(p[None], zero, [zero] * n_layers, torch.tensor([b]), logits_at=torch.tensor([len(p) - 1]))
            torch.testing.assert_close(got[i], want[0], atol=1e-5, rtol=1e-5)
            for kv_p, kv_a in zip(m.kv, alone.kv):
                torch.testing.assert_close(kv_p[:, b, : len(p)], kv_a[:, b, : len(p)], atol=1e-5, rtol=1e-5)
        assert m(tokens, None, [None] * n_layers, packed=packed, head=False) is None
    assert m.accepts_packed
    assert not Llama(cfg, batch=1, capacity=16, deterministic_attention=True).accepts_packed


# ---------------------------------------------------------------------- buckets and plan


def _graphs(max_tokens=8192, capture_at=None):
    cfg, _ = tiny_random_configs()
    module = Llama(cfg, batch=BATCH, capacity=CAPACITY).init_random_(4)
    return PackedPrefillGraphs(module, kv_layers=[True] * cfg.num_hidden_layers, capture=False,
                               max_tokens=max_tokens, capture_at=capture_at)


def test_buckets_round_rows_and_tokens_up_their_ladders():
    g = _graphs()
    assert g.bucket(1, 1) == (1, 16)
    assert g.bucket(3, 100) == (4, 128)
    assert g.bucket(11, 1402) == (16, 1536)  # the 8b's 11 lognormal prompts: 1402 tokens, not 2816
    assert g.bucket(64, 8192) == (64, 8192)
    assert g.bucket(65, 8193) is None  # past max_tokens: eager, unpadded
    assert PACKED_ROW_LADDER[-1] == 64 and TOKEN_LADDER[-1] == 8192


def test_plan_is_one_call_until_max_tokens():
    g = _graphs(max_tokens=256)
    assert g.plan({4: 16, 2: 30, 6: 200}) == [[2, 4, 6]]
    assert g.plan({0: 200, 1: 100, 2: 50, 3: 10}) == [[0], [1, 2, 3]]  # longest first, cut where it would not fit
    assert g.plan({0: 300, 1: 5}) == [[0], [1]]  # a prompt past max_tokens alone (it runs eagerly)
    assert g.plan({3: 7}) == [[3]]


def test_packed_warm_sizes_by_hand():
    assert packed_warm_sizes(3, max_tokens=128) == [(4, 128), (2, 128), (1, 128), (4, 96), (2, 96), (1, 96),
                                                    (4, 64), (2, 64), (1, 64), (4, 48), (2, 48), (1, 48),
                                                    (4, 32), (2, 32), (1, 32), (4, 16), (2, 16), (1, 16)]
    # tokens up to rows x the bucket of max_length (20: 32)
    assert packed_warm_sizes(2, max_tokens=128, max_length=20) == [(2, 64), (2, 48), (2, 32), (1, 32), (2, 16),
                                                                   (1, 16)]
    assert packed_warm_sizes(0) == []
    # 33 prompts of one token take a 64-prompt bucket of 48 tokens: reachable, so warmed
    assert (64, 48) in packed_warm_sizes(64, max_tokens=64) and (64, 32) not in packed_warm_sizes(64, max_tokens=64)
    g64 = _graphs(max_tokens=64)
    assert g64.bucket(33, 33) == (64, 48)
    g = _graphs(max_tokens=128)
    assert all(g.bucket(r, t) == (r, t) for r, t in packed_warm_sizes(5, 128))


def test_a_bucket_runs_unpadded_first_then_padded_and_agrees(rng):
    """The GPU's policy held on the CPU: a bucket's first use runs eagerly and unpadded, its second in
    the bucket (padded at the end); both give the logits of each prompt run alone."""
    g = _graphs(capture_at=CAPTURE_AT_USE)
    m = g.module
    slots, lengths = np.array([1, 4]), np.array([20, 9])
    staging = torch.zeros(BATCH, 32, dtype=torch.int32)
    for b, n in zip(slots, lengths):
        staging[b, :n] = torch.from_numpy(rng.integers(0, m.vocab, n))
    zero = torch.zeros(1, dtype=torch.int32)
    with torch.no_grad():
        want = torch.cat([m(staging[b: b + 1, :n].long(), zero, [zero] * len(m.kv), torch.tensor([b]),
                            logits_at=torch.tensor([n - 1]))[:, 0] for b, n in zip(slots, lengths)])
        first = g.run_packed(staging, slots, lengths, head=True).clone()
        assert g.info() == {}  # eager, no bucket made
        second = g.run_packed(staging, slots, lengths, head=True)
    assert g.info() == {(2, 32, True): False}
    torch.testing.assert_close(first, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="run_packed"):
        g.run(staging, None, None, True)


def _adapters(backend):
    return tiny_adapters(backend, batch=BATCH, capacity=CAPACITY, packed=True)


def test_packed_warm_up_leaves_every_readable_kv_row_bit_identical():
    models = _adapters(Backend("numpy"))
    before = poison(models)
    done = [m.warm_prefill(3) for m in models]
    sizes = packed_warm_sizes(3, max_length=CAPACITY)
    assert [d["buckets"] for d in done] == [len(sizes)] * 2
    assert set(models[0].prefill_graphs.info()) == {(r, t, True) for r, t in sizes}
    assert set(models[1].prefill_graphs.info()) == {(r, t, False) for r, t in sizes}
    check_untouched(models, before)


def test_the_adapter_switches():
    backend = Backend("numpy")
    cfg, _ = tiny_random_configs()
    module = Llama(cfg, batch=2, capacity=32)
    assert TorchTarget(module, batch=2, capacity=32, backend=backend, prefill_graphs=True).packed_prefill  # default
    padded = TorchTarget(module, batch=2, capacity=32, backend=backend, prefill_graphs=True, packed_prefill=False)
    assert not padded.packed_prefill and not padded.prefill_graphs.packed
    assert not TorchTarget(module, batch=2, capacity=32, backend=backend).packed_prefill  # no graphs on the CPU
    with pytest.raises(TypeError, match="packed_prefill must be a bool"):
        TorchTarget(module, batch=2, capacity=32, backend=backend, prefill_graphs=True, packed_prefill=1)
    with pytest.raises(ValueError, match="needs prefill graphs"):
        TorchTarget(module, batch=2, capacity=32, backend=backend, prefill_graphs=False, packed_prefill=True)
    det = Llama(cfg, batch=2, capacity=32, deterministic_attention=True)
    with pytest.raises(ValueError, match="accepts_packed"):
        TorchTarget(det, batch=2, capacity=32, backend=backend, prefill_graphs=True, packed_prefill=True)
    assert not TorchTarget(det, batch=2, capacity=32, backend=backend, prefill_graphs=True).packed_prefill


def test_a_sampling_decoder_gets_the_same_first_logits_packed(rng):
    """Sampling mode reads the logits after the prompt (tgt_logits[:, 0]): packed as plain."""
    backend = Backend("numpy")
    cfg, draft_cfg = tiny_random_configs()
    prompts = {0: rng.integers(0, 512, 19).astype(np.int32), 5: rng.integers(0, 512, 7).astype(np.int32)}
    logits = []
    for graphs in (False, True):
        t = Llama(cfg, batch=BATCH, capacity=CAPACITY).init_random_(3)
        d = Llama(draft_cfg, batch=BATCH, capacity=CAPACITY).init_random_(4)
        kw = {"prefill_graphs": graphs, "packed_prefill": True} if graphs else {"prefill_graphs": False}
        dec = SpecDecoder(TorchTarget(t, batch=BATCH, capacity=CAPACITY, backend=backend, **kw),
                          TorchDraft(d, batch=BATCH, capacity=CAPACITY, backend=backend, **kw), k=3, m_rounds=2,
                          sampling=True)
        dec.prefill_checked(prompts, {b: 0 for b in prompts}, limits={b: 20 for b in prompts})
        logits.append(np.asarray(dec.bufs.tgt_logits)[[0, 5], 0].copy())
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@requires_gpu
def test_gpu_flash_in_captured_buckets_matches_each_prompt_alone(rng):
    """bf16 (the flash kernel): each case's first call runs eagerly and unpadded, its second is
    captured, its third replays; logits and KV rows against each prompt run alone (SDPA, masked).
    A bucket of 256 tokens past S: the kernel's max_len is S, and the padding has segments of its own."""
    cfg, _ = tiny_random_configs(hidden=128)  # head_dim 32
    kw = dict(batch=BATCH, capacity=40, device="cuda", dtype=torch.bfloat16)
    m, alone = Llama(cfg, **kw).init_random_(5), Llama(cfg, **kw).init_random_(5)
    g = PackedPrefillGraphs(m, kv_layers=[True] * cfg.num_hidden_layers, capture=True)
    assert g.bucket(7, 245) == (8, 256) and 256 > g.s and padding_segments(256, g.s) >= 3
    zero = torch.zeros(1, dtype=torch.int32, device="cuda")
    for slots, lengths in (([1, 4, 2], [19, 7, 1]), (list(range(7)), [40, 40, 35, 35, 35, 30, 30]), ([6], [33]),
                           ([2], [1])):
        staging = torch.zeros(BATCH, 40, dtype=torch.int32, device="cuda")
        for b, n in zip(slots, lengths):
            staging[b, :n] = torch.from_numpy(rng.integers(0, cfg.vocab_size, n)).cuda()
        with torch.no_grad():
            want = [alone(staging[b: b + 1, :n].long(), zero, [zero] * len(alone.kv), torch.tensor([b], device="cuda"),
                          logits_at=torch.tensor([n - 1], device="cuda"))[0, 0] for b, n in zip(slots, lengths)]
            for call in ("eager", "capture", "replay"):
                got = g.run_packed(staging, np.array(slots), np.array(lengths), head=True)
                for i, (b, n) in enumerate(zip(slots, lengths)):
                    torch.testing.assert_close(got[i], want[i], atol=6e-2, rtol=6e-2,
                                               msg=lambda msg: f"{lengths} {call}, prompt {i}: {msg}")
                    for kv_p, kv_a in zip(m.kv, alone.kv):
                        torch.testing.assert_close(kv_p[:, b, :n].float(), kv_a[:, b, :n].float(), atol=3e-2,
                                                   rtol=3e-2)
        assert g.info()[(*g.bucket(len(slots), sum(lengths)), True)], f"{lengths}: not captured"


@pytest.mark.gpu
@requires_gpu
def test_gpu_a_packed_bucket_runs_eagerly_then_captures_then_replays_without_a_sync(rng):
    backend = Backend("cupy")
    models = _adapters(backend)
    poison(models)
    dec = SpecDecoder(*models, k=3, m_rounds=2)
    graphs = dec.target.prefill_graphs
    seen = []
    for n in (3, 3, 3, 2, 2):  # 3 prompts of 20-22 tokens (63): bucket (4, 64); 2 of 20-21 (41): (2, 48)
        prompts = {b: rng.integers(0, 512, 20 + b).astype(np.int32) for b in range(n)}
        size = graphs.bucket(n, sum(len(p) for p in prompts.values()))
        replay = graphs.info().get((*size, True), False)
        prefill_fresh(dec, prompts, 30, no_sync=replay)  # a replay of a captured bucket never syncs
        seen.append((size, graphs.captures, replay))
        assert_decodes_greedy(dec, prompts, 30, scratch_row=BATCH - 1, label=f"{n} prompts")
    assert seen == [((4, 64), 0, False), ((4, 64), 1, False), ((4, 64), 1, True), ((2, 48), 1, False),
                    ((2, 48), 2, False)]
    assert graphs.info() == {(4, 64, True): True, (2, 48, True): True}
    assert dec.draft.prefill_graphs.info() == {(4, 64, False): True, (2, 48, False): True}


@pytest.mark.gpu
@requires_gpu
def test_gpu_packed_warm_up_captures_leaves_the_readable_kv_and_its_first_call_replays(rng):
    backend = Backend("cupy")
    models = _adapters(backend)
    before = poison(models)
    done = [m.warm_prefill(3) for m in models]
    sizes = packed_warm_sizes(3, max_length=CAPACITY)
    assert [d["buckets"] for d in done] == [len(sizes)] * 2 and all(d["device_bytes"] > 0 for d in done)
    assert models[0].prefill_graphs.info() == {(r, t, True): True for r, t in sizes}
    check_untouched(models, before)
    dec = SpecDecoder(*models, k=3, m_rounds=2)
    captures = [m.prefill_graphs.captures for m in models]
    for n in (3, 1, 2):
        prompts = {b: rng.integers(0, 512, 20 + 37 * b).astype(np.int32) for b in range(n)}
        prefill_fresh(dec, prompts, 30, no_sync=True)
        assert [m.prefill_graphs.captures for m in models] == captures, f"{n} prompts: captured at serving time"
        assert_decodes_greedy(dec, prompts, 30, scratch_row=BATCH - 1, label=f"{n} prompts")


def test_random_admissions_packed_equal_the_plain_prefill(rng):
    """Random fresh admissions (1 to 7 prompts of 1 to 60 tokens, into live and freed slots, under the
    GPU's eager-first-use policy) leave the KV rows, positions and first tokens of the plain prefill."""
    backend = Backend("numpy")
    cfg, draft_cfg = tiny_random_configs()
    decs = []
    for packed in (None, True):
        t = Llama(cfg, batch=BATCH, capacity=CAPACITY).init_random_(3)
        d = Llama(draft_cfg, batch=BATCH, capacity=CAPACITY).init_random_(4)
        kw = {"prefill_graphs": True, "packed_prefill": True} if packed else {"prefill_graphs": False}
        target, draft = (TorchTarget(t, batch=BATCH, capacity=CAPACITY, backend=backend, **kw),
                         TorchDraft(d, batch=BATCH, capacity=CAPACITY, backend=backend, **kw))
        if packed:
            for m in (target, draft):
                m.prefill_graphs.capture_at = CAPTURE_AT_USE  # first use eager and unpadded, as on a GPU
        decs.append(SpecDecoder(target, draft, k=3, m_rounds=2))
    admissions = []
    for _ in range(12):
        n = int(rng.integers(1, BATCH + 1))
        slots = sorted(rng.choice(BATCH, n, replace=False).tolist())
        admissions.append({b: rng.integers(0, 512, int(rng.integers(1, 61))).astype(np.int32) for b in slots})
    admissions.insert(1, admissions[0])  # its bucket's second use: made and run padded
    for prompts in admissions:
        for dec in decs:
            dec.prefill_checked(prompts, {b: 0 for b in prompts}, limits={b: 30 for b in prompts})
        plain, packed = decs
        for want, got in zip([kv for m in (plain.target, plain.draft) for kv in m.module.kv],
                             [kv for m in (packed.target, packed.draft) for kv in m.module.kv]):
            for b, p in prompts.items():
                torch.testing.assert_close(got[:, b, : len(p)], want[:, b, : len(p)], atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(packed.positions(), plain.positions())
        np.testing.assert_array_equal(backend.to_host(packed.bufs.pend, packed.stream),
                                      backend.to_host(plain.bufs.pend, plain.stream))
        assert [t.tolist() for t in packed.run_burst()] == [t.tolist() for t in plain.run_burst()]
    assert packed.target.prefill_graphs.info()  # buckets were made (second uses), beside the eager first uses
