"""``--capacity auto``: KV bytes per row from model configs, the sizing arithmetic, its errors and flags.

The figures are checked against hand-computed ones (a Llama-3.2-1B-shaped config, Qwen3-0.6B
whose head_dim is not hidden / heads, GQA, the n-gram draft, the stubs), and the specs
against what the models really allocate on the CPU; the GPU tests build a pair at the
chosen capacity on the device and check it stays inside the fraction.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from graphburst import greedy_reference
from graphburst.backend import Backend
from graphburst.buffers import StreamBufs
from graphburst.models.capacity import RUNTIME_RESERVE_BYTES, MemorySpec, auto_capacity, device_memory
from graphburst.models.llama import Llama
from graphburst.models.llama_config import CheckpointError, LlamaConfig
from graphburst.models.llama_memory import DEFAULT_PREFILL_TOKENS, memory_spec, weight_bytes
from graphburst.models.ngram import NgramDraft
from graphburst.models.stubs import STUB_MAX_CAPACITY, stub_kv_bytes_per_row, stub_pair
from graphburst.serving.factory import ConfigError, ServeConfig, build_loop, memory_specs, resolve_capacity
from graphburst.serving.request import Request
from device_memory import held_bytes, own_device_bytes, peak_bytes, release_cached_blocks
from marks import requires_gpu
from test_cli import cli, one_line_error

GiB, KiB = 2**30, 2**10
BUDGET = 4 * GiB  # past what is in use: the in-process GPU test's sizing budget
CLI_BUDGET = 8 * GiB  # the command's: room too for what other processes allocate while it starts

#: Llama-3.2-1B's config.json (the shapes; 1.24 B parameters, tied head)
LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": True,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}}
#: Qwen3-0.6B's: head_dim 128 while hidden / heads = 1024 / 16 = 64; q/k norms; tied head
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", "hidden_size": 1024,
             "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
             "rope_theta": 1000000, "tie_word_embeddings": True, "use_sliding_window": False}


# ---------------------------------------------------------------------- bytes per row, from configs


def test_llama_1b_kv_row_is_32_kib_in_bf16():
    cfg = LlamaConfig.from_hf(LLAMA_1B)
    assert cfg.kv_bytes_per_row(2) == 16 * 2 * 8 * 64 * 2 == 32 * KiB  # layers x (K, V) x KV heads x head_dim x 2 B
    assert cfg.kv_bytes_per_row(4) == 64 * KiB
    assert cfg.max_position_embeddings == 131072


def test_qwen3_kv_row_uses_head_dim_not_hidden_over_heads():
    cfg = LlamaConfig.from_hf(QWEN3_06B)
    assert cfg.kv_bytes_per_row(2) == 28 * 2 * 8 * 128 * 2 == 112 * KiB  # hidden / heads would give 56 KiB
    assert cfg.max_position_embeddings == 40960


def test_gqa_kv_row_counts_kv_heads_not_query_heads():
    mha = LlamaConfig.from_hf({**LLAMA_1B, "num_key_value_heads": 32})
    assert mha.kv_bytes_per_row(2) == 4 * LlamaConfig.from_hf(LLAMA_1B).kv_bytes_per_row(2) == 128 * KiB


def test_ngram_and_stub_rows():
    assert NgramDraft.kv_bytes_per_row() == 4  # one int32 token of history
    assert stub_kv_bytes_per_row(4) == 16 and stub_kv_bytes_per_row([True, False, True]) == 8


@pytest.mark.parametrize("value", [0, -1, "4096", True, 1.5])
def test_a_bad_max_position_embeddings_is_refused(value):
    with pytest.raises(CheckpointError, match=f"max_position_embeddings must be a positive int, got {value!r}"):
        LlamaConfig.from_hf({**LLAMA_1B, "max_position_embeddings": value})
    assert LlamaConfig.from_hf({k: v for k, v in LLAMA_1B.items() if k != "max_position_embeddings"}) \
        .max_position_embeddings is None


def test_weights_and_activations_of_released_shapes():
    # Llama-3.2-1B: embed 128256 x 2048 (tied) + 16 x (q, o 2048^2; k, v 2048 x 512; gate, up, down 2048 x 8192;
    # two norms) + the final norm = 1,235,814,400 parameters.
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048
    assert weight_bytes(LlamaConfig.from_hf(LLAMA_1B), torch.bfloat16) == 2 * (128256 * 2048 + 16 * per_layer + 2048) \
        == 2 * 1_235_814_400
    # Qwen3-0.6B: q 1024 x 2048, o 2048 x 1024, k, v 1024 x 1024, MLP 3 x 1024 x 3072, norms, q/k norms [128]
    per_layer = 2 * 1024 * 2048 + 2 * 1024 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128
    assert weight_bytes(LlamaConfig.from_hf(QWEN3_06B), torch.bfloat16) == 2 * (151936 * 1024 + 28 * per_layer + 1024) \
        == 2 * 596_049_920
    # activations per token, bf16: 4 x hidden + 4 x intermediate + 8 x (32 + 2 x 8) x 64
    assert LlamaConfig.from_hf(LLAMA_1B).activation_bytes_per_token(2) == 2 * (8192 + 32768 + 24576) == 128 * KiB


def test_llama_1b_target_spec():
    spec = memory_spec(LlamaConfig.from_hf(LLAMA_1B), name="target", dtype=torch.bfloat16, batch=64, decode_tokens=5)
    assert spec.slot_row_bytes == 32 * KiB
    # int32 offsets: 64 slots x rows x 8 KV heads x 64 < 2**31 -> 65535 rows -> 65520 (x16) - 66 slack
    assert (spec.max_capacity, spec.max_capacity_why) == (65454, "int32 KV offsets at batch 64")
    small = memory_spec(LlamaConfig.from_hf(LLAMA_1B), name="target", dtype=torch.bfloat16, batch=8, decode_tokens=5)
    assert (small.max_capacity, small.max_capacity_why) == (131072, "max_position_embeddings")
    assert (spec.slack_rows, spec.row_multiple) == (66, 16)  # MAX_K + 2 write slack, rows rounded to 16
    # RoPE cos and sin [rows, 64] fp32, the prefill's and the verify's masks (bf16 plus a bool), and one
    # layer's K and V gathered for the prefilled slots (64 x 2 x 8 x 64 x 2 B), per row
    assert spec.row_bytes == 2 * 64 * 4 + (DEFAULT_PREFILL_TOKENS + 64 * 5) * 3 + 64 * 2 * 8 * 64 * 2
    assert spec.fixed_bytes == 2 * 1_235_814_400
    # activations: an eager prefill, the prefill graphs' pool (its largest bucket: as many tokens) and a verify
    assert spec.reserve_bytes == 128 * KiB * (2 * DEFAULT_PREFILL_TOKENS + 64 * 5) + 64 * 6 * 128256 * (2 + 16)


def test_specs_match_what_the_models_allocate():
    """The spec's storage rows, RoPE rows and weights against a model really built (CPU), at two capacities
    (one a multiple of 16, one not), and the stubs', the n-gram draft's and the burst buffers'."""
    cfg = LlamaConfig.from_hf({**QWEN3_06B, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 300})
    spec = memory_spec(cfg, name="target", dtype=torch.float32, batch=3, decode_tokens=5, prefill_tokens=0)
    for capacity in (128, 100):
        model = Llama(cfg, batch=3, capacity=capacity)
        assert sum(kv.nbytes for kv in model.kv) == 3 * spec.rows(capacity) * spec.slot_row_bytes
        rope = model.rope_cos.nbytes + model.rope_sin.nbytes
        # less the verify mask's share and the prefill's gathered K and V
        assert rope == spec.rows(capacity) * (spec.row_bytes - 3 * 5 * 5 - 3 * 2 * 2 * 32 * 4)
        assert sum(p.nbytes for p in model.parameters()) == spec.fixed_bytes
    target, draft = stub_pair(3, 97, [True, False, True], 1, 100, backend="numpy")
    assert sum(layer.storage.nbytes for layer in target.cache.layers if layer) == 3 * 100 * stub_kv_bytes_per_row(
        [True, False, True])
    assert NgramDraft(3, 97, 100, backend="numpy").hist.nbytes == 3 * 100 * NgramDraft.kv_bytes_per_row()
    for vocab in (None, 5003):
        assert StreamBufs.layout_nbytes(3, 4, 2, vocab) == StreamBufs(3, 4, 2, "numpy", vocab=vocab).nbytes


