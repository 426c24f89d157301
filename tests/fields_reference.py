"""The host reference of the logits processing fields for the burst and serving tests: the stub
target's logits after a prefix, and a one-token-at-a-time greedy loop that applies transformers'
logits processors (and the plain presence/frequency rule) in vLLM's order."""

from __future__ import annotations

import numpy as np
import pytest

from graphburst.constants import NO_EOS
from graphburst.kernels import reference
from graphburst.kernels.digest import greedy_reference
from graphburst.models.stubs import LOGIT_SPREAD, TARGET_SALT

torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")

F32 = np.float32
VOCAB = 64
PEAK = 1.0  # a low peak: the fields change the argmax often


def stub_target_logits(prefix, vocab=VOCAB, peak=PEAK):
    """The stub target's logits after ``prefix``, from its definition (greedy oracle -> stub_logits)."""
    g = np.array([[greedy_reference(prefix, 1, vocab)[0]]], np.int32)
    logits = np.zeros((1, 1, vocab), F32)
    reference.stub_logits(g, np.array([len(prefix)], np.int32), logits, pos_offset=0, salt=TARGET_SALT,
                          spread=LOGIT_SPREAD, peak=peak)
    return logits[0, 0]


def host_decode(prompt, n, fields, eos=None, *, vocab=VOCAB, peak=PEAK):
    """One token at a time: transformers' processors in vLLM's order, presence/frequency, argmax
    (the stub target of ``vocab`` tokens and logit peak ``peak``)."""
    fields = fields or {}
    stop = NO_EOS if eos is None or fields.get("ignore_eos") else eos
    toks = []
    while len(toks) < n:
        ids = torch.tensor([list(prompt) + toks], dtype=torch.long)
        s = torch.tensor(stub_target_logits(list(prompt) + toks, vocab, peak))[None]
        if fields.get("min_tokens", 0) and stop != NO_EOS:
            s = lp.MinNewTokensLengthLogitsProcessor(len(prompt), fields["min_tokens"], stop)(ids, s)
        if fields.get("logit_bias"):
            s = lp.SequenceBiasLogitsProcessor([[[int(t)], float(v)] for t, v in fields["logit_bias"].items()])(ids, s)
        if fields.get("repetition_penalty", 1.0) != 1.0:
            s = lp.RepetitionPenaltyLogitsProcessor(float(F32(fields["repetition_penalty"])))(ids, s)
        x = s[0].numpy().astype(F32)
        counts = np.bincount(np.asarray(toks, np.int64), minlength=vocab) if toks else np.zeros(vocab, np.int64)
        fr, pr = F32(fields.get("frequency_penalty", 0.0)), F32(fields.get("presence_penalty", 0.0))
        if fr:
            x = (x - fr * counts.astype(F32)).astype(F32)
        if pr:
            x = np.where(counts > 0, x - pr, x).astype(F32)
        t = int(np.argmax(x))
        toks.append(t)
        if t == stop:
            break
    return toks


