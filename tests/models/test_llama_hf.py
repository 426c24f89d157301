"""graphburst's Llama against transformers: logits, greedy tokens, assisted generation, loading.

Checkpoints are tiny random ``LlamaForCausalLM`` models the tests save themselves;
nothing is downloaded. The draft is a 1-layer model holding the target's first layer,
embeddings, norm and head, so it agrees with the target often and acceptance is real.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig as HFConfig
from transformers import LlamaForCausalLM

from graphburst import SpecDecoder
from graphburst.backend import Backend
from graphburst.capture import BurstGraph
from graphburst.models.checkpoint import load_llama, load_pair, tiny_random_pair
from graphburst.models.llama_config import LlamaConfig

from marks import requires_gpu

# Tiny tensors gain nothing from intra-op threads, and CI's 2 cores are shared with pytest itself.
torch.set_num_threads(1)

VOCAB = 512
PROMPTS = [[5, 6, 7, 8, 9], [1, 2], list(range(40, 51))]  # ragged
NEW = 20
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
VARIANTS = {
    "plain": {},
    "tied": {"tie_word_embeddings": True},
    "llama3": {"rope_scaling": LLAMA3},
}


def hf_pair(seed: int, **extra):
    """A random HF target (2 layers) and its 1-layer draft; no EOS, so generate never stops early."""
    torch.manual_seed(seed)
    cfg = HFConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, bos_token_id=None,
                   pad_token_id=None, **extra)
    target = LlamaForCausalLM(cfg).eval()
    draft = LlamaForCausalLM(HFConfig(**{**cfg.to_dict(), "num_hidden_layers": 1})).eval()
    draft.load_state_dict(target.state_dict(), strict=False)  # layer 1 is the target's alone
    return target, draft


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
    """(variant, HF target, HF draft, target dir, draft dir); the plain target is saved in shards."""
    target, draft = hf_pair(0, **VARIANTS[request.param])
    root = tmp_path_factory.mktemp(request.param)
    shard = {"max_shard_size": "100KB"} if request.param == "plain" else {}
    target.save_pretrained(root / "target", **shard)
    draft.save_pretrained(root / "draft")
    return request.param, target, draft, root / "target", root / "draft"


def hf_greedy(model, prompt, n, **kw):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


def test_variants_are_what_they_claim(saved):
    variant, _, _, target_dir, _ = saved
    files = sorted(p.name for p in target_dir.iterdir())
    if variant == "plain":
        assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    if variant == "tied":
        assert "lm_head.weight" not in load_file(target_dir / "model.safetensors")
    if variant == "llama3":
        assert LlamaConfig.from_hf(json.loads((target_dir / "config.json").read_text())).rope_scaling["rope_type"] \
            == "llama3"


def test_logits_match_hf(saved):
    """Prefill logits, then a 3-token step at a ragged per-sequence position through the KV cache."""
    _, hf, _, target_dir, _ = saved
    model = load_llama(target_dir, batch=2, capacity=64)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, VOCAB, (2, 30), generator=gen)
    with torch.no_grad():
        want = hf(seq).logits  # [2, 30, V]
        zero = torch.zeros(2, dtype=torch.int32)
        got = model(seq[:, :24], zero, [zero] * 2)
        torch.testing.assert_close(got, want[:, :24], atol=1e-4, rtol=1e-4)
        # Row 0 continues at 24, row 1 at 20 (its rows 20..23 are overwritten).
        start = torch.tensor([24, 20], dtype=torch.int32)
        step = torch.stack([seq[0, 24:27], seq[1, 20:23]])
        got = model(step, start, [start] * 2)
        torch.testing.assert_close(got[0], want[0, 24:27], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[1], want[1, 20:23], atol=1e-4, rtol=1e-4)


def decode(target_dir, draft_dir, backend: str, mode: str, prompts=PROMPTS, new: int = NEW):
    """Speculative greedy tokens of a saved checkpoint pair (k=3, M=2), run in ``mode``; and the accept counters."""
    target, draft = load_pair(target_dir, draft_dir, batch=len(prompts), capacity=64, backend=backend)
    dec = SpecDecoder(target, draft, k=3, m_rounds=2)
    dec.prefill(prompts, max_new_tokens=new)
    runner = BurstGraph(dec).run if mode == "graph" else (lambda: dec.run_burst(mode=mode))
    got = [[] for _ in prompts]
    while dec.host_left.any():
        tokens = runner()
        for b in range(len(prompts)):
            got[b] += tokens[b].tolist()
    return got, dec.accept_counters()


@pytest.mark.parametrize("mode", ["per_round_sync", "pre_issued", "graph"])
def test_speculative_tokens_match_hf_generate(saved, mode):
    _, hf, _, target_dir, draft_dir = saved
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    got, acc = decode(target_dir, draft_dir, "numpy", mode)
    assert got == want
    assert acc[:, 0].sum() > 0  # drafts were accepted, so the accept path ran


def test_matches_hf_assisted_generation(tmp_path):
    target, draft = hf_pair(3)
    target.save_pretrained(tmp_path / "t")
    draft.save_pretrained(tmp_path / "d")
    prompt = PROMPTS[0]
    want = hf_greedy(target, prompt, NEW, assistant_model=draft)
    t, d = load_pair(tmp_path / "t", tmp_path / "d", batch=1, capacity=64, backend="numpy")
    dec = SpecDecoder(t, d, k=4, m_rounds=3)
    dec.prefill([prompt], max_new_tokens=NEW)
    got = []
    while dec.host_left.any():
        got += dec.run_burst()[0].tolist()
    assert got == want


@pytest.mark.parametrize("name", [
    "model.layers.1.mlp.up_proj.weight",
    "lm_head.weight",  # an untied checkpoint without its head is refused, not silently tied
])
def test_missing_tensor_is_named(tmp_path, name):
    target, _ = hf_pair(0)
    target.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"lacks tensor '{name}'"):
        load_llama(tmp_path, batch=1, capacity=8)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "mistral"}, "model_type 'mistral' does not match architectures 'LlamaForCausalLM'"),
    ({"vocab_size": None}, "vocab_size must be a positive int"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope type 'yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "lacks 'low_freq_factor'"),
    ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
])
def test_bad_config_is_named(tmp_path, change, message):
    target, _ = hf_pair(0)
    target.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_llama(tmp_path, batch=1, capacity=8)


def test_missing_weights_file_is_named(tmp_path):
    target, _ = hf_pair(0)
    target.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_llama(tmp_path, batch=1, capacity=8)


def test_tiny_random_pair_matches_plain_greedy():
    """The in-memory demo pair's burst tokens equal a full-recompute greedy loop of its target."""
    target, draft = tiny_random_pair(batch=2, capacity=96, backend="numpy", seed=5)
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    dec = SpecDecoder(target, draft, k=4, m_rounds=2)
    dec.prefill(prompts, max_new_tokens=16)
    got = [[] for _ in prompts]
    while dec.host_left.any():
        tokens = dec.run_burst()
        for b in range(2):
            got[b] += tokens[b].tolist()
    reference, _ = tiny_random_pair(batch=1, capacity=96, backend="numpy", seed=5)
    model = reference.module
    for b, prompt in enumerate(prompts):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                zero = torch.zeros(1, dtype=torch.int32)
                seq.append(int(model(torch.tensor([seq]), zero, [zero] * 4)[0, -1].argmax()))
        assert got[b] == seq[len(prompt):]
    assert dec.accept_counters()[:, 0].sum() > 0