# ---------------------------------------------------------------------- the arithmetic


TARGET = MemorySpec("target", 32 * KiB, slack_rows=66, row_multiple=16, fixed_bytes=2 * GiB, reserve_bytes=GiB)
DRAFT = MemorySpec("draft", 4 * KiB, fixed_bytes=GiB, reserve_bytes=GiB // 2)


def test_auto_capacity_by_hand():
    # 80 GiB x 0.9 - 1 GiB in use - 3 GiB weights - 1.5 GiB reserves - 0.5 GiB runtime reserve = 66 GiB;
    # 64 slots x 36 KiB = 2.25 MiB a row: 30037 rows, 30016 as a multiple of 64; the target's 66 slack rows
    # (30016 + 66 -> 30096 rows) pass 66 GiB, so 29952: 30032 x 2 MiB + 29952 x 256 KiB = 65.97 GiB.
    assert RUNTIME_RESERVE_BYTES == GiB // 2
    plan = auto_capacity([TARGET, DRAFT], batch=64, gpu_memory_fraction=0.9, free_bytes=79 * GiB, total_bytes=80 * GiB)
    assert plan.capacity == 29952 and plan.limit is None
    assert plan.kv_bytes == 30032 * 2 * 2**20 + 29952 * 256 * KiB <= 66 * GiB
    assert "capacity 29952 KV entries per slot" in plan.describe()
    assert "(target 32 KiB + draft 4 KiB per row)" in plan.describe()
    # half the fraction: 80 x 0.45 - 1 - 3 - 2 = 30 GiB: 13653 rows, 13632 as a multiple of 64; its slack rows
    # (13712 x 2 MiB + 13632 x 256 KiB = 30.1 GiB) do not fit, 13568 (13648 x 2 MiB + 13568 x 256 KiB) does
    assert auto_capacity([TARGET, DRAFT], batch=64, gpu_memory_fraction=0.45, free_bytes=79 * GiB,
                         total_bytes=80 * GiB).capacity == 13568


def test_auto_capacity_is_capped_at_the_model_positions():
    capped = MemorySpec("target", 32 * KiB, max_capacity=4000, max_capacity_why="max_position_embeddings")
    plan = auto_capacity([capped, DRAFT], batch=64, free_bytes=79 * GiB, total_bytes=80 * GiB)
    assert plan.capacity == 4000 and plan.limit == "the target's max_position_embeddings"
    assert "(auto, capped by the target's max_position_embeddings: " in plan.describe()
    with pytest.raises(ValueError, match="the target's max_position_embeddings allows a capacity of 4000, below the "
                                         "4097 KV entries a slot needs"):
        auto_capacity([capped, DRAFT], batch=64, free_bytes=79 * GiB, total_bytes=80 * GiB, min_capacity=4097)


def test_the_smallest_useful_capacity_that_does_not_fit_is_an_error():
    # 8 GiB x 0.9 = 7.2 - 1 in use - 3 weights - 2 reserved = 1.2 GiB for KV. Capacity 64 (the smallest
    # multiple of 64 above 41) takes 64 x (144 x 32 KiB + 64 x 4 KiB) = 0.3 GiB at batch 64 (the target's
    # 64 + 66 slack rows round to 144): it fits; at batch 512, 2.375 GiB does not.
    with pytest.raises(ValueError) as info:
        auto_capacity([TARGET, DRAFT], batch=512, free_bytes=7 * GiB, total_bytes=8 * GiB, min_capacity=41)
    assert str(info.value).startswith("batch 512 x (target 32 KiB + draft 4 KiB per row) needs 2.4 GiB for capacity "
                                      "64; 1.2 GiB available at --gpu-memory-fraction 0.9 (8.0 GiB x 0.9, less 1.0 GiB "
                                      "in use, 3.0 GiB of weights and buffers, 2.0 GiB reserved for activations)")
    assert auto_capacity([TARGET, DRAFT], batch=64, free_bytes=7 * GiB, total_bytes=8 * GiB,
                         min_capacity=41).capacity >= 64


@pytest.mark.parametrize("kw, error", [(dict(gpu_memory_fraction=0), ValueError),
                                       (dict(gpu_memory_fraction=1.5), ValueError),
                                       (dict(gpu_memory_fraction="x"), TypeError),
                                       (dict(gpu_memory_fraction=float("nan")), ValueError),
                                       (dict(free_bytes=GiB), ValueError),  # without total_bytes
                                       (dict(free_bytes=2 * GiB, total_bytes=GiB), ValueError),
                                       (dict(batch=0), ValueError)])
def test_auto_capacity_checks_its_arguments(kw, error):
    args = dict(batch=4) if "free_bytes" in kw else dict(batch=4, free_bytes=GiB, total_bytes=2 * GiB)
    with pytest.raises(error):
        auto_capacity([DRAFT], **{**args, **kw})


def test_without_a_gpu_auto_needs_figures():
    with pytest.raises(ValueError, match="numpy backend has no GPU"):
        auto_capacity([DRAFT], batch=4, backend=Backend("numpy"))
    config = ServeConfig(backend="numpy", capacity="auto")
    with pytest.raises(ValueError, match="numpy backend has no GPU"):
        build_loop(config)


# ---------------------------------------------------------------------- ServeConfig and the loop


@pytest.mark.parametrize("kw, field", [(dict(capacity="auto", gpu_memory_fraction=0), "gpu_memory_fraction"),
                                       (dict(capacity="auto", gpu_memory_fraction=1.5), "gpu_memory_fraction"),
                                       (dict(capacity="auto", gpu_memory_fraction="x"), "gpu_memory_fraction"),
                                       (dict(capacity="auto", gpu_memory_fraction=True), "gpu_memory_fraction"),
                                       (dict(capacity=4096, gpu_memory_fraction=0.5), "gpu_memory_fraction"),
                                       (dict(capacity="automatic"), "capacity"),
                                       (dict(capacity="auto", model="tiny-random", tp=2), "capacity")])
def test_serve_config_refuses_bad_auto_fields(kw, field):
    with pytest.raises(ConfigError) as info:
        ServeConfig(**kw)
    assert info.value.field == field, info.value


def test_resolve_capacity_sizes_a_buildable_loop():
    """Figures chosen so that exactly 256 entries fit the stub pair: the loop is built there and serves."""
    config = ServeConfig(backend="numpy", batch=2, k=2, rounds=3, vocab=97, capacity="auto")
    assert config.gpu_memory_fraction == 0.9
    specs = memory_specs(config)
    assert [(s.name, s.slot_row_bytes) for s in specs] == [("target", 16), ("draft", 4), ("decoder", 4)]
    fixed = sum(s.fixed_bytes + s.reserve_bytes for s in specs) + RUNTIME_RESERVE_BYTES
    total = -(-(fixed + 2 * 24 * 256) * 10 // 9)  # 2 slots x 24 B x 256 rows, at 0.9
    resolved, plan = resolve_capacity(config, free_bytes=total, total_bytes=total)
    assert plan.capacity == resolved.capacity == 256 and resolved.gpu_memory_fraction is None
    assert resolve_capacity(config, free_bytes=total + 2 * 24 * 64, total_bytes=total + 2 * 24 * 64)[1].capacity == 256
    assert resolve_capacity(config, free_bytes=total + 2 * 24 * 80, total_bytes=total + 2 * 24 * 80)[1].capacity == 320
    assert resolve_capacity(resolved) == (resolved, None)  # a number stays
    loop = build_loop(resolved)
    assert loop.dec.capacity == 256
    state = loop.submit(Request([1, 2, 3], 20))
    loop.run_until_idle()
    assert state.tokens == greedy_reference([1, 2, 3], 20, 97)


def test_stub_and_ngram_specs_of_a_config():
    specs = memory_specs(ServeConfig(backend="numpy", batch=2, capacity="auto", draft="ngram"))
    assert [(s.name, s.slot_row_bytes) for s in specs] == [("target", 16), ("n-gram draft", 4), ("decoder", 4)]
    assert specs[0].max_capacity == STUB_MAX_CAPACITY
    plan = auto_capacity(specs, batch=2, free_bytes=79 * GiB, total_bytes=80 * GiB)
    assert plan.capacity == STUB_MAX_CAPACITY and plan.limit == "the target's stub limit"


def test_tiny_random_pair_built_at_the_plan_allocates_what_it_said():
    """Figures for exactly 128 entries of the tiny-random pair: the loop built there holds the KV and RoPE
    bytes the plan counted for them, and serves as full-recompute greedy decoding does."""
    config = ServeConfig(backend="numpy", batch=2, k=2, rounds=3, capacity="auto", model="tiny-random")
    specs = memory_specs(config)
    target, draft, _ = specs
    assert (target.slot_row_bytes, draft.slot_row_bytes) == (4 * 2 * 2 * 16 * 4, 1 * 2 * 2 * 16 * 4)  # fp32
    chunked = memory_specs(config, prefill_tokens=512)[0]  # a smaller prefill: smaller masks and activations
    assert target.row_bytes - chunked.row_bytes == (DEFAULT_PREFILL_TOKENS - 512) * 5
    assert target.reserve_bytes > chunked.reserve_bytes
    need = sum(s.bytes_at(128, 2) for s in specs) + RUNTIME_RESERVE_BYTES
    resolved, plan = resolve_capacity(config, free_bytes=-(-need * 10 // 9), total_bytes=-(-need * 10 // 9))
    assert plan.capacity == 128
    loop = build_loop(resolved, Backend("numpy"))
    assert loop.dec.capacity == 128
    for spec, model in ((target, loop.dec.target.module), (draft, loop.dec.draft.module)):
        rows = spec.rows(128)
        assert sum(kv.nbytes for kv in model.kv) == 2 * rows * spec.slot_row_bytes
        assert model.rope_cos.nbytes + model.rope_sin.nbytes == rows * 2 * 16 * 4
        assert sum(p.nbytes for p in model.parameters()) == spec.fixed_bytes
    state = loop.submit(Request([5, 6, 7], 12))
    loop.run_until_idle()
    assert state.tokens == loop.dec.target.module.greedy([5, 6, 7], 12)


def test_ngram_draft_of_a_checkpoint_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_1B))
    config = ServeConfig(backend="numpy", batch=64, capacity="auto", model=str(tmp_path), draft="ngram",
                         dtype="bfloat16")
    target, draft, _ = memory_specs(config)
    assert (target.slot_row_bytes, draft.slot_row_bytes, target.max_capacity) == (32 * KiB, 4, 65454)
    with pytest.raises(ValueError, match=r"batch 64 x \(target 32 KiB \+ n-gram draft 4 B \+ decoder 4 B per row\) "
                                         r"needs"):
        resolve_capacity(config, free_bytes=4 * GiB, total_bytes=5 * GiB)


# ---------------------------------------------------------------------- the command line


@pytest.mark.parametrize("args, flag", [(["--capacity", "auto"], "--capacity"),  # numpy: no GPU to size from
                                        (["--capacity", "auto", "--gpu-memory-fraction", "0"], "--gpu-memory-fraction"),
                                        (["--capacity", "auto", "--gpu-memory-fraction", "1.5"],
                                         "--gpu-memory-fraction"),
                                        (["--capacity", "auto", "--gpu-memory-fraction", "x"], "--gpu-memory-fraction"),
                                        (["--gpu-memory-fraction", "0.5"], "--gpu-memory-fraction"),  # without auto
                                        (["--capacity", "automatic"], "--capacity")])
def test_serve_capacity_flag_errors_are_one_line(args, flag):
    line = one_line_error(cli("serve", "--backend", "numpy", *args), flag)
    assert line.startswith("graphburst serve: error: ")


# ---------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("model", ["tiny-random", None])
def test_auto_capacity_builds_and_serves_on_the_gpu(model):
    """The pair built at the chosen capacity allocates, serves a request as greedy decoding would, and what
    this process allocated stays inside the budget the plan computed (the estimate did not undercount).

    The device's figures are read once here and handed to the sizing, with a fraction that leaves a
    budget of BUDGET past what is in use: the test's footprint is bounded whatever else holds the GPU
    (``pytest -n 4``, tools/gpu_load.py), and the check compares this process's own allocations with
    the figures the plan used, not with a later reading that other processes move."""
    gc.collect()  # earlier tests' dead decoders: their blocks go back to the pools, then to the device
    release_cached_blocks()
    before = held_bytes(own_device_bytes())
    free, total = device_memory(Backend("cupy"))
    fraction = min(1.0, (total - free + BUDGET) / total)
    extra = {"model": model} if model else {"vocab": 5003}
    config = ServeConfig(backend="cupy", batch=8, k=3, rounds=4, capacity="auto", gpu_memory_fraction=fraction,
                         **extra)
    resolved, plan = resolve_capacity(config, free_bytes=free, total_bytes=total)
    print(plan.describe())
    assert (plan.free_bytes, plan.total_bytes) == (free, total)
    assert plan.capacity >= 1 + 4 * 4 and (plan.capacity % 64 == 0 or plan.limit is not None)
    loop = build_loop(resolved)
    built = held_bytes(own_device_bytes()) - before  # the models, the KV and the prefill warm-up
    assert loop.dec.capacity == plan.capacity
    prompt = [1, 2, 3]
    state = loop.submit(Request(prompt, 16))
    loop.run_until_idle()
    ref = greedy_reference(prompt, 16, 5003) if model is None else loop.dec.target.module.greedy(prompt, 16)
    assert state.tokens == ref
    grown = held_bytes(own_device_bytes()) - before
    grew = f"grown {grown / GiB:.2f} GiB, {built / GiB:.2f} GiB of it once built"
    assert 0 < grown <= plan.available_bytes, (plan.describe(), grew, own_device_bytes(), peak_bytes())


@pytest.mark.gpu
@requires_gpu
def test_serve_capacity_auto_prints_the_capacity_on_the_gpu():
    """The command sizes from the GPU's own figures. Its fraction leaves CLI_BUDGET past what is in use
    as this test reads it, so the server's footprint stays bounded, and other processes on the GPU may
    take up to about that much more before it starts without leaving it short."""
    free, total = device_memory(Backend("cupy"))
    fraction = min(1.0, (total - free + CLI_BUDGET) / total)
    out = cli("serve", "--backend", "cupy", "--model", "tiny-random", "--batch", "4", "--capacity", "auto",
              "--gpu-memory-fraction", f"{fraction:.4f}", stdin=b'{"prompt": [1, 2, 3], "max_new_tokens": 8}\n',
              timeout=600)
    err = out.stderr.decode()
    assert out.returncode == 0, err
    assert "graphburst serve: capacity " in err and " KV entries per slot (auto" in err, err
    assert len(json.loads(out.stdout.decode().splitlines()[0])["tokens"]) == 8
