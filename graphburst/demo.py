"""``graphburst demo``: the main job in one screen.

A few bursts of a target/draft pair, run the way a serving process runs them (graph
replay by default: a CUDA graph on a GPU, the recorded program on the numpy backend),
checked token for token against an independent greedy reference, in a rich table with
acceptance, tokens per second and the host syncs the bursts took.

Models: the stub pair by default (reference: the CPU greedy oracle); ``--model
tiny-random`` for a small random Llama pair built in memory; ``--model MODEL --draft MODEL``
(or ``--draft ngram``) for checkpoints of any supported family: Hugging Face directories, GGUF
files, or a named model such as ``smollm2-135m`` (reference for all: the target alone,
re-running the whole prefix for every token). ``--prompt TEXT`` gives a checkpoint that
carries a tokenizer a real prompt, rendered through its chat template when it has one, and
prints the answer; otherwise the prompts are random token ids.

``--temperature T`` (with ``--top-k``, ``--top-p``; slot b's seed is ``--seed`` * 2**16 + b)
samples instead; the reference is then the same pair, built afresh, run eagerly with a
host sync per round: the same seeds must give the same tokens in every engine.
"""

from __future__ import annotations

import time

import numpy as np
from rich.console import Console
from rich.table import Table

from .backend import BACKEND_NAMES, get_backend
from .engine.mode import BurstMode
from .engine.decoder import SpecDecoder
from .models.named import NAMED_MODELS
from .models.ngram import NGRAM_DRAFT
from .models.tokenizer import has_tokenizer
from .cli_args import (FlagError, add_decode_kernels_flag, add_ngram_flags, check_backend, check_decode_kernels,
                       check_kv_memory, check_ngram_flags, checkpoint, draft_dir_or_ngram, int_in, real_in)
from .constants import DEFAULT_K, MAX_K, TOP_K_OFF, TOP_P_OFF
from .kernels.digest import greedy_reference
from .sampling.params import check_sampling

DEMO_MODES = tuple(m.value for m in BurstMode)  # --mode choices
TINY_RANDOM = "tiny-random"
DTYPES = ("float32", "bfloat16")
STUB_P_MIN = 0.05


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run a few bursts (graph replay by default) and check them against greedy "
                                    "decoding")
    p.add_argument("--backend", choices=BACKEND_NAMES, default="auto",
                   help="cupy (GPU), numpy (CPU reference) or auto (cupy when a GPU is usable)")
    p.add_argument("--model", default=None,
                   help=f"'{TINY_RANDOM}' (a small random Llama pair, no files), a Hugging Face checkpoint directory "
                        f"or a .gguf file (Llama, Mistral, Qwen2, Qwen3), or a named model ({', '.join(NAMED_MODELS)}); "
                        "the stub models when absent")
    p.add_argument("--draft", type=draft_dir_or_ngram, default=None,
                   help=f"the draft's checkpoint (with --model), or {NGRAM_DRAFT!r}: prompt lookup, no "
                        "draft model (with the stubs or any --model)")
    p.add_argument("--prompt", default=None,
                   help="with a --model that carries a tokenizer: this text as every slot's prompt (through the "
                        "model's chat template when it has one), decoded until its end-of-turn token; the answer "
                        "is printed")
    add_ngram_flags(p)
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV of a --model pair")
    add_decode_kernels_flag(p)
    p.add_argument("--batch", type=int_in(1, 4096), default=None,
                   help="sequences decoded together (default 4, or 1 with --prompt)")
    p.add_argument("-k", type=int_in(0, MAX_K), default=None,
                   help=f"drafts per round (default {DEFAULT_K}; 0: plain decoding, no draft, the default for a "
                        f"--model checkpoint given no --draft)")
    p.add_argument("-m", "--rounds", type=int_in(1, 1024), default=8, help="rounds per burst")
    p.add_argument("--bursts", type=int_in(1, 10_000), default=4, help="bursts of M rounds to run and check")
    p.add_argument("--layers", type=int_in(1, 4096), default=8, help="stub target KV layers (every third absent)")
    p.add_argument("--accept", type=real_in(0.0, 1.0), default=0.7, help="stub draft agreement probability")
    p.add_argument("--p-min", type=real_in(0.0, 1.0), default=None,
                   help="the draft breaks its chain below this confidence (default 0.05 for the stubs, 0 for a "
                        "--model pair, whose softmax confidences can be low)")
    p.add_argument("--vocab", type=int_in(2, 2**31 - 1), default=32000, help="stub vocabulary")
    p.add_argument("--mode", choices=DEMO_MODES, default=BurstMode.GRAPH.value,
                   help="graph replay (default), graph with the gapless drain, or an eager mode")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0,
                   help="the prompts, the stub models (or tiny-random weights) and, when sampling, each slot's "
                        "sampling seed (--seed * 2**16 + slot)")
    p.add_argument("--temperature", type=real_in(0.0, 1e6), default=0.0,
                   help="sample at this temperature (0: greedy decoding, checked against the greedy reference)")
    # None (not 0 / 1.0) so that check_args can tell a --top-k given without --temperature.
    p.add_argument("--top-k", type=int_in(0, 2**31 - 1), default=None,
                   help="sampling (needs --temperature > 0): keep the k likeliest tokens (0: off)")
    p.add_argument("--top-p", type=real_in(1e-9, 1.0), default=None,
                   help="sampling (needs --temperature > 0): nucleus mass in (0, 1] (1: off)")
    # Multi-GPU (docs/parallel.md): launch with torchrun --nproc_per_node N -m graphburst demo ...
    p.add_argument("--tp", type=int_in(1, 64), default=1, help="tensor-parallel ranks (torchrun, --model only)")
    p.add_argument("--pp", type=int_in(1, 64), default=1, help="pipeline stages (torchrun, --model only)")
    p.add_argument("--draft-mode", choices=("sharded", "replicated"), default="sharded",
                   help="under --tp: the draft sharded like the target (default), or whole on every rank")
    p.add_argument("--dist-timeout", type=real_in(1.0, 3600.0), default=60.0,
                   help="seconds before a collective or the rendezvous gives up")


