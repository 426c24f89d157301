"""Model protocol v1: everything a burst calls on a target and a draft model.

A model is any object with the required members below; subclassing :class:`TargetModel`
or :class:`DraftModel` is optional and only supplies the documented defaults of the
optional hooks. Generic code reads an optional hook through :func:`hook`, so a plain
duck-typed model gets the same defaults. ``docs/models.md`` walks through a complete
outside model and gives the reason for every rule.

Required, both models
---------------------
``vocab : int``
    Vocabulary size (>= 2); target and draft must agree.
``cache : KVCache``
    The model's KV layers (``None`` for a layer without KV). The burst rolls back every
    layer's ``length`` through one pointer table and never touches the storage.
``prefill(prompt, prompt_len, pos_ctr, pend, stream, *, start=None, rows=None, lengths=None)``
    Enqueue, on ``stream``, the prompt's KV entries into every KV layer.

    * ``prompt : [B, P_max] int32`` device array, row b holds ``prompt_len[b]`` tokens
      (left-aligned).
    * ``prompt_len : [B] int32``; ``NO_PREFILL`` marks a slot to leave untouched (its
      entries, lengths, ``pos_ctr`` and ``pend`` must not change).
    * ``start``: None (every slot starts at 0) or ``[B] int32`` device array, the position
      of ``prompt[b, 0]``. Given only to a model that declares ``chunked_prefill``, so a long
      prompt then arrives in chunks, and entries ``[0, S)`` (S = ``start[b]``) already hold
      its earlier chunks, which the chunk attends to.
    * For every other slot b: entries ``[S, S + P)`` are written and each KV layer's
      ``length[b] = S + P`` (P = ``prompt_len[b]``, S = 0 without ``start``). Whole or in
      chunks, a prompt must leave the same entries.
    * The **target** gets ``pos_ctr [B] int32`` and sets ``pos_ctr[b] = S + P``. With
      ``pend [B] int32`` (the prompt's last chunk, or the whole prompt) it also sets
      ``pend[b]`` = its greedy token after the prompt (the first pending token); a
      non-final chunk comes with ``pend=None`` and needs no head or logits at all. The
      **draft** gets ``None`` for both.
    * ``rows``: None, or a host numpy int array of the prefilled slots (those not
      ``NO_PREFILL``, sorted). A model that needs the slot list on the host uses it instead
      of reading ``prompt_len`` back (a device-to-host sync would stall the host behind
      bursts in flight); without it, the model may read it.
    * ``lengths``: given (with ``rows``) only to a model whose ``packed_prefill`` is True: a
      host numpy int array of each slot's chunk length, in ``rows``' order, so the model
      can lay the prompts end to end without reading ``prompt_len`` back.
    * It runs eagerly between bursts (or beside bursts in flight), never inside a capture,
      but only on ``stream``: the decoder syncs that stream when it needs the result.

    The decoder passes ``start`` and ``rows`` only to a model that declares
    ``chunked_prefill``; any other model gets the old call ``prefill(prompt, prompt_len,
    pos_ctr, pend, stream)`` (whole prompts), which a chunked model still accepts.

Required, target
----------------
``verify(bufs, stream)``
    Read ``bufs.vtok [B, k+1] int32`` at positions ``pos_ctr + [0, k]``, append one KV
    entry per position at each layer's own length (so each length grows by k + 1), and
    write the greedy token after each position into ``bufs.tgt_pred [B, k+1] int32``.
    Slots past the draft's break hold ``PLACEHOLDER_TOKEN`` (-1): compute on them
    without faulting; they are never accepted.

Required, draft
---------------
``draft_step(bufs, step, stream)`` for ``step`` in ``[0, k)``
    Step j reads its input (``vtok[:, 0]`` for j = 0, else ``draft_tok[:, j-1]``) at
    position ``pos_ctr + j`` and writes ``draft_tok[:, j]`` (and ``draft_conf[:, j]``).
    A chain that stops early sets ``brk[b] = [j, 1]`` (the round starts at ``[k, 0]``)
    and leaves later steps alone for b. After the chain each draft KV layer holds real
    entries at ``[anchor, anchor + n_valid]`` (``anchor = pos_start``, ``n_valid =
    brk[b, 0]``): the inputs of steps 0..n_valid, plus the last draft when no break.

Every call above that a burst makes (``draft_step``, ``verify``) is captured into a CUDA
graph: it may only enqueue work on the stream it is given, never allocate, never sync.

Sampling mode (``SpecDecoder(..., sampling=True)``; both models declare ``supports_sampling``)
-------------------------------------------------------------------------------------------
``bind`` receives StreamBufs with ``bufs.sampling = True`` and these extra buffers
(``V = vocab``): ``tgt_logits [B, k+1, V] float32``, ``draft_logits [B, k, V] float32``
and the per-slot settings ``temperature [B] float32``, ``top_k [B] int32``, ``top_p [B]
float32``, ``seed [B] uint64`` (read-only to models). Then:

* target ``verify`` writes the logits after each verify position into ``tgt_logits``
  (``tgt_pred`` is not read; the burst turns the logits into probabilities in place);
* target ``prefill`` given ``pend`` also writes the logits after the last prompt token
  into ``tgt_logits[b, 0]`` for every prefilled slot (the burst samples the first token);
* draft ``draft_step(bufs, j)`` appends its input's KV as before and writes its logits
  for the next token into ``draft_logits[:, j]`` for every sequence. It does **not**
  choose ``draft_tok[:, j]`` (the burst samples it before step j + 1 reads it) and makes
  no extra append at step k - 1; it may still break the chain (``brk``);
* draft ``draft_append_last(bufs, stream)`` (required in this mode) runs after the last
  sample: for every sequence whose chain did not break (``brk[b, 1] == 0``) it appends
  the KV entry of ``draft_tok[b, k-1]`` at position ``pos_ctr + k``, so rule 2 (the
  draft covers ``[anchor, anchor + n_valid]``) holds as in greedy mode.

A decoder built with ``fields=True`` also processes ``tgt_logits`` per slot (logit_bias,
penalties, min_p, min_tokens; :mod:`graphburst.sampling.fields`) between ``verify`` and the
probabilities, and after ``prefill``; models see nothing of it.

Optional hooks (defaults in brackets)
-------------------------------------
``writes_verify_tokens`` [False]
    True when each usable proposal also goes to ``vtok[:, 1 + j]`` (slots past the break
    stay ``PLACEHOLDER_TOKEN``); the burst then skips the ``assemble_verify`` launch.
``capture_api`` ["cupy"]
    How the model's work is captured: ``"cupy"`` (stream capture) or ``"torch"``.
``bind(bufs)`` [nothing]
    Called once by ``SpecDecoder.__init__`` right after it allocates its ``StreamBufs``,
    outside any capture, so a model may build views of (or tables over) the burst
    buffers. The buffers never move for the decoder's life.
``graph_buffers() -> dict[str, array]`` [{}]
    Device buffers the model's captured work reads or writes besides its cache and the
    StreamBufs; the address guard watches them.
``watched() -> iterable of Watched`` [()]
    The model's own :class:`~graphburst.guard.Watched` holders (pointer tables...):
    rebinding one of their watched attributes marks a captured graph stale.
``refresh_tables()`` [nothing]
    Rebuild anything derived from the cache's addresses (before a recapture).
``supports_sampling`` [False]
    True when the model implements sampling mode (above).
``chunked_prefill`` [False]
    True when ``prefill`` continues a prompt already partly in the cache and takes
    ``start`` and ``rows`` (above): the decoder may then split a long prompt into chunks.
    A model without it gets the old five-argument call, each prompt whole.
``packed_prefill`` [False]
    True when a chunked-prefill model's ``prefill`` takes ``lengths`` (above).
``prefill_groups(lengths: dict[int, int], fresh: bool) -> list[list[int]]`` [one call]
    How a chunked-prefill model wants one admission split into ``prefill`` calls: the
    slots of each call (every slot of ``lengths``, slot -> chunk length, exactly once).
    ``fresh``: every chunk starts at position 0. The decoder narrows the prompt staging
    to each call's longest chunk, so a call pads only to its own rows (a model whose
    prefill cost grows with the padded tokens groups rows of like length).
``prefill_fresh_apart`` [False]
    True when a chunked-prefill model runs prompts at position 0 cheaper in calls of their
    own (``start=None``) than beside later chunks: an admission mixing the two then asks
    ``prefill_groups`` for the fresh slots (``fresh=True``) and for the others apart, and
    calls the model for each (it honours ``rows``). Otherwise every slot goes in the calls
    of one ``prefill_groups(lengths, False)``, with ``start``.
``prefill_in_graph`` [False]
    True when the model's ``prefill(prompt, prompt_len, pos_ctr, pend, stream)`` (with
    ``start=`` for a chunked model) reads every size on the device: each slot's chunk length
    from ``prompt_len`` (``NO_PREFILL``: left alone), one call covering every slot (``rows``
    and ``prefill_groups`` unused), whatever the staging's padded width; and captures on a
    CuPy stream (no allocation, no host sync). When both models declare it, a greedy decoder
    captures their prefill and its slot writes into one CUDA graph per staging width and
    admits with one graph launch (:mod:`graphburst.engine.admission.graphs`); a capture that fails
    makes it warn and admit eagerly from then on.
``warm_prefill(max_rows: int, max_length: int | None = None) -> dict`` [{}]
    Called once before serving, outside any capture: make now whatever the model's
    prefill would otherwise build at its first admissions of up to ``max_rows`` prompts
    of up to ``max_length`` tokens (None: up to the capacity), e.g. captured prefill
    graphs, without changing any cache entry a slot can read. Returns what it did for the
    start-up log (``buckets``, ``seconds``), or {} when it had nothing to do.
``option_keys : frozenset[str]`` [empty]
    The per-request option names this model understands. The decoder rejects a key no
    model claims, and hands each model only the keys it claims.
``slot_options(options: dict) -> object`` [None]
    Validate one request's options (only this model's keys) at submission; raise
    ``ValueError``/``TypeError`` naming the key. The return value is opaque to the burst.
``set_slot_options(settings: dict[int, object | None], stream)`` [nothing]
    Apply validated options between bursts at admission: slot -> what ``slot_options``
    returned, or ``None`` for the defaults (a reused slot). Plain stream-ordered writes
    into fixed buffers; no allocation, so no recapture.
``option_columns() -> tuple`` [()]
    The cheaper alternative to ``set_slot_options`` for options that are one int32 per slot:
    the model's fixed ``[B]`` int32 device arrays its kernels read (a uint32 array viewed as
    int32), one per value of the tuple ``slot_options`` then returns (ints in int32 range: a
    uint32 as its int32 bit pattern; ``slot_options({})`` gives the defaults). The decoder
    then writes a slot's values itself, in admission's one launch (``admit_slots``), and
    never calls ``set_slot_options``.
"""

