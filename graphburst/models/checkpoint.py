"""Load checkpoints into :class:`graphburst.models.llama.Llama`, and build pairs.

A checkpoint is a Hugging Face directory, a GGUF file (:mod:`~graphburst.models.gguf_checkpoint`:
config, tokenizer and quantized tensors in one file) or a name of
:data:`~graphburst.models.named.NAMED_MODELS` (``smollm2-135m``). A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or a
sharded ``model.safetensors.index.json`` (its ``weight_map`` names each tensor's shard).
The architecture comes from ``config.json`` (Llama, Mistral, Qwen2/2.5, Qwen3: see
``llama_config.py``). Tensors are read one at a time with ``safetensors.safe_open`` and
copied into the model's preallocated parameters, so peak memory is the model plus one
tensor.

Every way a checkpoint can be unusable (a missing or malformed file, invalid JSON, a
truncated or corrupt safetensors file, an unsupported architecture or key, a missing,
unused or misshapen tensor, draft and target vocabularies that differ) raises one
:class:`CheckpointError` (a ``ValueError``) whose message names the file and the key.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..backend import Backend, get_backend
from ..validate import check_int
from .gguf_checkpoint import is_gguf, load_gguf_llama, read_gguf_config
from .llama_config import CheckpointError, LlamaConfig
from .named import resolve_model
from .torch_adapter import TorchDraft, TorchTarget
from .torch_model import _torch, torch_dtype

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: checkpoint tensors that carry no weights: older Llama files saved the RoPE frequencies
#: (recomputed here from the config); a tied model's file may still hold its head (HF ties it anyway)
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read_json(path: Path):
    """The JSON value in ``path``; CheckpointError naming the file for unreadable or invalid JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except (OSError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: cannot read: {' '.join(str(exc).split()) or type(exc).__name__}") from None


def read_config(model_dir):
    """:class:`LlamaConfig` of a checkpoint: ``model_dir/config.json``, a GGUF file's metadata, or a named
    model's (CheckpointError naming the file and a bad key)."""
    model_dir = resolve_model(model_dir)
    if is_gguf(model_dir):
        return read_gguf_config(model_dir)
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (expected a Hugging Face checkpoint directory)")
    return LlamaConfig.from_hf(read_json(path), source=str(path))


def _open(path: Path):
    """``safe_open(path)``; a truncated, empty or garbage file is a CheckpointError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file: {' '.join(str(exc).split())}") from None


def tensor_files(model_dir) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the safetensors file holding it."""
    root = Path(model_dir)
    if (root / INDEX_FILE).is_file():
        index = read_json(root / INDEX_FILE)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{root / INDEX_FILE}: no 'weight_map' object of tensor name -> file name")
        return {name: root / shard for name, shard in weight_map.items()}
    if (root / SINGLE_FILE).is_file():
        with _open(root / SINGLE_FILE) as f:
            return {name: root / SINGLE_FILE for name in f.keys()}
    raise CheckpointError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def load_llama(model_dir, *, batch: int, capacity: int, dtype="float32", device="cpu", **kw):
    """Build a :class:`Llama` from a HF checkpoint directory, a GGUF file or a named model.

    Parameters
    ----------
    model_dir : path
        A directory (config.json + safetensors), a ``.gguf`` file, or a name of
        :data:`~graphburst.models.named.NAMED_MODELS`.
    batch, capacity : int
    dtype : str or torch.dtype
        Weights are cast to it on load.
    device : torch device
    **kw
        Passed to :class:`Llama` (``kv_slack``).

    Raises
    ------
    CheckpointError (a ValueError)
        Naming the file and the bad config key, the missing, unused or misshapen tensor,
        or the corrupt file.
    ValueError
        For a batch or capacity below 1.
    TypeError
        When batch or capacity is not an int.
    """
    from safetensors import SafetensorError

    from .llama import Llama, hf_name

    torch = _torch()
    batch, capacity = check_int("batch", batch), check_int("capacity", capacity)
    model_dir = resolve_model(model_dir)
    if is_gguf(model_dir):
        return load_gguf_llama(model_dir, batch=batch, capacity=capacity, dtype=dtype, device=device, **kw)
    cfg = read_config(model_dir)
    model = Llama(cfg, batch=batch, capacity=capacity, dtype=torch_dtype(dtype), device=device, **kw)
    files = tensor_files(model_dir)
    # HF's separate q/k/v and gate/up tensors are views into the fused parameters: copied in place.
    wanted = {hf_name(n): t for n, t in model.hf_tensors().items()}
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        if name not in files:
            raise CheckpointError(f"{model_dir}: checkpoint lacks tensor {name!r} (config.json: model_type "
                                  f"{cfg.model_type!r})")
        by_file.setdefault(files[name], []).append(name)
    # A tensor the config does not account for (a bias, a q_norm) means the config describes
    # another function than the weights: refused rather than silently dropped.
    tied_head = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unused = sorted(n for n in files if n not in wanted and n not in tied_head and not n.endswith(IGNORED_SUFFIXES))
    if unused:
        raise CheckpointError(f"{model_dir}: checkpoint tensor {unused[0]!r} is not used by config.json's model "
                              f"(model_type {cfg.model_type!r}; {len(unused)} such tensors)")
    with torch.no_grad():
        for path, names in by_file.items():
            if not path.is_file():
                raise CheckpointError(f"{path}: missing (named by {INDEX_FILE} for {names[0]!r})")
            with _open(path) as f:
                for name in names:
                    try:
                        src = f.get_tensor(name)
                    except SafetensorError as exc:
                        raise CheckpointError(f"{path}: cannot read tensor {name!r}: {exc}") from None
                    dst = wanted[name]
                    if tuple(src.shape) != tuple(dst.shape):
                        raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(src.shape)}, "
                                              f"config.json implies {tuple(dst.shape)}")
                    dst.copy_(src)
    return model


