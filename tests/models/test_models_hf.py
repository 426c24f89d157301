"""Every architecture graphburst loads, against transformers: Mistral, Qwen2/2.5, Qwen3.

Each family's checkpoint is a tiny random model that transformers builds and saves
itself (``save_pretrained``), at odd sizes: query groups of 3 (6 heads over 2 KV heads),
Qwen3's ``head_dim`` unrelated to ``hidden / heads``, non-zero q/k/v biases (transformers
initialises biases to zero, which would hide a dropped bias), norm weights off 1 (so a
q/k norm applied to the wrong heads shows). The draft is a 1-layer model of the same
family holding the target's first layer, embeddings, norm and head (a Qwen3 draft for a
Qwen3 target, and so on), so acceptance is real. Llama itself is tests/models/test_llama_hf.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig as LlamaConfig_HF, LlamaForCausalLM, MistralConfig, MistralForCausalLM, \
    Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from graphburst.models.checkpoint import load_llama
from graphburst.models.llama_config import CheckpointError, LlamaConfig

from marks import requires_gpu
from test_llama_hf import decode as hf_decode

torch.set_num_threads(1)

VOCAB = 301
PROMPTS = [[5, 6, 7, 8, 9], [1, 2], list(range(40, 51))]  # ragged
NEW = 16
COMMON = dict(vocab_size=VOCAB, intermediate_size=86, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, initializer_range=0.15, eos_token_id=None, bos_token_id=None, pad_token_id=None)
FAMILIES = {
    # hidden 60 / 6 heads: head_dim 10; q/k/v biases always; tied head as on the small Qwen2.5 sizes
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(hidden_size=60, rope_theta=1e6, tie_word_embeddings=True,
                                            use_sliding_window=False, **COMMON)),
    # head_dim 16 with hidden 40 (6 x 16 = 96 != 40); q_norm/k_norm; tied
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(hidden_size=40, head_dim=16, rope_theta=1e6, tie_word_embeddings=True,
                                            **COMMON)),
    # Llama's function under another name; v0.3 configs have no sliding window
    "mistral": (MistralForCausalLM, MistralConfig(hidden_size=60, sliding_window=None, rope_theta=1e6,
                                                  tie_word_embeddings=False, **COMMON)),
}


@torch.no_grad()
def hf_pair(family: str, seed: int = 0):
    """(target with 2 layers, draft with its first layer), biases and norm weights randomised."""
    cls, cfg = FAMILIES[family]
    torch.manual_seed(seed)
    target = cls(cfg).eval()
    for name, p in target.named_parameters():
        if name.endswith("bias"):
            p.normal_(0.0, 0.5)
        elif name.endswith("norm.weight"):
            p.normal_(1.0, 0.2)
    small = {**cfg.to_dict(), "num_hidden_layers": 1}
    small.pop("layer_types", None)  # derived from the layer count (transformers checks they agree)
    draft = cls(type(cfg)(**small)).eval()
    draft.load_state_dict(target.state_dict(), strict=False)  # layer 1 is the target's alone
    return target, draft


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, HF target, target dir, draft dir)."""
    target, draft = hf_pair(request.param)
    root = tmp_path_factory.mktemp(request.param)
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return request.param, target, root / "target", root / "draft"


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_config_switches_follow_the_family(saved):
    family, hf, target_dir, _ = saved
    cfg = LlamaConfig.from_hf(json.loads((target_dir / "config.json").read_text()))
    assert cfg.model_type == family
    assert cfg.qkv_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    assert cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size or family != "qwen3"
    model = load_llama(target_dir, batch=1, capacity=16)
    theirs = {k: v for k, v in hf.state_dict().items() if "rotary" not in k}
    ours = {("" if k.startswith("lm_head.") else "model.") + k: v for k, v in model.hf_tensors().items()}
    if cfg.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert sorted(ours) == sorted(theirs)  # every HF tensor, and no other, under its HF name
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name


def test_logits_match_hf(saved):
    """Prefill logits, then a 3-token step at a ragged per-sequence position through the KV cache."""
    _, hf, target_dir, _ = saved
    model = load_llama(target_dir, batch=2, capacity=48)
    seq = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(seq).logits  # [2, 30, V]
        zero = torch.zeros(2, dtype=torch.int32)
        got = model(seq[:, :24], zero, [zero] * 2)
        torch.testing.assert_close(got, want[:, :24], atol=1e-4, rtol=1e-4)
        start = torch.tensor([24, 20], dtype=torch.int32)
        got = model(torch.stack([seq[0, 24:27], seq[1, 20:23]]), start, [start] * 2)
        torch.testing.assert_close(got[0], want[0, 24:27], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[1], want[1, 20:23], atol=1e-4, rtol=1e-4)


def decode(target_dir, draft_dir, backend: str, mode: str):
    return hf_decode(target_dir, draft_dir, backend, mode, PROMPTS, NEW)


@pytest.mark.parametrize("mode", ["per_round_sync", "graph"])
def test_speculative_tokens_match_hf_generate(saved, mode):
    _, hf, target_dir, draft_dir = saved
    got, acc = decode(target_dir, draft_dir, "numpy", mode)
    assert got == [hf_greedy(hf, p, NEW) for p in PROMPTS]
    assert acc[:, 0].sum() > 0  # drafts were accepted, so the accept path ran


@pytest.mark.parametrize("saved", ["qwen2"], indirect=True)
def test_a_qwen2_checkpoint_labelled_llama_is_refused(saved, tmp_path):
    """Its q/k/v biases would be dropped silently: the loader names the first unused tensor."""
    family, hf, _, _ = saved
    assert family == "qwen2"
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.self_attn\.[qkv]_proj\.bias' is not used"):
        load_llama(tmp_path, batch=1, capacity=8)


# ---------------------------------------------------------------------- GPU (H200)

@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("mode", ["pre_issued", "graph"])
def test_gpu_fp32_matches_hf_generate(saved, mode):
    _, hf, target_dir, draft_dir = saved
    got, acc = decode(target_dir, draft_dir, "cupy", mode)
    assert got == [hf_greedy(hf, p, NEW) for p in PROMPTS]
    assert acc[:, 0].sum() > 0


@pytest.mark.parametrize("cls, cfg", [
    (LlamaForCausalLM, LlamaConfig_HF(hidden_size=60, attention_bias=True, mlp_bias=True, **COMMON)),
    (Qwen3ForCausalLM, Qwen3Config(hidden_size=40, head_dim=16, attention_bias=True, tie_word_embeddings=True,
                                   **COMMON)),
], ids=["llama-attention-and-mlp-bias", "qwen3-attention-bias"])
def test_the_other_bias_switches_match_hf(cls, cfg, tmp_path):
    """attention_bias (q, k, v and o; Llama, Qwen3) and mlp_bias (Llama), with random biases: same logits."""
    torch.manual_seed(3)
    hf = cls(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    assert any(n.endswith("o_proj.bias") for n, _ in hf.named_parameters())
    hf.save_pretrained(tmp_path)
    model = load_llama(tmp_path, batch=1, capacity=32)
    seq = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        zero = torch.zeros(1, dtype=torch.int32)
        torch.testing.assert_close(model(seq, zero, [zero] * 2), hf(seq).logits, atol=1e-4, rtol=1e-4)
