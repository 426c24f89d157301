"""Flag types and the parser of the ``graphburst`` command line.

Every flag value is checked as it is parsed, by an argparse ``type=`` callable, so a
bad value ends the command before any work with one line on stderr,
``graphburst <cmd>: error: <flag as typed>: <why>``, and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from .constants import NGRAM_MAX
from .models.ngram import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, NGRAM_DRAFT

#: ``--draft`` value that picks prompt-lookup drafting (models/ngram.py) instead of a draft model.
#: Largest memory the stub KV caches of one command may take; a larger size is a typo.
MAX_KV_BYTES = 16 * 2**30
#: Largest memory any other sized thing of one command may take (a benchmark's models, its tokens).
MAX_FLAG_BYTES = MAX_KV_BYTES
#: ``--capacity`` value that sizes the KV cache from the GPU's memory (serving/factory.py resolve_capacity).
AUTO = "auto"
#: Host bytes one kept output token costs: a list slot and a Python int (most token ids are past
#: the small-int cache).
TOKEN_BYTES = 36


class FlagError(Exception):
    """A flag value (or a combination of flags) that cannot be used.

    Parameters
    ----------
    flag : str
        The flag's long name, e.g. ``--output``; the parser reports it as the user typed it.
    why : str
    """

    def __init__(self, flag: str, why: str):
        super().__init__(f"{flag}: {why}")
        self.flag, self.why = flag, why


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Adds each flag's default to its help, unless the help already says it or there is none to say."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (action.option_strings and default not in (None, False, argparse.SUPPRESS) and "default" not in text
                and text != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)):
            text += " (default: %(default)s)"
        return text


class DeprecatedAlias(argparse.Action):
    """An old spelling of a renamed flag: stores like the new one and says once, on stderr, to use it."""

    def __call__(self, parser, namespace, values, option_string=None):
        new = next((a.option_strings[0] for a in parser._actions
                    if a.dest == self.dest and a is not self and a.option_strings), self.dest)
        print(f"{parser.prog}: note: {option_string} is deprecated here; use {new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


class _Commands(argparse._SubParsersAction):
    """Subcommands whose own --help starts with the line the parent's list shows for them."""

    def add_parser(self, name, **kwargs):
        if "help" in kwargs:
            kwargs.setdefault("description", kwargs["help"])
        return super().add_parser(name, **kwargs)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the flag as typed, exit 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Commands)
        self.argv: list[str] = []

    def parse_args(self, args=None, namespace=None):
        self._share_argv(list(sys.argv[1:] if args is None else args))
        return super().parse_args(args, namespace)

    def _share_argv(self, argv: list[str]) -> None:
        self.argv = argv
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    if isinstance(sub, Parser):
                        sub._share_argv(argv)

    def typed(self, flag: str) -> str:
        """How the user spelled ``flag`` (one of its option strings), e.g. ``-m`` for ``--rounds``."""
        names = [flag]
        for action in self._actions:
            if flag in action.option_strings:
                names = action.option_strings
        for token in self.argv:
            for name in names:
                if token == name or token.startswith(name + "=") or (
                        len(name) == 2 and not name.startswith("--") and token.startswith(name) and token != name
                        and not token.startswith("--")):
                    return name
        return flag

    def error(self, message: str):
        # argparse says "argument -m/--rounds: <why>"; the user typed one of those.
        if message.startswith("argument ") and ": " in message:
            names, why = message[len("argument "):].split(": ", 1)
            flag = self.typed(names.split("/")[-1]) if names.startswith("-") else names
            message = f"{flag}: {why}"
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")

    def flag_error(self, exc: FlagError):
        """Report a FlagError raised after parsing (e.g. by a check across flags)."""
        self.exit(2, f"{self.prog}: error: {self.typed(exc.flag)}: {' '.join(exc.why.split())}\n")


def _number(text: str, kind):
    try:
        return kind(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{'an integer' if kind is int else 'a number'} is needed, got {text!r}")


def int_in(lo: int, hi: int):
    """``type=`` for an integer in ``[lo, hi]``."""
    def parse(text: str) -> int:
        value = _number(text, int)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}], got {value}")
        return value
    parse.__name__ = "int"
    return parse