from __future__ import annotations

from .buffers import KVCache, StreamBufs
from .validate import check_int

CAPTURE_APIS = ("cupy", "torch")
COMMON_MEMBERS = ("vocab", "cache", "prefill")
TARGET_MEMBERS = COMMON_MEMBERS + ("verify",)
DRAFT_MEMBERS = COMMON_MEMBERS + ("draft_step",)
__all__ = ["CAPTURE_APIS", "DraftModel", "ModelHooks", "TargetModel", "check_pair", "check_target", "hook",
           "split_options"]


class ModelHooks:
    """The optional hooks with their defaults (see the module docstring)."""

    writes_verify_tokens: bool = False
    capture_api: str = "cupy"
    supports_sampling: bool = False
    chunked_prefill: bool = False
    packed_prefill: bool = False
    prefill_fresh_apart: bool = False
    prefill_in_graph: bool = False
    option_keys: frozenset = frozenset()

    def bind(self, bufs: StreamBufs) -> None:
        """Called once with the decoder's burst buffers, outside any capture."""

    def graph_buffers(self) -> dict:
        """Extra device buffers the captured work touches (name -> array)."""
        return {}

    def watched(self) -> tuple:
        """The model's own Watched holders, beyond itself and its cache."""
        return ()

    def refresh_tables(self) -> None:
        """Rebuild address-derived state from the cache (before a recapture)."""

    def prefill_groups(self, lengths: dict, fresh: bool) -> list:
        """The slots of each ``prefill`` call of one admission (slot -> chunk length): one call."""
        return [sorted(lengths)]

    def warm_prefill(self, max_rows: int, max_length: int | None = None) -> dict:
        """Prepare the prefill before serving (nothing to prepare): what it did, {}."""
        return {}

    def slot_options(self, options: dict) -> object:
        """Validate one request's options (this model's keys only)."""
        if options:
            key = next(iter(options))
            raise ValueError(f"unknown model option {key!r}")
        return None

    def set_slot_options(self, settings: dict, stream) -> None:
        """Apply validated options per slot between bursts (None = the defaults)."""

    def option_columns(self) -> tuple:
        """Per-slot int32 option columns the decoder writes at admission: none."""
        return ()


