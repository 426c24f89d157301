"""Every code example of the docs, run as it stands: docs/models.md and the README.

The worked protocol example of docs/models.md runs in every engine; its tokens must equal
the example's own CPU greedy reference, and afterwards every KV layer of both models must
hold exactly prompt + committed tokens below its length (which fails if the draft does
not cover ``[anchor, anchor + n_valid]`` or a rollback misses a layer). Each code block of
the page's PyTorch section runs on its own (so each carries its imports): the torch
adapter example against its oracle, the checkpoint example over tiny checkpoints saved
with transformers. The README's example runs against the stubs' greedy oracle.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "models.md"
README = ROOT / "README.md"
ENGINES = ("per_round_sync", "pre_issued", "graph", "gapless")
TORCH_SECTION = "\n## PyTorch models\n"


@pytest.fixture(scope="module")
def example() -> dict:
    # The worked CuPy/numpy example is everything before the PyTorch section, whose
    # snippets need checkpoints and are exercised by tests/models/test_llama_hf.py instead.
    page = DOC.read_text().split(TORCH_SECTION)[0]
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) >= 5, "docs/models.md lost its example code blocks"
    namespace = {"__name__": "models_doc"}
    exec(compile("\n".join(blocks), str(DOC), "exec"), namespace)  # noqa: S102 - the page is the test subject
    return namespace


@pytest.mark.parametrize("engine", ENGINES)
def test_doc_example_matches_its_greedy_reference(example, backend, engine):
    prompts, out, dec = example["demo"](backend, engine)
    vocab = dec.target.vocab
    for b, toks in enumerate(out):
        assert len(toks) > 0
        assert toks == example["bigram_reference"](prompts[b], len(toks), vocab), f"sequence {b}"
    acc = dec.accept_counters()
    assert acc[0, 0] == 0  # miss_every=1: every proposal is wrong, so none is accepted
    assert acc[1, 0] > acc[1, 1]  # miss_every=0: right until a break, so more than one per round
    for role in ("target", "draft"):
        cache = getattr(dec, role).cache
        for i, layer in enumerate(cache.layers):
            if layer is None:
                continue
            kv = dec.backend.to_host(layer.storage, dec.stream)
            lengths = dec.backend.to_host(layer.length, dec.stream)
            for b in range(len(prompts)):
                want = list(prompts[b]) + out[b]
                assert kv[b, : lengths[b]].tolist() == want, f"{role} layer {i}, sequence {b}"


def test_doc_example_options_are_validated(example):
    target = example["BigramTarget"](2, 50, 32, backend="numpy")
    draft = example["BigramDraft"](2, 50, 32, backend="numpy")
    import graphburst as gb

    dec = gb.SpecDecoder(target, draft, k=2, m_rounds=2)
    with pytest.raises(ValueError, match="unknown model option 'temperature'"):
        dec.slot_options({"temperature": 0.5})
    with pytest.raises(TypeError, match="miss_every must be an int"):
        dec.slot_options({"miss_every": "3"})
    with pytest.raises(ValueError, match=r"miss_every must be in \[0, 2\*\*31\), got -1"):
        dec.slot_options({"miss_every": -1})
    with pytest.raises(ValueError, match="got 2147483648"):  # an option column holds int32
        dec.slot_options({"miss_every": 2**31})
    dec.set_slot_options({0: dec.slot_options({"miss_every": 2}), 1: None})
    assert draft.miss_every.tolist() == [2, 5]
    dec.set_slot_options({0: None})  # a reused slot gets the default back
    assert draft.miss_every.tolist() == [5, 5]
    # at admission the column is written with the slot table: slot 1 only, slot 0 keeps its value
    dec.set_slot_options({0: dec.slot_options({"miss_every": 3})})
    dec.prefill_checked({1: np.array([4, 5], np.int32)}, {1: 0}, options={1: dec.slot_options({"miss_every": 1})})
    assert draft.miss_every.tolist() == [3, 1]


def _blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _run_block(block: str, where: str) -> dict:
    namespace = {"__name__": "doc_block"}
    exec(compile(block, where, "exec"), namespace)  # noqa: S102 - the page is the test subject
    return namespace


def _torch_block(defines: str) -> dict:
    """The one code block of the PyTorch section that defines ``defines``, run on its own."""
    pytest.importorskip("torch")
    found = [b for b in _blocks(DOC.read_text().split(TORCH_SECTION)[1]) if f"def {defines}(" in b]
    assert len(found) == 1, f"docs/models.md's PyTorch section lost the block defining {defines}"
    return _run_block(found[0], f"{DOC} ({defines})")


@pytest.mark.parametrize("writes_verify_tokens", [True, False])
def test_doc_torch_adapter_example_matches_its_oracle(backend, writes_verify_tokens):
    ns = _torch_block("run_pair")
    prompts = [[5], [3, 14, 15, 92], [65, 35]]
    out, dec = ns["run_pair"](prompts, backend=backend, writes_verify_tokens=writes_verify_tokens)
    assert dec.assemble is not writes_verify_tokens  # the adapter's vtok writes replace the assemble launch
    for b, prompt in enumerate(prompts):
        assert len(out[b]) >= 16
        assert out[b] == ns["bigram_greedy"](dec.target.module, prompt, len(out[b])), f"sequence {b}"
    acc = dec.accept_counters()
    assert 0 < acc[:, 0].sum() < acc[:, 1].sum() * dec.k  # the noisy draft is right sometimes, not always


def test_doc_checkpoint_example_runs_on_saved_checkpoints(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, eos_token_id=None,
                                   bos_token_id=None, pad_token_id=None)
    target = transformers.LlamaForCausalLM(cfg).eval()
    draft = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1}))
    draft.load_state_dict(target.state_dict(), strict=False)  # the target's first layer: an early exit
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    prompts = [[5, 6, 7, 8], [1, 2]]
    out = _torch_block("generate")["generate"](tmp_path / "target", tmp_path / "draft", prompts, new_tokens=12,
                                               backend="numpy", dtype="float32")
    for b, prompt in enumerate(prompts):
        assert len(out[b]) >= 12
        with torch.no_grad():
            want = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   do_sample=False, max_new_tokens=12)[0, len(prompt):].tolist()
        assert out[b][:12] == want, f"sequence {b}"


def test_readme_example_matches_greedy():
    import graphburst as gb

    blocks = _blocks(README.read_text())
    assert len(blocks) == 1, "the README's Python example moved"
    ns = _run_block(blocks[0], str(README))
    assert ns["dec"].backend.name in ("numpy", "cupy")
    for b, prompt in enumerate([[1, 2, 3], [4], [5, 6], [7]]):
        toks = ns["tokens"][b].tolist()
        assert 0 < len(toks) and toks == gb.greedy_reference(prompt, len(toks), 32000), f"sequence {b}"