def real_in(lo: float, hi: float = math.inf):
    """``type=`` for a finite real in ``[lo, hi]`` (nan and inf refused)."""
    def parse(text: str) -> float:
        value = _number(text, float)
        if not math.isfinite(value) or not lo <= value <= hi:
            span = f"[{lo}, {hi}]" if math.isfinite(hi) else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be a finite number {span}, got {text}")
        return value
    parse.__name__ = "float"
    return parse


def int_or_auto(lo: int, hi: int, why: str = ""):
    """``type=`` for ``auto`` or an integer in ``[lo, hi]`` (``--capacity``); ``why``, when given, follows
    the range in the error (what the minimum is for)."""
    whole = int_in(lo, hi)

    def parse(text: str):
        if text == AUTO:
            return text
        try:
            return whole(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be {AUTO!r} or an integer in [{lo}, {hi}]{why}, "
                                             f"got {text!r}") from None
    parse.__name__ = "int or auto"
    return parse


def fraction(text: str) -> float:
    """``type=`` for a number in ``(0, 1]`` (``--gpu-memory-fraction``)."""
    value = _number(text, float)
    if not 0.0 < value <= 1.0:  # nan fails both comparisons
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text}")
    return value


def readable_file(text: str) -> str:
    """``type=`` for an existing readable file, or ``-`` for stdin."""
    if text == "-":
        return text
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not readable")
    return text


def readable_dir(text: str, flag: str | None = None) -> str:
    """``type=`` for an existing readable directory (a model checkpoint, say).

    Called directly with ``flag`` it raises :class:`FlagError` naming that flag instead.
    """
    why = None
    if not os.path.exists(text):
        why = f"no such directory: {text!r}"
    elif not os.path.isdir(text):
        why = f"{text!r} is a file, not a directory"
    elif not os.access(text, os.R_OK | os.X_OK):
        why = f"{text!r} is not readable"
    if why is None:
        return text
    if flag is not None:
        raise FlagError(flag, why)
    raise argparse.ArgumentTypeError(why)


def checkpoint(text: str, flag: str | None = None) -> str:
    """``type=`` for a model checkpoint: a directory, a ``.gguf`` file, or a named model
    (:data:`~graphburst.models.named.NAMED_MODELS`; its package must be installed). The
    value is kept as given (a named model keeps its name).

    Called directly with ``flag`` it raises :class:`FlagError` naming that flag instead.
    """
    from .models.llama_config import CheckpointError
    from .models.named import check_checkpoint

    try:
        path = check_checkpoint(text)
    except CheckpointError as exc:
        if flag is not None:
            raise FlagError(flag, str(exc)) from None
        raise argparse.ArgumentTypeError(str(exc)) from None
    if os.path.isdir(path):
        readable_dir(path, flag)
    return text


def draft_dir_or_ngram(text: str) -> str:
    """``type=`` for ``--draft``: a checkpoint (:func:`checkpoint`), or ``ngram`` (prompt lookup)."""
    return text if text == NGRAM_DRAFT else checkpoint(text)