class TargetModel(ModelHooks):
    """Optional base of a target model: declares the required members and the defaults."""

    vocab: int
    cache: KVCache

    def prefill(self, prompt, prompt_len, pos_ctr, pend, stream, *, start=None, rows=None, lengths=None) -> None:
        raise NotImplementedError

    def verify(self, bufs: StreamBufs, stream) -> None:
        raise NotImplementedError


class DraftModel(ModelHooks):
    """Optional base of a draft model: declares the required members and the defaults."""

    vocab: int
    cache: KVCache

    def prefill(self, prompt, prompt_len, pos_ctr, pend, stream, *, start=None, rows=None, lengths=None) -> None:
        raise NotImplementedError

    def draft_step(self, bufs: StreamBufs, step: int, stream) -> None:
        raise NotImplementedError


def hook(model, name: str):
    """The model's optional member ``name``, or the documented default bound to it."""
    try:
        return getattr(model, name)
    except AttributeError:
        default = getattr(ModelHooks, name)
        return default.__get__(model) if callable(default) else default


def _missing(model, role: str, members, base) -> None:
    for name in members:
        value = getattr(model, name, None)
        if value is None:
            raise TypeError(f"{role} {type(model).__name__} lacks the required member {name!r}")
        declared = getattr(base, name, None)
        if callable(declared) and getattr(type(model), name, None) is declared:
            raise TypeError(f"{role} {type(model).__name__} does not implement the required member {name!r}")
        if name not in ("vocab", "cache") and not callable(value):
            raise TypeError(f"{role}.{name} must be callable, got {type(value).__name__}")
    if not isinstance(model.cache, KVCache):
        raise TypeError(f"{role}.cache must be a KVCache, got {type(model.cache).__name__}")
    check_int(f"{role}.vocab", model.vocab, minimum=2)
    api = hook(model, "capture_api")
    if api not in CAPTURE_APIS:
        raise ValueError(f"{role}.capture_api must be one of {CAPTURE_APIS}, got {api!r}")


