"""Sampling against greedy: the per-round cost of speculative rejection sampling.

:func:`sampling_cost` is model-agnostic: give it a factory of fresh (target, draft)
pairs, and it captures one greedy and one sampling burst graph of the same pair and
shape, replays them in rotation and reports median µs per round of each and the
overhead. ``graphburst bench latency --sampling`` runs it on the stub pair at k=4, M=8,
B=1 and 16; the real-model bench can call it with its Llama factory.
:func:`run_kernels` times each sampling op alone (``--sampling-model kernels``).
:func:`fields_cost` (``--sampling --fields``) adds the logits processing fields
(:data:`BENCH_FIELDS`, ``SpecDecoder(..., fields=True)``) to the sampling burst and reports
their cost per round, after checking a greedy fields burst token for token against a host
loop of the fields' numpy twin over the stub target's logits.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..engine.decoder import SpecDecoder
from ..capture import BurstGraph
from .common import VOCAB, check_greedy, fmt, new_table, random_prompts, stub_models

SHAPES = [dict(k=4, m=8, batch=1), dict(k=4, m=8, batch=16)]
WARM_BURSTS = 2


def _round_us(graphs: dict, *, bursts: int, reps: int, m: int) -> dict:
    """name -> median µs per round of each graph, its ``bursts`` timed bursts interleaved with the
    others' ``reps`` times (so drift on the device falls on every graph alike)."""
    backend = next(iter(graphs.values())).backend
    times = {name: [] for name in graphs}
    for _ in range(reps):
        for name, graph in graphs.items():
            times[name] += _time_bursts(graph, bursts, backend)
    return {name: statistics.median(t) / m for name, t in times.items()}


def capacity_needed(prompt_len: int, k: int, m: int, bursts: int) -> int:
    """KV entries per sequence that :func:`sampling_cost` writes with ``bursts`` timed bursts."""
    return prompt_len + (bursts + 2 * WARM_BURSTS) * m * (k + 1) + 8


def _time_bursts(graph: BurstGraph, n: int, backend) -> list:
    """Device µs per burst (CUDA events) on cupy, host µs on numpy; each burst drained."""
    out = []
    for _ in range(n):
        if backend.is_gpu:
            ev = (backend.xp.cuda.Event(), backend.xp.cuda.Event())
            graph.replay(timing_events=ev)
            graph.drain()
            out.append(backend.xp.cuda.get_elapsed_time(*ev) * 1e3)
        else:
            t0 = time.perf_counter()
            graph.run()
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def sampling_cost(make_pair, prompts, *, k: int, m: int, bursts: int, reps: int = 3, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int = 0, reference=None) -> dict:
    """Median µs per round of a greedy and a sampling burst graph of the same pair and shape.

    Parameters
    ----------
    make_pair : callable () -> (target, draft)
        Fresh models each call (two calls), batch = ``len(prompts)``, capacity at least
        :func:`capacity_needed` for ``reps * bursts`` bursts.
    prompts : list of token lists, one per slot
    k, m : drafts per round, rounds per burst
    bursts, reps : bursts per rotation and rotations (greedy and sampling alternate)
    temperature, top_k, top_p, seed : the sampling decoder's settings (seed + b per slot)
    reference : callable (prompts, outs) -> None, optional
        Checks the greedy decoder's first tokens before timing (raises on a mismatch).

    Returns
    -------
    dict
        ``greedy_round_us``, ``sampling_round_us``, ``overhead`` (sampling / greedy - 1),
        ``greedy_tokens_per_round`` and ``sampling_tokens_per_round`` (per sequence).
    """
    graphs, tokens = {}, {}
    for name, sampling in (("greedy", False), ("sampling", True)):
        target, draft = make_pair()
        dec = SpecDecoder(target, draft, k=k, m_rounds=m, sampling=sampling)
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p,
                  seed=[seed + b for b in range(len(prompts))]) if sampling else {}
        dec.prefill(prompts, **kw)
        graphs[name] = BurstGraph(dec)
        outs = [[] for _ in prompts]
        for _ in range(WARM_BURSTS):
            for b, t in enumerate(graphs[name].run()):
                outs[b] += t.tolist()
        if not sampling and reference is not None:
            reference(prompts, outs)
        tokens[name] = sum(len(o) for o in outs) / (len(prompts) * WARM_BURSTS * m)
    us = _round_us(graphs, bursts=bursts, reps=reps, m=m)
    g, s = us["greedy"], us["sampling"]
    return dict(greedy_round_us=g, sampling_round_us=s, overhead=s / g - 1,
                greedy_tokens_per_round=tokens["greedy"], sampling_tokens_per_round=tokens["sampling"])