# ---------------------------------------------------------------------- GPU (H200)

def _launchable_or_skip(kernels: str) -> None:
    from graphburst.models import llama_decode

    why = llama_decode.pdl_unsupported(torch.device("cuda")) if kernels in ("pdl", "folded") else None
    if why is not None:
        pytest.skip(why)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("kernels", ["auto", "gemv", "pdl", "folded"])
@pytest.mark.parametrize("mode", ["pre_issued", "graph"])
def test_gpu_fp32_matches_hf_generate(saved, mode, kernels):
    """Every decode kernels choice (``serve --decode-kernels``) inside the bursts, eager and captured, decodes
    HF's greedy tokens in fp32."""
    _launchable_or_skip(kernels)
    _, hf, _, target_dir, draft_dir = saved
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    target, draft = load_pair(target_dir, draft_dir, batch=len(PROMPTS), capacity=64, backend="cupy",
                              decode_kernels=kernels)
    dec = SpecDecoder(target, draft, k=3, m_rounds=2)
    dec.prefill(PROMPTS, max_new_tokens=NEW)
    runner = BurstGraph(dec).run if mode == "graph" else dec.run_burst
    got = [[] for _ in PROMPTS]
    while dec.host_left.any():
        tokens = runner()
        for b in range(len(PROMPTS)):
            got[b] += tokens[b].tolist()
    assert got == want


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("kernels", ["auto", "folded"])
def test_gpu_bf16_eager_and_graph_tokens_identical(kernels):
    _launchable_or_skip(kernels)
    prompts = [[3, 1, 4, 1, 5], [9, 2], list(range(100, 117)), [7]]
    runs = []
    for use_graph in (False, True):
        target, draft = tiny_random_pair(batch=len(prompts), capacity=256, backend=Backend("cupy"), dtype="bfloat16",
                                         seed=11, decode_kernels=kernels)
        dec = SpecDecoder(target, draft, k=4, m_rounds=4)
        dec.prefill(prompts, max_new_tokens=120)
        runner = BurstGraph(dec).run if use_graph else dec.run_burst
        got = [[] for _ in prompts]
        while dec.host_left.any():
            tokens = runner()
            for b in range(len(prompts)):
                got[b] += tokens[b].tolist()
        runs.append((got, dec.accept_counters().tolist()))
    assert runs[0] == runs[1]
    assert all(len(g) == 120 for g in runs[0][0])
    assert np.asarray(runs[0][1])[:, 0].sum() > 0


def test_bf16_eager_and_numpy_graph_agree_on_cpu():
    """bf16 weights and KV through the whole adapter on CPU: eager and recorded-graph tokens are identical."""
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    runs = []
    for use_graph in (False, True):
        target, draft = tiny_random_pair(batch=2, capacity=96, backend="numpy", dtype="bfloat16", seed=7)
        assert target.module.kv[0].dtype == torch.bfloat16
        dec = SpecDecoder(target, draft, k=3, m_rounds=3)
        dec.prefill(prompts, max_new_tokens=24)
        runner = BurstGraph(dec).run if use_graph else dec.run_burst
        got = [[] for _ in prompts]
        while dec.host_left.any():
            tokens = runner()
            for b in range(2):
                got[b] += tokens[b].tolist()
        runs.append(got)
    assert runs[0] == runs[1] and all(len(g) == 24 for g in runs[0])
