"""Prompt-lookup drafting on a tiny Llama against transformers'
``generate(prompt_lookup_num_tokens=k)``: the same tokens (and both equal plain greedy).

transformers takes the *earliest* matching window and graphburst the most recent one, so
the proposals may differ; the tokens cannot, since greedy speculation is lossless.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig as HFConfig
from transformers import LlamaForCausalLM

from graphburst import NgramDraft, SpecDecoder
from graphburst.capture import BurstGraph
from graphburst.models.checkpoint import load_llama, tiny_random_pair
from graphburst.models.ngram import ngram_for
from graphburst.models.torch_adapter import TorchTarget

torch.set_num_threads(1)

VOCAB, NEW, K = 512, 30, 4


def test_tokens_match_transformers_prompt_lookup(tmp_path):
    torch.manual_seed(0)
    cfg = HFConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, bos_token_id=None,
                   pad_token_id=None)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    seg = np.random.default_rng(0).integers(0, VOCAB, 12).tolist()
    # Ragged; the last prompt sends this model into a 2-token loop, where lookups are accepted.
    prompts = [seg + seg[:5], seg * 2 + seg[:3], [5, 6, 7, 8, 9]]
    want = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                          prompt_lookup_num_tokens=K)
        want.append(out[0, len(p):].tolist())
    target = TorchTarget(load_llama(tmp_path, batch=3, capacity=128), batch=3, capacity=128, backend="numpy")
    draft = NgramDraft(3, VOCAB, 128, n_min=1, n_max=2, backend="numpy")  # transformers' n range
    dec = SpecDecoder(target, draft, k=K, m_rounds=3)
    dec.prefill(prompts, max_new_tokens=NEW)
    run = BurstGraph(dec).run
    got = [[] for _ in prompts]
    while dec.host_left.any():
        tokens = run()
        for b in range(3):
            got[b] += tokens[b].tolist()
    assert got == want
    assert dec.accept_counters()[2, 0] > 0  # the looping sequence accepted lookups


@pytest.mark.parametrize("backend", ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("sampling", [False, True])
def test_tiny_llama_with_lookup_equals_its_greedy(backend, sampling):
    """A torch target (captured by torch on the GPU) with the lookup draft: the burst's tokens
    are the target's own full-recompute greedy tokens (temperature 0 in sampling mode)."""
    target, _ = tiny_random_pair(batch=3, capacity=160, backend=backend, seed=5)
    dec = SpecDecoder(target, ngram_for(target, n_min=1, n_max=3), k=4, m_rounds=4, sampling=sampling)
    prompts = [[3, 1, 4, 1, 5, 3, 1, 4], [9, 2], [7] * 6]
    graph = BurstGraph(dec)
    dec.prefill(prompts, max_new_tokens=40, **({"temperature": 0.0} if sampling else {}))
    got = [[] for _ in prompts]
    while dec.host_left.any():
        for b, t in enumerate(graph.run()):
            got[b] += t.tolist()
    for b, prompt in enumerate(prompts):
        assert got[b] == target.module.greedy(prompt, 40, row=b)
    assert dec.accept_counters()[:, 0].sum() > 0