#: The fields the ``--fields`` benchmark turns on for every slot (min_tokens and ignore_eos act only
#: around a stop token, which the benchmark's requests have none of).
BENCH_FIELDS = {"logit_bias": {t: (-1.0) ** t * (1 + t % 7) for t in range(3, VOCAB, VOCAB // 20)},
                "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2, "min_p": 0.05}
#: The correctness check's fields: BENCH_FIELDS with five tokens biased past the stub's greedy peak,
#: so the penalties decide among them and the fields change every sequence (a check that fields
#: ignored would pass could not fail).
CHECK_FIELDS = {**BENCH_FIELDS, "logit_bias": {**BENCH_FIELDS["logit_bias"], **{t: 14.0 for t in (5, 6, 7, 8, 9)}}}


def check_fields_greedy(what: str, prompts, outs, fields: dict, vocab: int = VOCAB) -> None:
    """Raise AssertionError unless each sequence's tokens are the stub target's greedy tokens with
    ``fields`` applied one token at a time on the host (``fields_ref.apply_fields``, the device
    kernel's twin, on the stub's own logits; min_p does nothing at temperature 0)."""
    from ..kernels import fields_ref, reference
    from ..kernels.digest import greedy_reference
    from ..models.stubs import LOGIT_SPREAD, TARGET_SALT, default_peak
    from ..sampling.params import check_fields as validate

    f = validate(**{n: v for n, v in fields.items() if n != "min_p"}, vocab=vocab)
    bias = f["logit_bias"]

    def one(v, dt):  # a [1] per-slot array
        return np.array([v], dt)

    ids = np.zeros((1, max(1, len(bias))), np.int32)
    val = np.zeros((1, max(1, len(bias))), np.float32)
    ids[0, :len(bias)] = [t for t, _ in bias]
    val[0, :len(bias)] = [v for _, v in bias]
    for b, (prompt, out) in enumerate(zip(prompts, outs)):
        counts = np.zeros((1, vocab), np.int32)
        seen = np.zeros((1, vocab), np.uint8)
        seen[0, prompt] = 1
        toks: list = []
        while len(toks) < len(out):
            prefix = list(prompt) + toks
            logits = np.zeros((1, 1, vocab), np.float32)
            g = np.array([[greedy_reference(prefix, 1, vocab)[0]]], np.int32)
            reference.stub_logits(g, one(len(prefix), np.int32), logits, pos_offset=0, salt=TARGET_SALT,
                                  spread=LOGIT_SPREAD, peak=default_peak(vocab))
            fields_ref.apply_fields(logits, np.zeros((1, 1), np.int32), one(len(prefix) - 1, np.int32), counts, seen,
                                    one(len(prompt), np.int32), one(-1, np.int32), one(f["min_tokens"], np.int32),
                                    one(f["presence_penalty"], np.float32), one(f["frequency_penalty"], np.float32),
                                    one(f["repetition_penalty"], np.float32), ids, val, one(len(bias), np.int32),
                                    step=0)
            t = int(np.argmax(logits[0, 0]))
            toks.append(t)
            counts[0, t] += 1
        if toks != list(out):
            raise AssertionError(f"{what}: sequence {b} differs from the host loop of the fields' twin")
        if toks == greedy_reference(list(prompt), len(toks), vocab):
            raise AssertionError(f"{what}: the fields changed nothing in sequence {b}: the check cannot tell")


def fields_cost(make_pair, prompts, *, k: int, m: int, bursts: int, reps: int = 3, fields: dict | None = None,
                check=None, check_fields: dict | None = None) -> dict:
    """Median µs per round of a sampling burst graph without and with the logits processing fields.

    Before timing, a fields decoder at temperature 0 with ``check_fields`` (default
    :data:`CHECK_FIELDS`) runs ``WARM_BURSTS`` graph bursts and ``check(prompts, outs,
    check_fields)`` must accept its tokens.
    Then a sampling decoder (T = 1) and a fields decoder (T = 1, ``fields``) are timed in
    rotation, as :func:`sampling_cost` does.

    Returns
    -------
    dict
        ``sampling_round_us``, ``fields_round_us``, ``fields_overhead`` (fields / sampling - 1),
        ``sampling_tokens_per_round``, ``fields_tokens_per_round`` (per sequence).
    """
    fields = BENCH_FIELDS if fields is None else fields
    check_fields = CHECK_FIELDS if check_fields is None else check_fields
    seeds = [b + 1 for b in range(len(prompts))]
    target, draft = make_pair()
    dec = SpecDecoder(target, draft, k=k, m_rounds=m, sampling=True, fields=True)
    dec.prefill(prompts, fields=check_fields)
    graph = BurstGraph(dec)
    outs = [[] for _ in prompts]
    for _ in range(WARM_BURSTS):
        for b, t in enumerate(graph.run()):
            outs[b] += t.tolist()
    if check is not None:
        check(prompts, outs, check_fields)
    del graph, dec
    graphs, tokens = {}, {}
    for name, with_fields in (("sampling", False), ("fields", True)):
        target, draft = make_pair()
        dec = SpecDecoder(target, draft, k=k, m_rounds=m, sampling=True, fields=with_fields)
        dec.prefill(prompts, temperature=1.0, seed=seeds, **({"fields": fields} if with_fields else {}))
        graphs[name] = BurstGraph(dec)
        n = 0
        for _ in range(WARM_BURSTS):
            n += sum(len(t) for t in graphs[name].run())
        tokens[name] = n / (len(prompts) * WARM_BURSTS * m)
    us = _round_us(graphs, bursts=bursts, reps=reps, m=m)
    s, f = us["sampling"], us["fields"]
    return dict(sampling_round_us=s, fields_round_us=f, fields_overhead=f / s - 1,
                sampling_tokens_per_round=tokens["sampling"], fields_tokens_per_round=tokens["fields"])


def run_fields(backend, *, reps: int, bursts: int, label: str):
    """:func:`fields_cost` on the stub pair at SHAPES (numpy: B = 1 only): (results, rich table)."""
    shapes = SHAPES if backend.is_gpu else SHAPES[:1]
    results = []
    for shape in shapes:
        prompts = random_prompts(shape["batch"])
        capacity = capacity_needed(len(prompts[0]), shape["k"], shape["m"], reps * bursts + WARM_BURSTS)
        res = fields_cost(lambda n=shape["batch"], c=capacity: stub_models(backend, batch=n, capacity=c), prompts,
                          k=shape["k"], m=shape["m"], bursts=bursts, reps=reps,
                          check=lambda p, o, f: check_fields_greedy("fields graph (T=0)", p, o, f))
        results.append({"config": {**shape, "fields": sorted(BENCH_FIELDS)}, "result": res})
    table = new_table(f"logits processing fields in the sampling burst (T=1; {len(BENCH_FIELDS['logit_bias'])} "
                      f"logit_bias entries, presence, frequency, repetition, min_p), stub pair, graph replay; "
                      f"µs per round, medians. {label}",
                      ["k", "M", "B", "sampling µs/round", "with fields µs/round", "overhead",
                       "sampling tokens/round", "with fields tokens/round"])
    for r in results:
        c, x = r["config"], r["result"]
        table.add_row(str(c["k"]), str(c["m"]), str(c["batch"]), fmt(x["sampling_round_us"]),
                      fmt(x["fields_round_us"]), f"{x['fields_overhead']:+.1%}", fmt(x["sampling_tokens_per_round"]),
                      fmt(x["fields_tokens_per_round"]))
    return results, table


def run_stub(backend, *, reps: int, bursts: int, label: str):
    """The stub comparison at SHAPES (numpy: B = 1 only): (results, rich table)."""
    shapes = SHAPES if backend.is_gpu else SHAPES[:1]
    results = []
    for shape in shapes:
        prompts = random_prompts(shape["batch"])
        capacity = capacity_needed(len(prompts[0]), shape["k"], shape["m"], reps * bursts)
        res = sampling_cost(lambda: stub_models(backend, batch=shape["batch"], capacity=capacity), prompts,
                            k=shape["k"], m=shape["m"], bursts=bursts, reps=reps,
                            reference=lambda p, o: check_greedy("greedy graph", p, o))
        results.append(dict(config=shape, result=res))
    return results, _table("stub pair", results, label)


def _table(pair: str, results: list, label: str):
    """One rich row per shape: greedy and sampling µs per round, the overhead, tokens per round."""
    table = new_table(f"sampling (T=1, filters off) against greedy, {pair}, graph replay; µs per round, medians. "
                      f"{label}", ["k", "M", "B", "greedy µs/round", "sampling µs/round", "overhead",
                                   "greedy tokens/round", "sampling tokens/round"])
    for r in results:
        c, x = r["config"], r["result"]
        table.add_row(str(c["k"]), str(c["m"]), str(c["batch"]), fmt(x["greedy_round_us"]),
                      fmt(x["sampling_round_us"]), f"{x['overhead']:+.1%}", fmt(x["greedy_tokens_per_round"]),
                      fmt(x["sampling_tokens_per_round"]))
    return table


def run_llama(backend, model: str, *, reps: int, bursts: int, label: str, eps: float = 0.1):
    """The same comparison on a random-weight Llama pair of ``bench real``'s shapes (bf16 on a GPU).

    The draft is the target's first layers over the same weights; later layers' residual
    outputs are scaled by ``eps`` so the draft agrees often (acceptance as in ``bench real``).
    Before timing, the greedy graph's tokens must equal an eager per-round-sync run of a
    fresh pair (same kernels, so bit-identical) on the same prompts.
    """
    import torch

    from ..models.torch_adapter import TorchDraft, TorchTarget
    from .real_models import MODELS, Epsilon, instance, random_target

    spec = MODELS[model]
    dtype = torch.bfloat16 if backend.is_gpu else torch.float32
    device = f"cuda:{backend.device_id}" if backend.is_gpu else "cpu"
    shapes = SHAPES if backend.is_gpu else SHAPES[:1]
    results = []
    for shape in shapes:
        k, m, batch = shape["k"], shape["m"], shape["batch"]
        prompts = [[(7 * b + 3 * i) % spec.cfg.vocab_size for i in range(16)] for b in range(batch)]
        capacity = capacity_needed(len(prompts[0]), k, m, reps * bursts)
        src = random_target(spec, batch=batch, capacity=capacity, kv_slack=k + 2, dtype=dtype, device=device)
        Epsilon(src, spec.draft_layers).set(eps)

        def make_pair():
            target = TorchTarget(instance(src), batch=batch, capacity=capacity, backend=backend)
            draft = TorchDraft(instance(src, layers=spec.draft_layers), batch=batch, capacity=capacity,
                               backend=backend)
            return target, draft

        def reference(p, outs):
            target, draft = make_pair()
            dec = SpecDecoder(target, draft, k=k, m_rounds=m)
            dec.prefill(p)
            want = [[] for _ in p]
            for _ in range(WARM_BURSTS):
                for b, t in enumerate(dec.run_burst(mode="per_round_sync")):
                    want[b] += t.tolist()
            if want != outs:
                raise AssertionError(f"{model} B={batch}: greedy graph tokens differ from an eager run")

        res = sampling_cost(make_pair, prompts, k=k, m=m, bursts=bursts, reps=reps, reference=reference)
        results.append(dict(config=dict(shape, model=model, eps=eps, dtype=str(dtype)), result=res))
        del src
    return results, _table(f"{model} Llama pair (random {dtype}, ε={eps})", results, label)


# ------------------------------------------------------------------ kernels alone

KERNEL_VOCABS = (32000, 128256)
KERNEL_BATCHES = (1, 16)
KERNEL_K = 4
_INNER = 20  # copies of one op per captured graph: the per-op time is a graph replay's / _INNER


def _op_time_us(backend, fn, reps: int) -> float:
    """Median µs of one ``fn(stream)``: a graph of _INNER copies replayed, timed by CUDA events
    (so graph-node launch costs are in and Python's are out); host time on numpy."""
    if not backend.is_gpu:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(None)
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    cp = backend.xp
    with backend.device():
        s = cp.cuda.Stream(non_blocking=True)
        fn(s)  # compiles and loads outside the capture
        s.synchronize()
        s.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
        for _ in range(_INNER):
            fn(s)
        graph = s.end_capture()
        graph.upload(s)
        times = []
        for _ in range(reps + 1):
            ev = (cp.cuda.Event(), cp.cuda.Event())
            ev[0].record(s)
            graph.launch(s)
            ev[1].record(s)
            ev[1].synchronize()
            times.append(cp.cuda.get_elapsed_time(*ev) * 1e3 / _INNER)
        return statistics.median(times[1:])  # the first replay pays for cold caches


def _kernel_ops(backend, batch: int, vocab: int, k: int) -> dict:
    """name -> fn(stream) for each sampling op at one shape, over fresh device buffers."""
    import numpy as np

    from ..kernels.sampling_scratch import SampleScratch

    ops, xp = backend.ops, backend.xp
    rng = np.random.default_rng(batch * 7 + vocab)
    current = backend.current_stream()  # every buffer is filled there; the timed stream is ordered after it
    put = lambda host: backend.to_device(host, current)  # noqa: E731
    tgt_logits = put((rng.normal(size=(batch, k + 1, vocab)) * 3).astype(np.float32))  # [B, k+1, V]
    drf_logits = put((rng.normal(size=(batch, k, vocab)) * 3).astype(np.float32))  # [B, k, V]
    p, q = xp.zeros_like(tgt_logits), xp.zeros_like(drf_logits)  # [B, k+1, V], [B, k, V] probabilities
    ones, zeros_i = put(np.ones(batch, np.float32)), put(np.zeros(batch, np.int32))  # [B]: T = 1, filters off
    top_k, top_p = put(np.full(batch, 50, np.int32)), put(np.full(batch, 0.9, np.float32))  # [B]: filters on
    seed = put(rng.integers(0, 2**63, batch, dtype=np.uint64))  # [B] uint64
    pos = put(np.full(batch, 100, np.int32))  # [B]
    draft_tok, draft_prob = xp.zeros((batch, k), np.int32), xp.zeros((batch, k), np.float32)  # [B, k]
    vtok = xp.zeros((batch, k + 1), np.int32)  # [B, k+1]
    brk = put(np.tile(np.array([k, 0], np.int32), (batch, 1)))  # [B, 2]
    n_acc, last = xp.zeros(batch, np.int32), xp.zeros(batch, np.int32)  # [B]
    sc = SampleScratch(batch, k + 1, vocab, xp)
    stream = backend.new_stream()
    backend.order_after_current(stream)  # the buffers above were filled on the current stream
    # Real inputs for the accept: p and q from the logits, drafts sampled from q.
    ops.probs_from_logits(tgt_logits, ones, zeros_i, ones, p, sc, stream=stream)
    ops.draft_probs_sample(drf_logits, ones, zeros_i, ones, seed, pos, q, draft_tok, draft_prob, sc, stream=stream)
    with stream:
        vtok[:, 1:] = draft_tok
    stream.synchronize()
    kernels = {}
    if backend.is_gpu:  # each kernel alone; the numpy twins are per op, not per kernel
        # The tiles/normalize rows replay in place on their own copies: normalising p or q
        # again and again would shrink them to 0 and leave the accept rows a degenerate input.
        p_k, q_k = p.copy(), q.copy()  # [B, k+1, V], [B, k, V]
        kernels = {
            "kernel spec_probs_select (verify rows, filters off)": lambda s: ops.probs_select(
                tgt_logits, ones, zeros_i, ones, sc, stream=s),
            "kernel spec_probs_select (verify rows, top_k=50 top_p=0.9)": lambda s: ops.probs_select(
                tgt_logits, ones, top_k, top_p, sc, stream=s),
            "kernel spec_probs_tiles (verify rows)": lambda s: ops.probs_tiles(tgt_logits, ones, p_k, sc, stream=s),
            "kernel spec_probs_normalize (verify rows)": lambda s: ops.probs_normalize(ones, p_k, sc, stream=s),
            "kernel spec_probs_tiles (1 draft row, race)": lambda s: ops.probs_tiles(
                drf_logits, ones, q_k, sc, (seed, pos), step=0, stream=s),
            "kernel spec_probs_normalize (1 draft row, pick)": lambda s: ops.probs_normalize(
                ones, q_k, sc, (draft_tok, draft_prob), step=0, stream=s),
            "kernel spec_accept_tiles": lambda s: ops.accept_tiles(vtok, p, q, brk, seed, pos, sc, stream=s),
            "kernel spec_accept_pick": lambda s: ops.accept_pick(vtok, p, q, brk, seed, pos, n_acc, last, sc,
                                                                 stream=s),
        }
    return {
        **kernels,
        "draft_probs_sample (1 draft row)": lambda s: ops.draft_probs_sample(
            drf_logits, ones, zeros_i, ones, seed, pos, q, draft_tok, draft_prob, sc, step=0, stream=s),
        "probs_from_logits (k+1 verify rows)": lambda s: ops.probs_from_logits(
            tgt_logits, ones, zeros_i, ones, p, sc, stream=s),
        "accept_sample": lambda s: ops.accept_sample(vtok, p, q, brk, seed, pos, n_acc, last, sc, stream=s),
        "sample_draft (1 row from q)": lambda s: ops.sample_draft(q, seed, pos, draft_tok, draft_prob, sc, step=0,
                                                                  stream=s),
        "probs_from_logits top_k=50 top_p=0.9 (k+1 rows)": lambda s: ops.probs_from_logits(
            tgt_logits, ones, top_k, top_p, p, sc, stream=s),
    }


def run_kernels(backend, *, reps: int, label: str, console):
    """Each sampling kernel (GPU) and op alone (k = 4) at vocab 32000 and 128256, B = 1 and 16
    (numpy: ops only, 32000, B = 1), one printed line each plus the round's sampling total
    (k x draft_probs_sample + probs_from_logits + accept_sample, filters off)."""
    vocabs = KERNEL_VOCABS if backend.is_gpu else KERNEL_VOCABS[:1]
    batches = KERNEL_BATCHES if backend.is_gpu else KERNEL_BATCHES[:1]
    results = []
    table = new_table(f"sampling ops alone, k={KERNEL_K}, µs per op (medians). {label}", ["V", "B", "op", "µs"])
    for vocab in vocabs:
        for batch in batches:
            times = {name: _op_time_us(backend, fn, reps)
                     for name, fn in _kernel_ops(backend, batch, vocab, KERNEL_K).items()}
            times["round total (k draft steps + verify probs + accept)"] = (
                KERNEL_K * times["draft_probs_sample (1 draft row)"] + times["probs_from_logits (k+1 verify rows)"]
                + times["accept_sample"])
            for name, us in times.items():
                console.print(f"sampling kernels V={vocab} B={batch} {name}: {us:.1f} µs")
                table.add_row(str(vocab), str(batch), name, fmt(us))
            results.append(dict(config=dict(vocab=vocab, batch=batch, k=KERNEL_K), result=times))
    return results, table
