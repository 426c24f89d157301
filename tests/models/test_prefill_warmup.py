"""The prefill graphs' warm-up (``PrefillGraphs.warm_up``, the ``warm_prefill`` hook, ``--prefill-warmup``).

Warm-up makes, before serving, every bucket of up to a few rows from calls of padding rows
only. Held here on the CPU (where a bucket's padded forward runs eagerly): which buckets a
warm-up makes, that no KV row a slot can read moves (poisoned caches, bit for bit), that a
warmed bucket's first real call is not an eager first use (``run`` and ``plan`` agree), the
memory reserve's arithmetic, and the serve flag. On the H200: a warmed bucket's first real
call replays with no capture and no sync, and decodes the greedy tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphburst import SpecDecoder
from graphburst.backend import Backend
from graphburst.models.checkpoint import tiny_random_configs
from graphburst.models.llama import Llama
from graphburst.models.llama_config import LlamaConfig
from graphburst.models.llama_memory import memory_spec
from graphburst.models.packed_prefill import packed_warm_sizes
from graphburst.models.prefill_buckets import (CALL_COST_TOKENS, CAPTURE_AT_USE, EAGER_CALL_COST_TOKENS,
                                               continued_warm_lengths, warm_output_bytes, warm_sizes)
from graphburst.models.prefill_graphs import PrefillGraphs
from graphburst.models.stubs import stub_pair
from graphburst.models.torch_adapter import TorchTarget
from graphburst.serving.factory import ConfigError, ServeConfig, build_loop, memory_specs, warm_models

from marks import requires_gpu
from prefill_cases import assert_decodes_greedy, check_untouched, poison, prefill_fresh, tiny_adapters

torch.set_num_threads(1)

BATCH, CAPACITY = 7, 60


# ---------------------------------------------------------------------- which buckets


def test_warm_sizes_by_hand():
    # rows up to the bucket of 3 (1, 2, 3), lengths up the ladder while rows x length <= 128, largest first
    assert warm_sizes(3, max_tokens=128) == [(2, 64), (1, 128), (3, 32), (2, 48), (1, 96), (2, 32), (1, 64),
                                             (3, 16), (1, 48), (2, 16), (1, 32), (1, 16)]
    assert warm_sizes(1, max_tokens=128, max_length=40) == [(1, 48), (1, 32), (1, 16)]  # the bucket of 40: 48
    assert warm_sizes(5, max_tokens=96) == [(6, 16), (3, 32), (2, 48), (1, 96), (4, 16), (2, 32), (1, 64),
                                            (3, 16), (1, 48), (2, 16), (1, 32), (1, 16)]  # rows: the bucket of 5, 6
    assert warm_sizes(0) == []
    big = warm_sizes(4)  # the serve default: 16 + 15 + 14 + 14 buckets, 4096 and 8192 past the length ladder
    assert len(big) == 59 and (1, 8192) in big and (2, 4096) in big and (3, 4096) not in big
    with pytest.raises(ValueError, match="max_rows"):
        warm_sizes(-1)


def test_every_warm_size_is_a_bucket_of_its_own():
    g = _graphs(max_tokens=4096)
    for rows in (1, 2, 5, 13):
        sizes = warm_sizes(rows, g.max_tokens)
        assert len(set(sizes)) == len(sizes)
        assert all(g.bucket(r, p) == (r, p) for r, p in sizes)


def _graphs(max_tokens=8192, capture_at=None):
    cfg, _ = tiny_random_configs()
    module = Llama(cfg, batch=2, capacity=64).init_random_(4)
    return PrefillGraphs(module, kv_layers=[True] * cfg.num_hidden_layers, capture=False, max_tokens=max_tokens,
                         capture_at=capture_at)


def test_warm_up_makes_exactly_the_warm_sizes():
    g = _graphs(max_tokens=128)
    done = g.warm_up(3, head=True)
    assert done["buckets"] == 12 and done["seconds"] > 0 and done["device_bytes"] is None  # CPU
    assert g.info() == {(r, p, True): False for r, p in warm_sizes(3, 128)}  # made, not captured (CPU)
    assert g.warm_up(3, head=True)["buckets"] == 0  # made already
    assert g.warm_up(1, head=False, max_length=20)["buckets"] == 2  # (1, 32), (1, 16) without a head


def test_a_chunked_warm_up_makes_the_one_row_continued_buckets():
    assert continued_warm_lengths(None) == []  # whole prompts: no later chunks
    assert continued_warm_lengths(40) == [48, 32, 16]  # every length up to the chunk's bucket
    assert continued_warm_lengths(512)[:3] == [512, 384, 256] and len(continued_warm_lengths(512)) == 10
    assert continued_warm_lengths(10_000, max_tokens=8192)[0] == 8192
    g = _graphs(max_tokens=128)
    done = g.warm_up(2, head=True, max_length=40, continued=True)
    fresh = warm_sizes(2, 128, 40)
    # the fresh sizes; their one-row ones without a head (a long prompt's first chunk); the continued ones
    assert done["buckets"] == len(fresh) + 3 + 2 * 3
    assert set(g.info()) == {(r, p, True) for r, p in fresh} | {(1, p, False) for p in (48, 32, 16)} | {
        ("continued", 1, p, h) for p in (48, 32, 16) for h in (True, False)}
    draft = _graphs(max_tokens=128)
    assert draft.warm_up(2, head=False, max_length=40, continued=True)["buckets"] == len(fresh) + 3  # no head
    assert warm_output_bytes(2, 512, 128, 40, continued=True) == warm_output_bytes(2, 512, 128, 40) + 3 * 512 * 4


def test_a_warmed_continued_bucket_is_not_an_eager_first_use(rng):
    cold, warm = _graphs(capture_at=CAPTURE_AT_USE), _graphs(capture_at=CAPTURE_AT_USE)
    warm.warm_up(1, head=True, max_length=32, continued=True)
    tokens = torch.from_numpy(rng.integers(0, 512, (1, 20))).long()
    idx, start, last = torch.tensor([1]), torch.tensor([30], dtype=torch.int32), torch.tensor([19])
    assert cold.run_continued(tokens, idx, start, last, head=True) is NotImplemented  # eager first use
    out = warm.run_continued(tokens, idx, start, last, head=True)
    m = cold.module  # the same seeded weights and, after cold's refusal, untouched caches
    with torch.no_grad():
        want = m(tokens, start, [start] * len(m.kv), idx, logits_at=last)[:, 0]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- the KV a slot reads


def _adapters(backend, packed=False):
    """Padded prefill graphs unless ``packed`` (test_packed_prefill.py holds the packed ones)."""
    return tiny_adapters(backend, batch=BATCH, capacity=CAPACITY, packed=packed)


def test_warm_up_leaves_every_readable_kv_row_bit_identical():
    backend = Backend("numpy")
    models = _adapters(backend)
    before = poison(models)
    lengths = [m.cache.layers[0].length.copy() for m in models]
    done = [m.warm_prefill(3) for m in models]
    # rows 1..3, lengths up to the capacity's bucket (64): 4 + 4 + 4 buckets each
    assert [d["buckets"] for d in done] == [12, 12]
    assert set(models[0].prefill_graphs.info()) == {(r, p, True) for r, p in warm_sizes(3, max_length=CAPACITY)}
    assert set(models[1].prefill_graphs.info()) == {(r, p, False) for r, p in warm_sizes(3, max_length=CAPACITY)}
    check_untouched(models, before)
    for m, old in zip(models, lengths):
        np.testing.assert_array_equal(m.cache.layers[0].length, old)  # no length moved either
    done = [m.warm_prefill(3, max_length=20) for m in models]  # chunks: the continued buckets
    # (1, 32), (1, 16): continued with both heads in the target, and its fresh ones without a head
    assert [d["buckets"] for d in done] == [6, 2]
    check_untouched(models, before)


def test_warm_prefill_caps_rows_at_the_batch_and_is_off_without_graphs():
    backend = Backend("numpy")
    target, _ = _adapters(backend)
    target.warm_prefill(1000, max_length=16)
    fresh = [k for k in target.prefill_graphs.info() if k[0] != "continued"]
    assert {r for r, _, _ in fresh} == {1, 2, 3, 4, 6, 8}  # the bucket of batch 7: 8
    assert target.warm_prefill(0) == {}
    cfg, _ = tiny_random_configs()
    plain = TorchTarget(Llama(cfg, batch=2, capacity=32), batch=2, capacity=32, backend=backend)  # CPU default: off
    assert plain.prefill_graphs is None and plain.warm_prefill(4) == {}
    with pytest.raises(ValueError, match="max_rows"):
        target.warm_prefill(-1)
    with pytest.raises(TypeError, match="max_rows"):
        target.warm_prefill(2.0)


# ---------------------------------------------------------------------- a warmed bucket is no first use


def test_a_warmed_bucket_is_not_an_eager_first_use(rng):
    """With the GPU's policy (an eager first call), held on the CPU: after warm-up the first call of a
    warmed size runs padded in its bucket, and plan prices it so (a long prompt then gets its own call)."""
    cold, warm = _graphs(capture_at=CAPTURE_AT_USE), _graphs(capture_at=CAPTURE_AT_USE)
    warm.warm_up(2, head=True, max_length=512)
    assert cold._call_cost(2, 20) == CALL_COST_TOKENS + EAGER_CALL_COST_TOKENS + 2 * 32
    assert warm._call_cost(2, 20) == CALL_COST_TOKENS + 2 * 32
    assert cold.plan({0: 500, 1: 20}) == [[0, 1]]  # two eager calls cost more than padding the short one
    assert warm.plan({0: 500, 1: 20}) == [[0], [1]]
    tokens = torch.from_numpy(rng.integers(0, 512, (2, 20))).long()
    idx, last = torch.tensor([1, 0]), torch.tensor([19, 12])
    assert cold.run(tokens, idx, last, head=True) is NotImplemented  # the first use runs eagerly
    out = warm.run(tokens, idx, last, head=True)
    assert out is not NotImplemented
    m = warm.module
    zero = torch.zeros(2, dtype=torch.int32)
    with torch.no_grad():
        want = m(tokens, zero, [zero] * len(m.kv), idx, logits_at=last, fresh=True)[:, 0]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # the other head of a warmed size is made at its first call too, as plan priced it
    assert warm.run(tokens[:1], idx[:1], last[:1], head=False) is None and (1, 32, False) in warm.info()


# ---------------------------------------------------------------------- memory and serving


def test_the_reserve_counts_what_warm_up_keeps():
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    per_token = cfg.activation_bytes_per_token(2)
    kw = dict(name="target", dtype=torch.bfloat16, batch=4, decode_tokens=5)
    # whole prompts: the largest warmed bucket is the pool's 8192 tokens already; the outputs are new,
    # [R_b, 1, V] float32 per bucket: rows 1 x 16 buckets, 2 x 15, 3 x 14, 4 x 14
    assert warm_output_bytes(4, 1000) == (16 + 2 * 15 + 3 * 14 + 4 * 14) * 1000 * 4
    # packed buckets (the GPU default) keep more: rows 1, 2 and 4 x the 28 token buckets up to 8192; the
    # reserve takes the larger of the two
    assert sum(r for r, _ in packed_warm_sizes(4)) == (1 + 2 + 4) * 28 > 144
    cold, warm = memory_spec(cfg, **kw), memory_spec(cfg, **kw, warm_rows=4, warm_head=True)
    assert warm.reserve_bytes - cold.reserve_bytes == 196 * 1000 * 4
    assert memory_spec(cfg, **kw, warm_rows=4).reserve_bytes == cold.reserve_bytes  # no head: no outputs
    # chunks of 512: the pool's largest bucket is 4 x 512 tokens, not 512; lengths 16..512 are 10 buckets a row count
    cold, warm = (memory_spec(cfg, **kw, prefill_tokens=512),
                  memory_spec(cfg, **kw, prefill_tokens=512, warm_rows=4, warm_head=True))
    # (padded: (1 + 2 + 3 + 4) x 10 rows; packed: 1 x 12 token buckets up to 512, 2 x 16 up to 1024, 4 x 20 up to 2048)
    assert warm.reserve_bytes - cold.reserve_bytes == per_token * (4 * 512 - 512) + (12 + 2 * 16 + 4 * 20) * 1000 * 4
    # chunked: the continued buckets' 10 outputs (lengths 16..512), a 512-row mask over every storage row
    # (bf16 and its booleans) and one slot's K and V; no warm-up: the mask and K/V only
    chunked = memory_spec(cfg, **kw, prefill_tokens=512, warm_rows=4, warm_head=True, chunked=True)
    assert chunked.reserve_bytes - warm.reserve_bytes == 10 * 1000 * 4
    assert chunked.row_bytes - warm.row_bytes == 512 * 3 + 2 * 2 * 16 * 2
    assert memory_spec(cfg, **kw, prefill_tokens=512, chunked=True).reserve_bytes == cold.reserve_bytes
    # the serve config's default warms 4 rows: the target keeps outputs, the draft only the larger pool
    config = dict(backend="numpy", batch=4, k=2, rounds=3, capacity="auto", model="tiny-random")
    on, off = memory_specs(ServeConfig(**config), 512), memory_specs(ServeConfig(**config, prefill_warmup=0), 512)
    t_cfg, d_cfg = tiny_random_configs()
    assert on[0].reserve_bytes - off[0].reserve_bytes == \
        t_cfg.activation_bytes_per_token(4) * 1536 + 124 * t_cfg.vocab_size * 4
    assert on[1].reserve_bytes - off[1].reserve_bytes == d_cfg.activation_bytes_per_token(4) * 1536


@pytest.mark.parametrize("value", [-1, 65537, 2.0, True, "4"])
def test_the_config_refuses_a_bad_prefill_warmup(value):
    with pytest.raises(ConfigError) as err:
        ServeConfig(prefill_warmup=value)
    assert err.value.field == "prefill_warmup"


def test_the_config_default_and_tp():
    assert ServeConfig().warmup_rows == 4 and ServeConfig(prefill_warmup=0).warmup_rows == 0
    with pytest.raises(ConfigError, match="tensor-parallel") as err:
        ServeConfig(model="tiny-random", tp=2, prefill_warmup=4)
    assert err.value.field == "prefill_warmup"


def test_warm_models_goes_through_the_hook():
    backend = Backend("numpy")
    models = _adapters(backend)
    # rows 1, 2 x lengths 16, 32, each model; chunks of 20: the continued (1, 32), (1, 16), both heads
    # in the target, the draft's without, and the target's fresh (1, 32), (1, 16) without a head
    done = warm_models(models, 2, 20)
    assert done["buckets"] == 8 + 4 + 2 + 2 and done["seconds"] > 0
    stubs = stub_pair(2, 97, 2, 1, 64, backend="numpy")
    assert warm_models((*stubs, None), 4) is None  # the hook's default: nothing to warm, no line
    lines = []
    build_loop(ServeConfig(backend="numpy", batch=2, vocab=97, capacity=64), log=lines.append)
    assert lines == []


# ---------------------------------------------------------------------- on the GPU


def _decoder(backend, packed=False):
    models = _adapters(backend, packed=packed)
    dec = SpecDecoder(*models, k=3, m_rounds=2)
    return dec, models, poison(models)


@pytest.mark.gpu
@requires_gpu
def test_gpu_warm_up_captures_and_leaves_the_readable_kv():
    dec, models, before = _decoder(Backend("cupy"))
    done = [m.warm_prefill(3) for m in models]
    sizes = warm_sizes(3, max_length=CAPACITY)
    assert [d["buckets"] for d in done] == [len(sizes)] * 2 and all(d["device_bytes"] > 0 for d in done)
    assert models[0].prefill_graphs.info() == {(r, p, True): True for r, p in sizes}
    assert models[1].prefill_graphs.info() == {(r, p, False): True for r, p in sizes}
    assert [m.prefill_graphs.captures for m in models] == [len(sizes)] * 2
    check_untouched(models, before)


@pytest.mark.gpu
@requires_gpu
def test_gpu_a_warmed_buckets_first_call_replays_without_a_sync_or_capture(rng):
    dec, models, _ = _decoder(Backend("cupy"))
    for m in models:
        m.warm_prefill(3)
    captures = [m.prefill_graphs.captures for m in models]
    for n in (3, 1, 2):  # buckets (3, 32), (1, 32), (2, 32): each first used here
        prompts = {b: rng.integers(0, 512, 20 + b).astype(np.int32) for b in range(n)}
        prefill_fresh(dec, prompts, 30, no_sync=True)  # a replay never syncs (the capture count is checked below)
        assert [m.prefill_graphs.captures for m in models] == captures, f"{n} rows: captured at serving time"
        assert_decodes_greedy(dec, prompts, 30, scratch_row=BATCH - 1, label=f"{n} rows")


@pytest.mark.gpu
@requires_gpu
def test_gpu_build_loop_warms_both_models_and_logs_one_line():
    lines = []
    loop = build_loop(ServeConfig(backend="cupy", model="tiny-random", batch=4, capacity=256), log=lines.append)
    # fp32 (the config's default dtype) takes no flash kernel, so the default keeps padded buckets
    assert not loop.dec.target.packed_prefill
    n = len(loop.dec.target.prefill_graphs.warm_sizes(4, max_length=256))
    assert lines == [lines[0]] and lines[0].startswith(f"prefill warm-up: {2 * n} buckets captured in ")
    assert loop.dec.target.prefill_graphs.captures == loop.dec.draft.prefill_graphs.captures == n