def _device_of(backend: Backend, device):
    want = f"cuda:{backend.device_id}" if backend.is_gpu else "cpu"
    if device is not None and str(device) != want and not (backend.is_gpu and str(device) == "cuda"):
        raise ValueError(f"device {device!r} does not match the {backend.name} backend (needs {want})")
    return want


def wrap_pair(target_module, draft_module, *, batch: int, capacity: int, backend, p_min: float = 0.0):
    """Wrap two torch modules as a (TorchTarget, TorchDraft) pair; the vocabularies must match."""
    if target_module.vocab != draft_module.vocab:
        raise CheckpointError(f"target vocab_size {target_module.vocab} != draft vocab_size {draft_module.vocab}: "
                              f"a draft must share its target's vocabulary")
    target = TorchTarget(target_module, batch=batch, capacity=capacity, backend=backend)
    draft = TorchDraft(draft_module, batch=batch, capacity=capacity, backend=backend, p_min=p_min)
    return target, draft


def load_target(model_dir, *, batch: int, capacity: int, backend: Backend | str = "auto", dtype="float32",
                device=None, decode_kernels: str = "auto"):
    """Load a target checkpoint alone, as a :class:`TorchTarget` (for a draft with no weights, such as
    :class:`~graphburst.models.ngram.NgramDraft`). ``decode_kernels``: :class:`Llama`'s."""
    backend = get_backend(backend)
    module = load_llama(model_dir, batch=batch, capacity=capacity, dtype=dtype, device=_device_of(backend, device),
                        decode_kernels=decode_kernels)
    return TorchTarget(module, batch=batch, capacity=capacity, backend=backend)


def load_pair(model_dir, draft_dir, *, batch: int, capacity: int, backend: Backend | str = "auto",
              dtype="float32", device=None, p_min: float = 0.0, decode_kernels: str = "auto"):
    """Load a target and a draft checkpoint as a graphburst pair (``decode_kernels``: :class:`Llama`'s, for both).

    Returns
    -------
    (TorchTarget, TorchDraft)
    """
    backend = get_backend(backend)
    device = _device_of(backend, device)
    # Both configs first: a vocabulary mismatch or a bad draft config fails before any tensor is read.
    t_cfg, d_cfg = read_config(model_dir), read_config(draft_dir)
    if t_cfg.vocab_size != d_cfg.vocab_size:
        raise CheckpointError(f"{draft_dir}/config.json: vocab_size {d_cfg.vocab_size} differs from the target's "
                              f"{t_cfg.vocab_size} ({model_dir}); a draft must share its target's vocabulary")
    target = load_llama(model_dir, batch=batch, capacity=capacity, dtype=dtype, device=device,
                        decode_kernels=decode_kernels)
    draft = load_llama(draft_dir, batch=batch, capacity=capacity, dtype=dtype, device=device,
                       decode_kernels=decode_kernels)
    return wrap_pair(target, draft, batch=batch, capacity=capacity, backend=backend, p_min=p_min)


def tiny_random_configs(*, vocab: int = 512, hidden: int = 64, layers: int = 4):
    """The (target, draft) :class:`LlamaConfig` pair :func:`tiny_random_pair` builds: the draft is the
    target's first layer."""
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4)
    return cfg, cfg.replace(num_hidden_layers=1)


def tiny_random_pair(*, batch: int, capacity: int, backend: Backend | str = "auto", dtype="float32", device=None,
                     seed: int = 0, vocab: int = 512, hidden: int = 64, layers: int = 4, p_min: float = 0.0,
                     residual_scale: float = 0.25, decode_kernels: str = "auto"):
    """A small random Llama target and its early-exit draft, built in memory (no files).

    The draft is the target's first layer with the target's embeddings, final norm and
    head. The target's later layers have their residual-branch output projections
    (``o_proj``, ``down_proj``) scaled by ``residual_scale``, so they perturb the draft's
    view rather than replace it: the draft agrees often enough for a demo to show real
    acceptance (1.0 gives a plain random model, where an early exit rarely agrees).
    ``decode_kernels``: :class:`Llama`'s, for both.

    Returns
    -------
    (TorchTarget, TorchDraft)
    """
    from .llama import Llama

    torch = _torch()
    batch, capacity = check_int("batch", batch), check_int("capacity", capacity)
    backend = get_backend(backend)
    device = _device_of(backend, device)
    cfg, draft_cfg = tiny_random_configs(vocab=vocab, hidden=hidden, layers=layers)
    dt = torch_dtype(dtype)
    target = Llama(cfg, batch=batch, capacity=capacity, dtype=dt, device=device,
                   decode_kernels=decode_kernels).init_random_(seed)
    with torch.no_grad():
        for block in target.layers[1:]:
            block.self_attn.o_proj.weight.mul_(residual_scale)
            block.mlp.down_proj.weight.mul_(residual_scale)
    draft = Llama(draft_cfg, batch=batch, capacity=capacity, dtype=dt, device=device, decode_kernels=decode_kernels)
    own = dict(target.named_parameters())
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(own[name])  # layers.0.*, embeddings, norm, head: all names exist in the target
    return wrap_pair(target, draft, batch=batch, capacity=capacity, backend=backend, p_min=p_min)
