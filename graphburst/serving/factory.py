"""What a serving process runs, as one validated :class:`ServeConfig`, and the loop it describes.

:func:`build_loop` is the one builder of a serving loop, for JSONL
(:mod:`graphburst.serving.jsonl`) and HTTP (:mod:`graphburst.serving.http`) serving alike;
the ``graphburst serve`` command (``serve_cli``) only turns its flags into a ServeConfig,
and tensor-parallel serving (``parallel/serve_tp``) builds its own lockstep loop from the
same config. Nothing here knows about argparse.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

from ..backend import BACKEND_NAMES, get_backend
from ..buffers import StreamBufs
from ..constants import DECODE_KERNELS, DEFAULT_K, MAX_DEPTH, MAX_K, TP_MAX_DEPTH
from ..models.capacity import DEFAULT_GPU_MEMORY_FRACTION, CapacityPlan, MemorySpec, auto_capacity, check_fraction
from ..models.llama_config import CheckpointError
from ..models.named import check_checkpoint
from ..models.ngram import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, NGRAM_DRAFT, NgramDraft, check_ngram_range, ngram_for
from ..models.stubs import StubTarget, stub_memory_spec, stub_pair
from ..models.tokenizer import has_tokenizer, tokenizer_size
from ..protocol import hook
from ..sampling.fields import SlotFields
from .admit import ADMISSION_MODES
from .loop import ENGINE_MODES, ServeLoop

STUB_DEFAULTS = {"vocab": 32000, "layers": 4, "accept": 0.7, "cost_us": 0.0}
TINY_RANDOM = "tiny-random"  # model value: checkpoint.tiny_random_pair, no files
DTYPES = ("float32", "bfloat16")
DRAFT_MODES = ("sharded", "replicated")
STUB_MODEL_NAME = "graphburst-stub"
AUTO_CAPACITY = "auto"  # capacity value: size the KV cache from the GPU's memory (resolve_capacity)
PROMPT_STAGING_BYTES = 4  # the decoder's prefill staging, [B * capacity] int32: per slot per row
#: The smallest KV capacity that serves any request: one prompt token plus one new token (a request's
#: prompt plus its whole max_new_tokens must fit a slot, serving.request.check_whole_request_fits). A
#: burst's draft rows add nothing to it: a slot writes at most its budget's tokens (engine.ledger), and
#: the rows drafted past the capacity are dropped (stubs) or land in the KV slack rows (models.llama).
MIN_CAPACITY = 2
#: ``device_exit`` (``--device-exit``) -> ``ServeLoop(device_exit=...)``
DEVICE_EXIT_FLAGS = {"off": False, "auto": "auto", "on": True, "ladder": "ladder"}
#: Bursts in flight of the pipelined graph engine when ``pipeline_depth`` is not given.
DEFAULT_PIPELINE_DEPTH = 2
#: Measured with the stub models sampling on the numpy backend at batch 64, vocab 32000, k 4, M 8 (the
#: serve defaults) on 2 shared CPU cores, 2026-12-03: seconds to a request's first tokens, then per burst.
#: Every burst samples each slot over the whole vocabulary, so the cost grows with batch x vocab (at
#: batch 8: about 7 s, then 1.5 s a burst).
CPU_STUB_SAMPLING_FIRST_S, CPU_STUB_SAMPLING_BURST_S = 50, 12
#: A burst this long (estimated from the figures above) is worth a start-up line saying so.
SLOW_BURST_S = 1.0
#: Rows of the largest admission whose prefill buckets are made before serving (the
#: models' ``warm_prefill`` hook): under load an admission carries a few prompts, and each
#: bucket's first calls otherwise stall the decoding slots (models.prefill_graphs).
DEFAULT_PREFILL_WARMUP = 4


class ConfigError(ValueError):
    """A ServeConfig field that cannot run; ``field`` names it (the command maps it to its flag)."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field, self.why = field, why


# field -> (minimum, maximum) of the numbers a ServeConfig takes (the flags' ranges)
INT_RANGES = {"batch": (1, 65536), "k": (0, MAX_K), "rounds": (1, 1024), "capacity": (1, 2**31 - 1),
              "vocab": (2, 2**31 - 1), "layers": (1, 4096), "max_queue": (1, 1_000_000), "tp": (1, 64),
              "prefill_chunk": (1, 2**31 - 1), "pipeline_depth": (2, MAX_DEPTH), "prefill_warmup": (0, 65536),
              "spec_max_batch": (0, 65536)}