def check_target(target) -> None:
    """Raise TypeError when ``target`` lacks a required member of a target model (named)."""
    _missing(target, "target", TARGET_MEMBERS, TargetModel)


def check_pair(target, draft, *, sampling: bool = False) -> None:
    """Raise when a target/draft pair cannot share one burst (in sampling mode, if asked).

    Raises
    ------
    TypeError
        A required member is missing (named in the message) or has the wrong type.
    ValueError
        Vocabulary, batch or backend disagree, or an optional hook has a bad value.
    """
    _missing(target, "target", TARGET_MEMBERS, TargetModel)
    _missing(draft, "draft", DRAFT_MEMBERS, DraftModel)
    if target.cache.batch != draft.cache.batch:
        raise ValueError(f"target batch {target.cache.batch} != draft batch {draft.cache.batch}")
    if target.cache.backend.name != draft.cache.backend.name:
        raise ValueError(f"target backend {target.cache.backend.name} != draft backend {draft.cache.backend.name}")
    if target.cache.backend.device_id != draft.cache.backend.device_id:
        raise ValueError(f"target device {target.cache.backend.device_id} != draft device "
                         f"{draft.cache.backend.device_id}")
    if target.vocab != draft.vocab:
        raise ValueError(f"target vocab {target.vocab} != draft vocab {draft.vocab}")
    if sampling:
        for role, model in (("target", target), ("draft", draft)):
            if hook(model, "supports_sampling") is not True:
                raise ValueError(f"sampling=True needs models that write logits: {role} {type(model).__name__} does "
                                 f"not declare supports_sampling = True")
        if not callable(getattr(draft, "draft_append_last", None)):
            raise TypeError(f"draft {type(draft).__name__} declares supports_sampling but lacks the sampling-mode "
                            f"member 'draft_append_last'")


def split_options(models: dict, options: dict | None) -> dict:
    """Route one request's options to the models that claim them, validated.

    Parameters
    ----------
    models : dict of role -> model
    options : dict of str -> value, or None

    Returns
    -------
    dict of role -> object
        What each model's ``slot_options`` returned for its share of ``options``.

    Raises
    ------
    TypeError, ValueError
        ``options`` is not a dict, a key no model claims, or a model's own check.
    """
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise TypeError(f"options must be a dict of model options, got {type(options).__name__}")
    claims = {role: frozenset(hook(m, "option_keys")) for role, m in models.items()}
    known = frozenset().union(*claims.values())
    for key in options:
        if key not in known:
            raise ValueError(f"unknown model option {key!r}; the models accept {sorted(known)}")
    return {role: hook(m, "slot_options")({k: v for k, v in options.items() if k in claims[role]})
            for role, m in models.items()}