def check_args(args) -> None:
    """Checks across flags, before any work (FlagError names the flag)."""
    check_backend(args.backend)
    check_k(args)
    if args.tp > 1 or args.pp > 1:
        from .parallel import launch

        launch.check_args(args)
    check_ngram_flags(args, parallel=args.tp > 1 or args.pp > 1)
    if args.model is None and args.draft not in (None, NGRAM_DRAFT):
        raise FlagError("--draft", "needs --model DIR")
    if args.model not in (None, TINY_RANDOM):
        checkpoint(args.model, flag="--model")
    if args.decode_kernels is not None:
        if args.model is None:
            raise FlagError("--decode-kernels", "needs --model (the stub models have no decode kernels to pick)")
        if args.tp > 1 or args.pp > 1:
            raise FlagError("--decode-kernels", "is not wired into --tp/--pp; leave it unset")
        check_decode_kernels(args.decode_kernels, args.backend)
    if args.prompt is not None:
        if args.model in (None, TINY_RANDOM) or not has_tokenizer(args.model):
            raise FlagError("--prompt", "needs a --model that carries a tokenizer (a .gguf file, a named model, or a "
                                        "directory with tokenizer.json)")
        if not args.prompt.strip():
            raise FlagError("--prompt", "is empty")
    if args.batch is None:
        args.batch = 1 if args.prompt is not None else 4
    if args.temperature == 0:
        # Greedy decoding has no distribution to filter: a filter given here would be ignored.
        for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)):
            if value is not None:
                raise FlagError(flag, "filters sampling, and without --temperature (> 0) the demo decodes greedily; "
                                      "add --temperature T or drop " + flag)
    args.top_k = TOP_K_OFF if args.top_k is None else args.top_k
    args.top_p = TOP_P_OFF if args.top_p is None else args.top_p
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as exc:
        raise FlagError(f"--{str(exc).split()[0].replace('_', '-')}", str(exc)) from None
    capacity = _capacity(args)
    if capacity > 2**31 - 1:
        raise FlagError("--bursts", f"{args.bursts} bursts of up to {args.rounds * (args.k + 1)} tokens need "
                                    f"{capacity} KV entries per sequence, over 2**31 - 1")
    if args.model is None:
        check_kv_memory(args.batch, capacity, args.layers + 1, flags=("--batch", "--bursts", "--rounds", "-k"))


#: KV rows a --prompt may take (its rendered ids, template included)
PROMPT_ROWS = 1024