REAL_RANGES = {"accept": (0.0, 1.0), "cost_us": (0.0, 1e6), "p_min": (0.0, 1.0), "drain_timeout": (0.0, 3600.0),
               "header_timeout": (0.1, 3600.0), "body_timeout": (0.1, 3600.0),
               "write_timeout": (0.1, 86400.0), "dist_timeout": (1.0, 3600.0)}


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Everything a serving process needs, validated at construction.

    Models: the stub pair by default (``vocab``, ``layers``, ``accept``, ``cost_us``; None
    takes :data:`STUB_DEFAULTS`), or ``model=DIR, draft=DIR`` (a Hugging Face Llama pair,
    ``dtype``, ``p_min``, ``decode_kernels``), or ``model="tiny-random"`` (a small random pair
    built in memory).
    A stub field given with ``model``, or a model field without it, is refused.
    ``capacity="auto"`` is sized from the GPU's memory when the loop is built
    (:func:`resolve_capacity`; ``gpu_memory_fraction`` applies to it only, default
    ``DEFAULT_GPU_MEMORY_FRACTION``).

    Raises
    ------
    ConfigError (a ValueError)
        Naming the field and the value: a number out of range, a choice not offered, a
        checkpoint directory that is not one, or fields that do not go together.
    """

    # the loop
    backend: str = "auto"
    engine: str = "graph"
    batch: int = 64
    k: int | None = None  # drafts per round; None: DEFAULT_K with a draft, 0 (plain decoding) without
    rounds: int = 8
    capacity: int | str = 4096  # KV entries per slot, or AUTO_CAPACITY: from the GPU's memory
    gpu_memory_fraction: float | None = None  # capacity="auto": share of the GPU (None: DEFAULT_GPU_MEMORY_FRACTION)
    sampling: bool = False
    logits_fields: bool = False  # the logits processing fields on the device (needs sampling)
    pipelined: bool = True  # graph engine: keep a second burst in flight while the host hands out tokens
    pipeline_depth: int | None = None  # pipelined graph engine: bursts in flight (None: DEFAULT_PIPELINE_DEPTH)
    prefill_chunk: int | None = None  # prompt tokens prefilled per burst boundary (None: whole prompts)
    prefill_warmup: int | None = None  # rows warmed before serving (None: DEFAULT_PREFILL_WARMUP; 0: off)
    admission: str = "auto"  # pipelined: admit before ("early") or after ("late") refilling; ServeLoop's admission
    device_exit: str = "off"  # graph engine: bursts end on the device ("on", "auto", "ladder": ServeLoop's device_exit)
    spec_max_batch: int | None = None  # speculation off while more slots than this are active (None: never)
    # stub models (the default)
    vocab: int | None = None
    layers: int | None = None
    accept: float | None = None
    cost_us: float | None = None
    # Llama models
    model: str | None = None
    draft: str | None = None  # a checkpoint directory, or NGRAM_DRAFT: prompt lookup (stubs or any model)
    ngram_min: int | None = None  # prompt lookup: shortest n-gram (None: DEFAULT_NGRAM_MIN with draft="ngram")
    ngram_max: int | None = None  # longest n-gram, tried first
    dtype: str | None = None
    p_min: float | None = None
    decode_kernels: str | None = None  # Llama(decode_kernels=...) of both models (None: "auto")
    # intake: requests waiting for a slot (HTTP: before 429; JSONL: how far the reader reads ahead)
    max_queue: int = 256
    # JSONL serving
    requests: str = "-"  # '-': stdin
    output: str = "-"  # '-': stdout
    live: bool = False  # the rich live view even when stderr is not a terminal
    # HTTP serving
    http: str | None = None  # [HOST:]PORT, None: JSONL
    drain_timeout: float = 10.0
    header_timeout: float = 30.0  # seconds a connection may stay idle, or take to send a request head
    body_timeout: float = 30.0  # seconds a request may take to send its body
    write_timeout: float = 300.0  # seconds a stream may wait for its client to take one chunk
    tokenizer: str | None = None
    served_model_name: str | None = None
    # HTTP serving on a network (serving/network.py): API keys (never in the repr), TLS, access log, CORS
    api_key: tuple = dataclasses.field(default=(), repr=False)  # keys besides api_key_file and GRAPHBURST_API_KEY
    api_key_file: str | None = None  # one key a line; blank lines and '#' comments skipped
    metrics_need_key: bool = False  # /metrics needs a key too (it is open by default, like /health)
    ssl_certfile: str | None = None  # PEM certificate (chain); with ssl_keyfile: serve HTTPS
    ssl_keyfile: str | None = None
    allowed_origins: tuple = ()  # CORS: origins whose browsers may call the API ("*": any)
    access_log: str | None = None  # a file the access log is appended to (None: stderr)
    no_access_log: bool = False
    # tensor-parallel serving (parallel/serve_tp)
    tp: int = 1
    draft_mode: str = "sharded"
    dist_timeout: float = 60.0

    def __post_init__(self):
        for name, (lo, hi) in INT_RANGES.items():
            value = getattr(self, name)
            if value is not None and not (name == "capacity" and value == AUTO_CAPACITY):
                self._set(name, _int_in(name, value, lo, hi))
        for name, (lo, hi) in REAL_RANGES.items():
            value = getattr(self, name)
            if value is not None:
                self._set(name, _real_in(name, value, lo, hi))
        for name, choices in (("backend", BACKEND_NAMES), ("engine", ENGINE_MODES), ("draft_mode", DRAFT_MODES),
                              ("admission", ADMISSION_MODES), ("device_exit", tuple(DEVICE_EXIT_FLAGS))):
            if getattr(self, name) not in choices:
                raise ConfigError(name, f"must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.decode_kernels is not None and self.decode_kernels not in DECODE_KERNELS:
            raise ConfigError("decode_kernels", f"must be one of {', '.join(DECODE_KERNELS)}, "
                                                f"got {self.decode_kernels!r}")
        for name in ("sampling", "logits_fields", "pipelined", "live"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be a bool, got {getattr(self, name)!r}")
        self._check_capacity()
        if self.logits_fields and not self.sampling:
            raise ConfigError("logits_fields", "processes the logits of sampling mode: give sampling too")
        if self.logits_fields and self.tp > 1:
            raise ConfigError("logits_fields", "is not wired into tensor-parallel serving (--tp > 1); leave it unset")
        self._check_depth()
        if self.pipeline_depth > TP_MAX_DEPTH and self.tp > 1:
            raise ConfigError("pipeline_depth", f"tensor-parallel serving (--tp > 1) keeps at most {TP_MAX_DEPTH} bursts "
                                                f"in flight, got {self.pipeline_depth}")
        for name in ("prefill_chunk", "prefill_warmup", "decode_kernels"):
            if getattr(self, name) is not None and self.tp > 1:
                raise ConfigError(name, f"is not wired into tensor-parallel serving (--tp > 1); leave it unset "
                                        f"(got {getattr(self, name)!r})")
        self._check_mode()
        self._check_network()
        self._check_ngram()
        if self.model is None:
            self._check_stubs()
        else:
            self._check_model()
        self._check_k()

    def _check_depth(self) -> None:
        """``pipeline_depth`` sets the pipelined graph engine only: refused with another, then filled in."""
        if self.pipeline_depth is not None and (self.engine != "graph" or not self.pipelined):
            running = f"engine={self.engine!r}" if self.engine != "graph" else "pipelined=False"
            raise ConfigError("pipeline_depth", f"sets the pipelined graph engine only, and this loop runs {running}; "
                                                f"got {self.pipeline_depth}")
        if self.pipeline_depth is None:
            self._set("pipeline_depth", DEFAULT_PIPELINE_DEPTH)

    def _check_capacity(self) -> None:
        if self.capacity != AUTO_CAPACITY:
            if self.capacity < MIN_CAPACITY:
                raise ConfigError("capacity", f"{self.capacity} KV entries per slot hold no request; the smallest "
                                              f"capacity is {MIN_CAPACITY} (one prompt token plus one new token)")
            if self.gpu_memory_fraction is not None:
                raise ConfigError("gpu_memory_fraction", f"applies to capacity={AUTO_CAPACITY!r} only (capacity is "
                                                         f"{self.capacity}), got {self.gpu_memory_fraction!r}")
            return
        if self.tp > 1:
            raise ConfigError("capacity", f"{AUTO_CAPACITY!r} is not wired into tensor-parallel serving "
                                          f"(tp={self.tp}); give a number")
        try:
            fraction = DEFAULT_GPU_MEMORY_FRACTION if self.gpu_memory_fraction is None else \
                check_fraction(self.gpu_memory_fraction)
        except (TypeError, ValueError) as exc:
            raise ConfigError("gpu_memory_fraction", str(exc).removeprefix("gpu_memory_fraction ")) from None
        self._set("gpu_memory_fraction", fraction)

    def _check_mode(self) -> None:
        """A field of the other serving mode (or engine) would be ignored: refuse it rather than drop it."""
        if self.admission != "auto" and (self.engine != "graph" or not self.pipelined):
            raise ConfigError("admission", f"orders the pipelined graph engine's steps only, got {self.admission!r}")
        if self.admission == "early" and self.tp > 1:
            raise ConfigError("admission", "tensor-parallel serving (--tp > 1) admits after refilling on every rank")
        if self.device_exit != "off" and self.engine != "graph":
            raise ConfigError("device_exit", f"ends the graph engine's bursts on the device, and this loop runs "
                                             f"engine={self.engine!r}; got {self.device_exit!r}")
        if self.device_exit != "off" and self.tp > 1:
            raise ConfigError("device_exit", "tensor-parallel ranks take the same steps, and a burst that ends when a "
                                             "request arrives on one rank would not; leave it off with --tp > 1")
        if self.http is None:
            for name in ("tokenizer", "served_model_name"):
                if getattr(self, name) is not None:
                    raise ConfigError(name, f"applies to HTTP serving only (http), got {getattr(self, name)!r}")
        else:
            for name, unset in (("requests", "-"), ("output", "-"), ("live", False)):
                if getattr(self, name) != unset:
                    raise ConfigError(name, f"applies to JSONL serving only (no http), got {getattr(self, name)!r}")

    def _check_network(self) -> None:
        """The network fields: tuples of strings, HTTP only. A key is never quoted in an error."""
        for name in ("api_key", "allowed_origins"):
            value = () if getattr(self, name) is None else getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ConfigError(name, "must be a list of strings" + ("" if name == "api_key" else f", got {value!r}"))
            self._set(name, tuple(value))
        for name in ("metrics_need_key", "no_access_log"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be a bool, got {getattr(self, name)!r}")
        if self.no_access_log and self.access_log is not None:
            raise ConfigError("no_access_log", f"access_log {self.access_log!r} is given too; give one of the two")
        if self.http is None:
            for name in ("api_key", "api_key_file", "metrics_need_key", "ssl_certfile", "ssl_keyfile",
                         "allowed_origins", "access_log", "no_access_log"):
                if getattr(self, name) not in (None, (), False):
                    shown = "" if name == "api_key" else f", got {getattr(self, name)!r}"
                    raise ConfigError(name, f"applies to HTTP serving only (http){shown}")

    def _check_ngram(self) -> None:
        if self.lookup:
            for name in ("accept", "p_min"):  # settings of the draft model that prompt lookup replaces
                if getattr(self, name) is not None:
                    raise ConfigError(name, f"sets the draft model, which draft={NGRAM_DRAFT!r} replaces; got "
                                            f"{getattr(self, name)!r}")
        if not self.lookup:
            for name in ("ngram_min", "ngram_max"):
                if getattr(self, name) is not None:
                    raise ConfigError(name, f"applies to draft={NGRAM_DRAFT!r} only, got {getattr(self, name)!r}")
            return
        if self.tp > 1:
            raise ConfigError("draft", f"{NGRAM_DRAFT!r} is not wired into tensor-parallel serving (tp={self.tp})")
        lo = DEFAULT_NGRAM_MIN if self.ngram_min is None else self.ngram_min
        hi = max(DEFAULT_NGRAM_MAX, lo) if self.ngram_max is None else self.ngram_max
        try:
            lo, hi = check_ngram_range(lo, hi)
        except (TypeError, ValueError) as exc:
            raise ConfigError("ngram_min" if "min" in str(exc).split(" ")[0] else "ngram_max", str(exc)) from None
        self._set("ngram_min", lo)
        self._set("ngram_max", hi)

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # frozen: only __post_init__ fills in and normalises

    def _check_stubs(self) -> None:
        for name in ("draft", "dtype", "p_min", "decode_kernels"):
            if getattr(self, name) is not None and not (name == "draft" and self.lookup):
                raise ConfigError(name, f"applies to a model checkpoint only (the stub models are the "
                                        f"default), got {getattr(self, name)!r}")
        for name, value in STUB_DEFAULTS.items():
            if getattr(self, name) is None:
                self._set(name, value)

    def _check_model(self) -> None:
        for name in STUB_DEFAULTS:
            if getattr(self, name) is not None:
                raise ConfigError(name, f"applies to the stub models only; a model checkpoint sets the model "
                                        f"(got {getattr(self, name)!r})")
        if self.model == TINY_RANDOM:
            if self.draft is not None and not self.lookup:
                raise ConfigError("draft", f"model {TINY_RANDOM!r} builds its own draft (or use {NGRAM_DRAFT!r}), "
                                           f"got {self.draft!r}")
        else:
            for name in ("model",) if self.lookup or self.draft is None else ("model", "draft"):
                try:
                    check_checkpoint(getattr(self, name))
                except CheckpointError as exc:
                    raise ConfigError(name, str(exc)) from None
            # HTTP reads the model's own tokenizer unless told otherwise (JSONL takes token ids)
            if self.http is not None and self.tokenizer is None and has_tokenizer(self.model):
                self._set("tokenizer", self.model)
        self._set("dtype", self.dtype or "float32")
        self._set("p_min", 0.0 if self.p_min is None else self.p_min)
        self._set("decode_kernels", self.decode_kernels or "auto")

    def _check_k(self) -> None:
        """Fill in ``k`` and refuse a draft that ``k`` would leave unused, or drafts with no draft to make them.

        A checkpoint served with no ``draft`` decodes plainly (k 0); the stubs and ``tiny-random`` build
        their own draft, which ``k=0`` leaves out. Prompt lookup drafts, so it needs k >= 1.
        """
        no_draft = self.model not in (None, TINY_RANDOM) and self.draft is None
        if self.k is None:
            self._set("k", 0 if no_draft else DEFAULT_K)
        elif no_draft and self.k > 0:
            raise ConfigError("k", f"{self.k} drafts per round need a draft: give draft (a checkpoint, or "
                                   f"{NGRAM_DRAFT!r}), or leave k unset to decode {self.model!r} plainly (k 0)")
        if self.k > 0:
            return
        if self.spec_max_batch is not None:
            raise ConfigError("spec_max_batch", f"switches speculation off above a batch size, and k 0 decodes "
                                                f"plainly; got {self.spec_max_batch}")
        if self.lookup:
            raise ConfigError("k", f"0 decodes plainly, and draft={NGRAM_DRAFT!r} proposes drafts: give k >= 1, or "
                                   f"leave the draft out")
        if self.draft is not None:
            raise ConfigError("k", f"0 decodes plainly and never calls the draft {self.draft!r}: leave the draft out")
        if self.tp > 1:
            raise ConfigError("k", "0 (plain decoding) is not wired into tensor-parallel serving (tp > 1); give a "
                                   "draft checkpoint and k >= 1")
        if self.p_min not in (None, 0.0):
            raise ConfigError("p_min", f"sets the draft, which plain decoding (k 0) does without; got {self.p_min!r}")
        if self.stubs and self.accept != STUB_DEFAULTS["accept"]:
            raise ConfigError("accept", f"sets the stub draft, which plain decoding (k 0) does without; got "
                                        f"{self.accept!r}")

    @property
    def plain(self) -> bool:
        """Plain decoding: no draft, one token a round (``k`` 0)."""
        return self.k == 0

    @property
    def stubs(self) -> bool:
        return self.model is None

    @property
    def warmup_rows(self) -> int:
        """Rows of the prefill warm-up (``prefill_warmup``, None: :data:`DEFAULT_PREFILL_WARMUP`)."""
        return DEFAULT_PREFILL_WARMUP if self.prefill_warmup is None else self.prefill_warmup

    @property
    def lookup(self) -> bool:
        """Prompt-lookup drafting (``draft="ngram"``): no draft model."""
        return self.draft == NGRAM_DRAFT


def _int_in(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(name, f"must be an int, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(name, f"must be in {lo}..{hi}, got {value}")
    return int(value)


def _real_in(name: str, value, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(name, f"must be a number, got {type(value).__name__} {value!r}")
    if math.isnan(value) or not lo <= value <= hi:
        raise ConfigError(name, f"must be in [{lo:g}, {hi:g}], got {value}")
    return float(value)


def model_name(config: ServeConfig) -> str:
    """The name the model is served as: ``served_model_name``, else taken from ``model``."""
    if config.served_model_name is not None:
        return config.served_model_name
    if config.model is None:
        return STUB_MODEL_NAME
    return TINY_RANDOM if config.model == TINY_RANDOM else os.path.basename(os.path.normpath(config.model))


def model_vocab(config: ServeConfig) -> int:
    """The vocabulary of the target ``config`` describes, read from its config (no tensor is loaded)."""
    if config.stubs:
        return config.vocab
    from ..models import checkpoint  # torch: only when a model is asked for

    if config.model == TINY_RANDOM:
        return checkpoint.tiny_random_configs()[0].vocab_size
    return checkpoint.read_config(config.model).vocab_size


def check_tokenizer_vocab(config: ServeConfig) -> None:
    """Refuse a ``tokenizer`` with text for fewer ids than the model's vocabulary (ConfigError naming both
    sizes): the ids it lacks would come back with no text. The model's own tokenizer is not checked (a
    checkpoint's vocabulary is often padded past its tokenizer's); a larger tokenizer is fine."""
    if config.tokenizer is None or (config.model is not None and config.model != TINY_RANDOM and
                                    _same_path(config.tokenizer, config.model)):
        return
    size = tokenizer_size(config.tokenizer)
    try:
        vocab = model_vocab(config)
    except CheckpointError:  # the model's loader says what is wrong with its config, naming the file
        return
    if size is not None and size < vocab:
        raise ConfigError("tokenizer", f"{config.tokenizer!r} has text for {size} token ids, fewer than the model's "
                                       f"vocabulary of {vocab}: ids {size} and up would come back with no text")


def _same_path(a: str, b: str) -> bool:
    from ..models.named import resolve_model

    return os.path.realpath(os.fspath(resolve_model(a))) == os.path.realpath(os.fspath(resolve_model(b)))


def startup_notes(config: ServeConfig, loop: ServeLoop, *, chat: bool = False) -> list[str]:
    """Start-up lines on what nothing else says: how requests are decoded (plainly, with no draft; on which
    decode kernels, when not the default; which burst form runs with ``device_exit``, and why "auto" fell
    back), the length of a chat request without ``max_tokens`` (``chat``: the chat route is on), and, for
    the stub models sampling on the CPU, how slow that is."""
    lines = []
    if config.plain:  # a checkpoint given no draft decodes this way by default: say so, once
        lines.append("no draft: plain decoding, one token a round (give a draft, or --draft ngram, to speculate)")
    if config.decode_kernels not in (None, "auto"):
        lines.append(f"decode and verify forwards on decode_kernels={config.decode_kernels!r}")
    graph = loop.graph
    if config.device_exit != "off" and graph is not None:
        if graph.device_exit:
            lines.append("bursts end on the device: each burst's rounds run in a conditional WHILE node")
        elif graph.ladder:
            why = "" if config.device_exit == "ladder" else f" (a WHILE-node burst cannot be built here: " \
                                                            f"{graph.device_exit_probe})"
            lines.append(f"bursts of a ladder of {', '.join(map(str, graph.rungs))} rounds, each as long as the queue "
                         f"wants{why}")
    if chat:
        lines.append(f"a chat request without max_tokens runs until a stop token or a full slot: up to "
                     f"{loop.dec.capacity} tokens minus its prompt; send max_tokens to bound it")
    if config.sampling and config.stubs and not loop.dec.backend.is_gpu:
        # a burst's cost, scaled from the measured one by slots x vocabulary x verified rows
        burst_s = CPU_STUB_SAMPLING_BURST_S * (config.batch * config.vocab * config.rounds * (config.k + 1)) / \
            (64 * 32000 * 8 * 5)
        if burst_s >= SLOW_BURST_S:
            lines.append(f"stub sampling on the CPU is slow: each burst samples every slot over the whole vocabulary, "
                         f"about {burst_s:.0f} s a burst at --batch {config.batch} --vocab {config.vocab} (measured "
                         f"at --batch 64 --vocab 32000 on 2 CPU cores: {CPU_STUB_SAMPLING_FIRST_S} s to a request's "
                         f"first tokens, then {CPU_STUB_SAMPLING_BURST_S} s a burst); lower --batch or --vocab for a "
                         f"quicker run")
    return lines


def memory_specs(config: ServeConfig, prefill_tokens: int | None = None) -> list[MemorySpec]:
    """What the loop ``config`` describes will allocate, per part, for :func:`resolve_capacity`.

    The models' specs come from their configs (a checkpoint's ``config.json``, read
    without loading a tensor); the decoder's part is its prefill staging (per slot and
    row) and its burst buffers (:meth:`StreamBufs.layout_nbytes`, sampling buffers included).
    ``prefill_tokens``: the most prompt tokens one prefill forward takes (None:
    ``llama_memory.DEFAULT_PREFILL_TOKENS``; a chunked prefill's chunk bounds it).
    """
    if config.stubs:
        vocab = config.vocab
        target, draft = stub_memory_spec(config.layers, "target"), stub_memory_spec(1, "draft")
        if config.plain:
            draft = None
    else:
        import torch

        from ..models import checkpoint, llama_memory  # torch: only when a model is asked for

        if config.model == TINY_RANDOM:
            t_cfg, d_cfg = checkpoint.tiny_random_configs()
        else:
            t_cfg = checkpoint.read_config(config.model)
            d_cfg = None if config.lookup or config.plain else checkpoint.read_config(config.draft)
        kw = dict(dtype=getattr(torch, config.dtype), batch=config.batch, warm_rows=config.warmup_rows,
                  prefill_tokens=llama_memory.DEFAULT_PREFILL_TOKENS if prefill_tokens is None else prefill_tokens,
                  chunked=config.prefill_chunk is not None)
        vocab = t_cfg.vocab_size
        target = llama_memory.memory_spec(t_cfg, name="target", decode_tokens=config.k + 1, warm_head=True, **kw)
        draft = None if config.lookup or config.plain else \
            llama_memory.memory_spec(d_cfg, name="draft", decode_tokens=1, **kw)
    if config.lookup:
        draft = NgramDraft.memory_spec()
    bufs = StreamBufs.layout_nbytes(config.batch, config.k, config.rounds, vocab if config.sampling else None)
    if config.logits_fields:  # counts and prompt marks, [B, V] each
        bufs += SlotFields.layout_nbytes(config.batch, vocab)
    decoder = MemorySpec("decoder", slot_row_bytes=PROMPT_STAGING_BYTES, fixed_bytes=bufs)
    return [spec for spec in (target, draft, decoder) if spec is not None]  # plain decoding: no draft


def resolve_capacity(config: ServeConfig, backend=None, *, free_bytes: int | None = None,
                     total_bytes: int | None = None,
                     prefill_tokens: int | None = None) -> tuple[ServeConfig, CapacityPlan | None]:
    """``config`` with ``capacity="auto"`` replaced by the capacity that fits the GPU, and the plan.

    A numeric capacity comes back unchanged with no plan. The figures are the backend's
    GPU's (``cudaMemGetInfo``, read now: call this before building anything else on it),
    or ``free_bytes`` and ``total_bytes`` given (any backend). ``prefill_tokens``: as for
    :func:`memory_specs`.

    Raises
    ------
    ValueError
        On the numpy backend without figures; when the pair does not fit at its smallest
        useful capacity (a prompt of 1 plus one burst), naming the figures; a checkpoint
        config that cannot be read (CheckpointError).
    """
    if not isinstance(config, ServeConfig):
        raise TypeError(f"resolve_capacity takes a ServeConfig, got {type(config).__name__}")
    if config.capacity != AUTO_CAPACITY:
        return config, None
    if free_bytes is None and total_bytes is None:
        backend = get_backend(config.backend) if backend is None else backend
    if prefill_tokens is None:
        prefill_tokens = config.prefill_chunk  # a chunked prefill's forward takes at most a chunk
    plan = auto_capacity(memory_specs(config, prefill_tokens), batch=config.batch,
                         gpu_memory_fraction=config.gpu_memory_fraction, free_bytes=free_bytes,
                         total_bytes=total_bytes, backend=backend, min_capacity=1 + config.rounds * (config.k + 1))
    return dataclasses.replace(config, capacity=plan.capacity, gpu_memory_fraction=None), plan


def warm_models(models, rows: int, max_length: int | None = None) -> dict | None:
    """Each model's ``warm_prefill`` hook (protocol), before serving: the buckets made and the
    seconds they took in all, or None when no model had anything to warm."""
    done = [hook(m, "warm_prefill")(rows, max_length) for m in models if m is not None]
    done = [d for d in done if d]
    if not done:
        return None
    return {"buckets": sum(d.get("buckets", 0) for d in done), "seconds": sum(d.get("seconds", 0.0) for d in done)}


def describe_warmup(done: dict) -> str:
    """The start-up line of a prefill warm-up (:func:`warm_models`)."""
    return f"prefill warm-up: {done['buckets']} buckets captured in {done['seconds']:.2f} s"


def build_loop(config: ServeConfig, backend=None, *, log=None) -> ServeLoop:
    """The models and the loop ``config`` describes; ``backend`` defaults to ``config.backend``'s.

    Stubs by default; ``model=DIR, draft=DIR`` loads a Llama pair with
    :func:`graphburst.models.checkpoint.load_pair` (torch on the backend's device: the GPU the
    cupy backend uses, else the CPU), ``model="tiny-random"`` builds
    :func:`graphburst.models.checkpoint.tiny_random_pair`. ``capacity="auto"`` is sized
    first by :func:`resolve_capacity` (call that yourself to see the plan, or to pass
    the memory figures). The models' prefill is then warmed (``prefill_warmup`` rows,
    :func:`warm_models`) before the loop is built; ``log`` (a callable taking one line,
    optional) gets :func:`describe_warmup`'s line when a model warmed anything.

    Raises
    ------
    ValueError, OSError, ImportError
        A checkpoint that cannot be loaded (the message names the file or key); a pair
        that does not fit ``capacity="auto"``.
    """
    if not isinstance(config, ServeConfig):
        raise TypeError(f"build_loop takes a ServeConfig, got {type(config).__name__}")
    backend = get_backend(config.backend) if backend is None else backend
    config, _ = resolve_capacity(config, backend)  # capacity="auto": from the GPU's memory, before any allocation
    if config.stubs and config.plain:
        target, draft = StubTarget(config.batch, config.vocab, config.layers, config.capacity,
                                   cost_ns=int(config.cost_us * 1000), backend=backend), None
    elif config.stubs:
        target, draft = stub_pair(config.batch, config.vocab, config.layers, 1, config.capacity,
                                  accept_prob=config.accept, cost_ns=int(config.cost_us * 1000), backend=backend)
    else:
        from ..models import checkpoint  # torch and safetensors: only when a model is asked for

        kw = dict(batch=config.batch, capacity=config.capacity, backend=backend, dtype=config.dtype,
                  decode_kernels=config.decode_kernels)
        if config.model == TINY_RANDOM:
            target, draft = checkpoint.tiny_random_pair(**kw, p_min=config.p_min)
            if config.plain:  # the pair's draft is its target's first layer: dropped, not served
                draft = None
        elif config.lookup or config.plain:
            target, draft = checkpoint.load_target(config.model, **kw), None
        else:
            target, draft = checkpoint.load_pair(config.model, config.draft, **kw, p_min=config.p_min)
    if config.lookup:  # the built draft model (stub or tiny) is dropped: prompt lookup replaces it
        draft = ngram_for(target, n_min=config.ngram_min, n_max=config.ngram_max)
    done = warm_models((target, draft), config.warmup_rows, config.prefill_chunk)
    if done is not None and log is not None:
        log(describe_warmup(done))
    return ServeLoop(target, draft, k=config.k, m_rounds=config.rounds, engine=config.engine,
                     pipelined=config.pipelined, depth=config.pipeline_depth, sampling=config.sampling,
                     prefill_chunk=config.prefill_chunk, admission=config.admission, fields=config.logits_fields,
                     device_exit=DEVICE_EXIT_FLAGS[config.device_exit], spec_max_batch=config.spec_max_batch)
