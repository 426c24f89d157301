"""Random cases of the logits processing kernels (``fields_ref``), shared by the CPU and GPU tests.

A case holds explicit token histories per slot (prompt, generated tokens ending with the
pending one, drafts), the buffers the kernels read built from them, and the settings; unused
rows and slots are poisoned with NaN so a kernel that touches them shows.
"""

from __future__ import annotations

import numpy as np

from graphburst.constants import MAX_LOGIT_BIAS, NO_EOS, PLACEHOLDER_TOKEN

F32 = np.float32


def make_case(rng, batch, k1, vocab, *, n_rows=None, breaks=True):
    """Buffers and histories of one random case: ``(bufs dict, histories list)``; a history is
    ``(prompt, generated, drafts)``, ``generated[-1]`` = ``vtok[b, 0]``."""
    n_rows = k1 if n_rows is None else n_rows
    logits = (rng.standard_normal((batch, n_rows, vocab)) * 3).astype(F32)
    logits[rng.random((batch, n_rows, vocab)) < 0.02] = 0.0  # exact zeros: repetition's l > 0 test
    vtok = np.full((batch, k1), PLACEHOLDER_TOKEN, np.int32)
    counts = np.zeros((batch, vocab), np.int32)
    seen = np.zeros((batch, vocab), np.uint8)
    prompt_len = np.zeros(batch, np.int32)
    pos = np.zeros(batch, np.int32)
    hist = []
    for b in range(batch):
        small = int(rng.integers(2, 12))  # a few repeated ids, so counts > 1 happen
        prompt = rng.integers(0, vocab, int(rng.integers(1, 9))).tolist()
        gen = rng.integers(0, small, int(rng.integers(1, 12))).tolist()
        n_valid = int(rng.integers(0, k1)) if breaks else k1 - 1
        drafts = rng.integers(0, small, n_valid).tolist()
        vtok[b, 0] = gen[-1]
        vtok[b, 1:1 + n_valid] = drafts
        np.add.at(counts[b], gen, 1)
        seen[b, prompt] = 1
        prompt_len[b] = len(prompt)
        pos[b] = len(prompt) + len(gen) - 1
        hist.append((prompt, gen, drafts))
    eos = rng.integers(0, 6, batch).astype(np.int32)
    eos[rng.random(batch) < 0.2] = NO_EOS
    bufs = {"logits": logits, "vtok": vtok, "pos": pos, "counts": counts, "prompt_seen": seen,
            "prompt_len": prompt_len, "eos": eos,
            "min_tokens": rng.choice(np.array([0, 0, 3, 8, 30], np.int32), batch),
            "presence": rng.choice(np.array([0, 0, 0.5, -1.25, 2], F32), batch),
            "frequency": rng.choice(np.array([0, 0, 0.3, -0.7, 2], F32), batch),
            "repetition": rng.choice(np.array([1, 1, 1.3, 0.8, 2], F32), batch),
            "bias_ids": np.zeros((batch, MAX_LOGIT_BIAS), np.int32),
            "bias_val": np.zeros((batch, MAX_LOGIT_BIAS), F32),
            "n_bias": np.zeros(batch, np.int32)}
    bufs["repetition"][0], bufs["frequency"][0] = 1.3, 0.3  # slot 0 always active
    for b in range(batch):
        n = int(rng.choice([0, 0, 1, 5, min(vocab, MAX_LOGIT_BIAS)]))
        ids = np.sort(rng.choice(vocab, n, replace=False)).astype(np.int32)
        bufs["bias_ids"][b, :n] = ids
        bufs["bias_val"][b, :n] = rng.uniform(-100, 100, n).astype(F32)
        bufs["bias_ids"][b, n:] = rng.integers(0, vocab, MAX_LOGIT_BIAS - n)  # stale entries: never read
        bufs["bias_val"][b, n:] = np.nan
        bufs["n_bias"][b] = n
    return bufs, hist


ARG_ORDER = ("logits", "vtok", "pos", "counts", "prompt_seen", "prompt_len", "eos", "min_tokens", "presence",
             "frequency", "repetition", "bias_ids", "bias_val", "n_bias")


def args(bufs, xp=np):
    """The kernel's arguments in order, as copies (the logits are processed in place)."""
    return [xp.array(bufs[name]) for name in ARG_ORDER]