def _capacity(args) -> int:
    # random prompts are at most 32 tokens; a --prompt at most PROMPT_ROWS
    return (PROMPT_ROWS if args.prompt is not None else 64) + args.bursts * args.rounds * (args.k + 1)


def _text_prompt(args):
    """(prompt ids, end-of-turn id, tokenizer) of ``--prompt``: the model's chat template over one user
    message when the tokenizer has one, else the plain text."""
    from .models.tokenizer import checkpoint_tokenizer, render_user_message

    tok = checkpoint_tokenizer(args.model)
    ids = render_user_message(tok, args.prompt)
    if len(ids) > PROMPT_ROWS:
        raise FlagError("--prompt", f"is {len(ids)} tokens, over the demo's {PROMPT_ROWS}")
    return ids, tok.eos_token_id, tok


def check_k(args) -> None:
    """Fill in ``-k`` (0, plain decoding, for a checkpoint given no ``--draft``; else DEFAULT_K) and refuse a
    draft it would leave unused, or drafts with nothing to make them."""
    no_draft = args.model not in (None, TINY_RANDOM) and args.draft is None
    if args.k is None:
        args.k = 0 if no_draft else DEFAULT_K
    elif no_draft and args.k > 0:
        raise FlagError("-k", f"{args.k} drafts per round need --draft MODEL or --draft {NGRAM_DRAFT}; without one "
                              f"--model decodes plainly (-k 0)")
    if args.k > 0:
        return
    if args.draft == NGRAM_DRAFT:
        raise FlagError("-k", f"0 decodes plainly, and --draft {NGRAM_DRAFT} proposes drafts: give -k 1 or more")
    if args.draft is not None:
        raise FlagError("-k", "0 decodes plainly and never calls the draft: leave --draft out")
    if args.tp > 1 or args.pp > 1:
        raise FlagError("-k", "0 (plain decoding) is not wired into --tp/--pp: give --draft MODEL (or a --model "
                              f"{TINY_RANDOM}) and -k 1 or more")


def _build(args, backend, capacity):
    """(target, draft, vocab, reference) where ``reference(prompt, n)`` is the greedy truth."""
    target, draft, vocab, reference = _build_pair(args, backend, capacity)
    if args.draft == NGRAM_DRAFT:  # prompt lookup replaces the draft model built beside the target
        from .models.ngram import ngram_for

        draft = ngram_for(target, n_min=args.ngram_min, n_max=args.ngram_max)
    if args.k == 0:  # plain decoding: the draft built beside the target (stub or tiny) is not run
        draft = None
    return target, draft, vocab, reference


def _build_pair(args, backend, capacity):
    p_min = args.p_min if args.p_min is not None else (STUB_P_MIN if args.model is None else 0.0)
    if args.model is None:
        from .models.stubs import stub_pair

        layout = [i % 3 != 2 for i in range(args.layers)]
        target, draft = stub_pair(args.batch, args.vocab, layout, [True, False], capacity, accept_prob=args.accept,
                                  p_min=p_min, seed=args.seed, backend=backend)
        return target, draft, args.vocab, lambda prompt, n: greedy_reference(prompt, n, args.vocab)
    from .models import checkpoint

    kernels = args.decode_kernels or "auto"
    if args.model == TINY_RANDOM:
        target, draft = checkpoint.tiny_random_pair(batch=args.batch, capacity=capacity, backend=backend,
                                                    dtype=args.dtype, seed=args.seed, p_min=p_min,
                                                    decode_kernels=kernels)
    elif args.draft in (NGRAM_DRAFT, None):
        target = checkpoint.load_target(args.model, batch=args.batch, capacity=capacity, backend=backend,
                                        dtype=args.dtype, decode_kernels=kernels)
        draft = None
    else:
        target, draft = checkpoint.load_pair(args.model, args.draft, batch=args.batch, capacity=capacity,
                                             backend=backend, dtype=args.dtype, p_min=p_min, decode_kernels=kernels)
    return target, draft, target.vocab, lambda prompt, n: target.module.greedy(prompt, n)


def _runner(dec, mode):
    """A callable running one burst and returning its tokens, in the chosen mode."""
    mode = BurstMode.parse(mode)
    if mode.eager:
        return lambda: dec.run_burst(mode=mode)
    from .capture import BurstGraph

    return BurstGraph(dec, gapless=mode is BurstMode.GAPLESS).run


