"""The outside model of docs/models.md, run from the page itself, in every engine.

The code blocks of the page are executed as they stand; the tokens must equal the
example's own CPU greedy reference, and afterwards every KV layer of both models must
hold exactly prompt + committed tokens below its length (which fails if the draft does
not cover ``[anchor, anchor + n_valid]`` or a rollback misses a layer).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"
ENGINES = ("per_round_sync", "pre_issued", "graph", "gapless")
TORCH_SECTION = "\n## PyTorch models\n"


@pytest.fixture(scope="module")
def example() -> dict:
    # The worked CuPy/numpy example is everything before the PyTorch section, whose
    # snippets need checkpoints and are exercised by tests/test_llama_hf.py instead.
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
    with pytest.raises(ValueError, match="miss_every must be >= 0"):
        dec.slot_options({"miss_every": -1})
    dec.set_slot_options({0: dec.slot_options({"miss_every": 2}), 1: None})
    assert draft.miss_every.tolist() == [2, 5]
    dec.set_slot_options({0: None})  # a reused slot gets the default back
    assert draft.miss_every.tolist() == [5, 5]