def writable_file(text: str) -> str:
    """``type=`` for a file that can be created or overwritten, or ``-`` for stdout."""
    if text == "-":
        return text
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"directory {parent!r} does not exist")
    if os.path.exists(text) and not os.access(text, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    if not os.path.exists(text) and not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot create a file in {parent!r}")
    return text


def same_file(a: str, b: str) -> bool:
    """True when two paths (neither ``-``) name one file, existing or not."""
    if a == "-" or b == "-":
        return False
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_kv_memory(batch: int, capacity: int, kv_layers: int, flags=("--batch", "--capacity", "--layers")) -> None:
    """Raise FlagError when the stub KV caches (int32 entries) would pass MAX_KV_BYTES."""
    need = batch * capacity * kv_layers * 4
    if need > MAX_KV_BYTES:
        raise FlagError(flags[0], f"{batch} slots x {capacity} entries x {kv_layers} KV layers x 4 bytes = "
                                  f"{need / 2**30:.1f} GiB of KV cache, over the {MAX_KV_BYTES // 2**30} GiB limit "
                                  f"(lower {', '.join(flags)})")


def check_memory(need: int, what: str, flags, limit: int | None = None, where: str = "limit") -> None:
    """Raise FlagError (naming ``flags[0]``) when ``what`` would take over ``limit`` bytes (MAX_FLAG_BYTES)."""
    limit = MAX_FLAG_BYTES if limit is None else limit
    if need > limit:
        raise FlagError(flags[0], f"{what} take {need / 2**30:.1f} GiB, over the {limit / 2**30:.0f} GiB {where} "
                                  f"(lower {', '.join(flags)})")


def check_backend(name: str) -> None:
    """Raise FlagError for ``--backend cupy`` on a machine without a usable GPU."""
    from .backend import cuda_available

    if name == "cupy" and not cuda_available():
        raise FlagError("--backend", "cupy needs cupy and a CUDA device, and none was found; "
                                     "use --backend numpy (or auto)")


def add_decode_kernels_flag(parser, whose: str = "a --model's") -> None:
    """``--decode-kernels`` (``Llama(decode_kernels=...)`` of ``whose`` models); None: the model's default."""
    from .constants import DECODE_KERNELS

    parser.add_argument("--decode-kernels", choices=DECODE_KERNELS, default=None, metavar="KERNELS",
                        help=f"how {whose} decode and verify forwards run: auto (the fused Triton kernels with "
                             "cuBLAS projections on CUDA, SDPA on the CPU), gemv (every projection on the Triton "
                             "GEMV), pdl (gemv with programmatic dependent launch; Hopper or later), folded (pdl "
                             "with the norms, SiLU and split-K sums folded into the projections), reference (the "
                             "fused path in plain torch), off (SDPA); gemv, pdl and folded need a GPU "
                             f"({', '.join(DECODE_KERNELS)}; default auto)")


def check_decode_kernels(kernels: str | None, backend: str) -> None:
    """Refuse ``--decode-kernels`` a run cannot launch: Triton's kernels without a GPU (but under Triton's
    interpreter, ``TRITON_INTERPRET=1``), PDL on a GPU older than Hopper. They would fail at the model's
    construction or first forward."""
    from .constants import TRITON_DECODE_KERNELS

    if kernels not in TRITON_DECODE_KERNELS:
        return
    from .backend import cuda_available

    if backend == "numpy" or not cuda_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            why = "--backend numpy" if backend == "numpy" else "no CUDA device found"
            raise FlagError("--decode-kernels", f"{kernels} runs Triton kernels on a GPU, and this run has none "
                                                f"({why}); use auto, reference or off")
        return
    if kernels != "gemv":
        import torch

        from .models.llama_decode import pdl_unsupported

        why = pdl_unsupported(torch.device("cuda", torch.cuda.current_device()))
        if why is not None:
            raise FlagError("--decode-kernels", f"{kernels}: {why}; use gemv or auto")


def add_ngram_flags(parser) -> None:
    """``--ngram-min`` / ``--ngram-max`` (with ``--draft ngram``); None until :func:`check_ngram_flags`."""
    parser.add_argument("--ngram-min", type=int_in(1, NGRAM_MAX), default=None,
                        help=f"--draft ngram: shortest n-gram looked up (default {DEFAULT_NGRAM_MIN})")
    parser.add_argument("--ngram-max", type=int_in(1, NGRAM_MAX), default=None,
                        help=f"--draft ngram: longest n-gram looked up, tried first (default {DEFAULT_NGRAM_MAX})")


def check_ngram_flags(args, *, parallel: bool = False) -> None:
    """Refuse ``--ngram-min/max`` without ``--draft ngram``; with it fill in the defaults, min <= max.

    ``parallel``: the command runs tensor or pipeline parallel, where the lookup draft is not wired in.
    """
    if args.draft != NGRAM_DRAFT:
        for flag in ("--ngram-min", "--ngram-max"):
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                raise FlagError(flag, f"applies to --draft {NGRAM_DRAFT} only")
        return
    if parallel:
        raise FlagError("--draft", f"--draft {NGRAM_DRAFT} is not wired into --tp/--pp yet")
    args.ngram_min = DEFAULT_NGRAM_MIN if args.ngram_min is None else args.ngram_min
    args.ngram_max = max(DEFAULT_NGRAM_MAX, args.ngram_min) if args.ngram_max is None else args.ngram_max
    if args.ngram_min > args.ngram_max:
        raise FlagError("--ngram-min", f"{args.ngram_min} is above --ngram-max {args.ngram_max}")
