"""The correctness rules of ``graphburst bench real``, applied before anything is timed.

* Engines with the same kernels as graphburst (gapless, vllm-style, eager) must produce
  **identical** tokens on every sequence's common prefix (one run's tokens a prefix of
  the other's). Each emits the target's greedy tokens, but in bf16 a forward captured
  in a graph and the same forward run eagerly may round differently (cuBLAS picks its
  algorithm per workspace), so a draft can be accepted one token more or less in a round
  and the same number of rounds can end a few tokens apart. Seen on the H200: eager 154
  tokens, graphburst 157, the first 154 identical.
* Engines with other kernels (HF in bf16, torch.compile) must agree with graphburst up
  to the end, or up to a first divergence that is a **near-tie**: there, the reference
  model's teacher-forced logits of the two tokens (graphburst's own Llama, same dtype)
  differ by at most ``tol * max(1, |top logit|)``. Tokens after a divergence are not
  compared (the continuations differ from there on); the agreed prefix is reported.
* At start-up, HF in fp32 must equal graphburst in fp32 (eager bursts, the same weights
  upcast) on a short prefix, under the same rule with ``FP32_TOL``.
"""

from __future__ import annotations

import warnings

from ..models.parity import NEAR_TIE_TOL, compare_tokens, first_divergence, teacher_forced_logits
from .real_engines import sync
from .real_report import SAME_KERNEL_ORDER, SAME_KERNEL_RULE

FP32_CHECK_TOKENS = 16
FP32_TOL = NEAR_TIE_TOL["float32"]


reference_logits = teacher_forced_logits  # the oracle of the near-tie rule (graphburst's own Llama)


def compare_other(name, tokens, ref, prompt, oracle, tol) -> dict:
    """The near-tie rule for one sequence of an engine with other kernels (raises AssertionError)."""
    out = compare_tokens(tokens, ref, lambda prefix: oracle(prompt, prefix), tol)
    if not out.pop("ok"):
        d = out["divergence"]
        raise AssertionError(f"{name}: token {d['at']} is {d['theirs']}, graphburst's is {d['ours']}, and the "
                             f"reference logits differ by {d['gap']:.4f} > {d['allowed']:.4f}: not a near-tie")
    return out


def fp32_check(src, draft, s, backend, prompt) -> dict:
    """HF fp32 against graphburst fp32 (eager bursts) on a short prefix, same weights upcast.

    ``draft``: the self-draft's depth, or a draft model of its own (upcast too).
    """
    import torch

    from ..engine.decoder import SpecDecoder
    from ..models.llama import Llama
    from ..models.torch_adapter import TorchDraft, TorchTarget
    from .real_engines import HFAssisted
    from .real_models import draft_instance

    dev = next(src.parameters()).device

    def upcast(model):
        out = Llama(model.cfg, batch=1, capacity=model.capacity, dtype=torch.float32, device=dev,
                    kv_slack=model.kv_slack)
        with torch.no_grad():
            for (_, dst), (_, p) in zip(out.named_parameters(), model.named_parameters()):
                dst.copy_(p)
        return out

    full = upcast(src)
    own = draft if isinstance(draft, int) else upcast(draft)  # the depth, or the upcast draft of its own
    draft = draft_instance(full, own)
    dec = SpecDecoder(TorchTarget(full, batch=1, capacity=full.capacity, backend=backend),
                      TorchDraft(draft, batch=1, capacity=full.capacity, backend=backend), k=s["k"], m_rounds=1)
    dec.prefill([prompt], max_new_tokens=FP32_CHECK_TOKENS)
    ours = []
    while len(ours) < FP32_CHECK_TOKENS:
        ours += dec.run_burst()[0].tolist()
    hf = HFAssisted(full, draft_layers=own, k=s["k"])
    hf.prefill([prompt])
    theirs = hf.target.generate(hf.prompt, attention_mask=torch.ones_like(hf.prompt), do_sample=False,
                                max_new_tokens=FP32_CHECK_TOKENS)[0, len(prompt):].tolist()
    res = compare_other("HF fp32 vs graphburst fp32", theirs, ours, prompt,
                        lambda p, pre: reference_logits(full, p, pre), FP32_TOL)
    del dec, hf, full, draft, own
    return res


def count_syncs(run_fn, cuda: bool):
    """Run once and count host syncs with torch's sync debug mode (GPU only; else None)."""
    import torch

    if not cuda:
        return run_fn(), None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            run = run_fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return run, sum("synchroniz" in str(w.message) for w in caught)


def check_config(engines, s, prompts, oracle, cuda) -> tuple[dict, dict]:
    """Run every engine once (also the warm-up) and apply the correctness rules; (runs, report).

    A same-kernel engine that differs raises AssertionError: graphburst itself would be
    wrong. An engine with other kernels that breaks the near-tie rule is reported with
    ``failed`` (and left out of ``runs``, so it is never timed) and the command exits 1
    after writing everything else: HF's numerics must not cost the rest of a GPU run.
    """
    rounds = s["rounds"]
    runs, report = {}, {}
    ref_name = next(n for n in SAME_KERNEL_ORDER if n in engines)
    for name, eng in engines.items():
        if not eng.same_kernels:
            continue
        eng.prefill(prompts)
        runs[name] = eng.run(rounds)
        sync_all(engines)
    ref = runs[ref_name].tokens
    for name, run in runs.items():
        common = check_common_prefix(name, run.tokens, ref, ref_name)
        report[name] = dict(rule=SAME_KERNEL_RULE, reference=ref_name, tokens=sum(map(len, run.tokens)),
                            common_prefix_tokens=common)
    for name, eng in engines.items():
        if eng.same_kernels:
            continue
        eng.prefill(prompts)
        run, syncs = count_syncs(lambda e=eng: e.run(rounds, tokens=len(ref[0])), cuda and name == "hf")
        run.syncs = syncs if name == "hf" else run.syncs
        runs[name] = run
        report[name] = dict(rule=f"near-tie, tol {s['tol']}", reference=ref_name)
        try:
            report[name]["sequences"] = [compare_other(name, got, want, p, oracle, s["tol"])
                                         for got, want, p in zip(run.tokens, ref, prompts)]
        except AssertionError as exc:
            report[name]["failed"] = str(exc)
            del runs[name]
    return runs, report


def check_common_prefix(name: str, tokens: list, ref: list, ref_name: str) -> int:
    """The same-kernel rule: every sequence of ``tokens`` equals ``ref``'s on their common prefix.

    bf16 graphed and eager runs of the same kernels can end a few tokens apart (a burst
    stops at a budget or EOS after a different number of rounds), so only the common
    prefix is compared. Returns the number of tokens compared.

    Raises
    ------
    AssertionError
        Naming the engine, the sequence and the first differing token.
    """
    common = 0
    for b, (got, want) in enumerate(zip(tokens, ref)):
        n = min(len(got), len(want))
        if got[:n] != want[:n]:
            at = first_divergence(got, want)
            raise AssertionError(f"{name} differs from {ref_name} (same kernels) in sequence {b} at token {at} "
                                 f"of {n}: {got[at:at + 4]} vs {want[at:at + 4]}")
        common += n
    return common


def sync_all(engines) -> None:
    for eng in engines.values():
        dev = getattr(eng, "device", None)
        if dev is not None:
            sync(dev)