def _sampling_kwargs(args) -> dict:
    """SpecDecoder.prefill's per-slot sampling settings (empty when greedy)."""
    if args.temperature == 0:
        return {}
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=[(args.seed << 16) + b for b in range(args.batch)])


def _eager_reference(args, backend, capacity, prompts):
    """Sampling: each slot's tokens from the same pair, built afresh, run eagerly with a sync per round."""
    target, draft, _, _ = _build(args, backend, capacity)
    dec = SpecDecoder(target, draft, k=args.k, m_rounds=args.rounds, sampling=True)
    dec.prefill(prompts, **_sampling_kwargs(args))
    out = [[] for _ in prompts]
    for _ in range(args.bursts):
        for b, t in enumerate(dec.run_burst(mode=BurstMode.PER_ROUND_SYNC)):
            out[b] += t.tolist()
    return out


def run(args, console: Console) -> int:
    if args.tp > 1 or args.pp > 1:
        from .parallel import launch

        return launch.run(args, console)
    backend = get_backend(args.backend)
    where = "GPU (cupy)" if backend.is_gpu else "CPU: numpy reference backend (no GPU in use)"
    console.print(f"[bold]graphburst demo[/bold] on {where}")
    capacity = _capacity(args)
    target, draft, vocab, reference = _build(args, backend, capacity)
    rng = np.random.default_rng(args.seed)
    if args.prompt is None:
        prompts = [rng.integers(0, vocab, int(rng.integers(1, 33))).tolist() for _ in range(args.batch)]
        stop, tok = None, None
    else:
        ids, stop, tok = _text_prompt(args)
        prompts = [ids] * args.batch
    sampling = args.temperature > 0
    dec = SpecDecoder(target, draft, k=args.k, m_rounds=args.rounds, sampling=sampling)
    dec.prefill(prompts, eos=stop, **_sampling_kwargs(args))
    run_burst = _runner(dec, args.mode)  # capture happens here, outside the timed bursts
    syncs0 = dec.host_syncs
    out = [[] for _ in prompts]
    t0 = time.perf_counter()
    ran = 0
    for _ in range(args.bursts):
        for b, t in enumerate(run_burst()):
            out[b] += t.tolist()
        ran += 1
        if stop is not None and not dec.host_left.any():
            break  # every slot answered (its end-of-turn token): nothing more to decode
    wall = time.perf_counter() - t0
    syncs = dec.host_syncs - syncs0
    acc = dec.accept_counters()
    # References run last: a torch model's reference reuses its KV rows.
    if sampling:
        want = _eager_reference(args, backend, capacity, prompts)
    else:
        want = [reference(prompts[b], len(out[b])) for b in range(args.batch)]
    model = ("stub" if args.model is None else args.model) + (" + prompt lookup" if args.draft == NGRAM_DRAFT else
                                                              ", plain decoding" if args.k == 0 else "")
    table = Table(title=f"{model}: k={args.k}, M={args.rounds}, {ran} bursts, mode={args.mode}, "
                        f"backend={backend.name}")
    check = f"matches eager (T={args.temperature:g})" if sampling else "matches greedy"
    for col in ("seq", "committed", "accepted drafts", "rounds", "acceptance", "tokens/round", check):
        table.add_column(col, justify="right")
    all_ok = True
    for b in range(args.batch):
        ok = out[b] == want[b]
        all_ok &= ok
        rounds = int(acc[b, 1])
        table.add_row(str(b), str(len(out[b])), str(int(acc[b, 0])), str(rounds),
                      f"{acc[b, 0] / max(1, rounds * args.k):.2f}" if args.k else "–", f"{len(out[b]) / max(1, rounds):.2f}",
                      "[green]yes[/green]" if ok else "[red]NO[/red]")
    console.print(table)
    total = sum(len(o) for o in out)
    console.print(f"{total} tokens in {wall * 1e3:.1f} ms: {total / wall:,.0f} tokens/s ({args.mode}"
                  f"{'' if backend.is_gpu else ', CPU reference: not a GPU timing'}); host syncs: {syncs} over "
                  f"{ran} bursts ({syncs / ran:.1f} per burst)")
    if tok is not None:
        from rich.text import Text

        console.print(Text.assemble(("prompt ", "bold"), args.prompt))
        console.print(Text.assemble(("answer ", "bold"), tok.decode(out[0], skip_special_tokens=True)))
    return 0 if all_ok else 1
