"""GGUF checkpoints (llama.cpp's and Ollama's single-file format) into :class:`~graphburst.models.llama.Llama`.

One ``.gguf`` file holds the config, the tokenizer (vocabulary, merges, special ids, the
chat template) and the tensors, most of them quantized. Every part is read by a well-kept
library, none by hand:

* the config and the tokenizer through transformers' GGUF integration
  (``AutoConfig`` / ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``), the config then
  checked key by key as a ``config.json`` is (:meth:`LlamaConfig.from_hf`);
* the tensors through the ``gguf`` package (llama.cpp's own reader): ``GGUFReader`` maps the
  file, ``gguf.dequantize`` expands each tensor to float32, and the package's tensor-name map
  (``get_tensor_name_map``) gives the GGUF name of each Hugging Face tensor.

Tensors are dequantized one at a time and copied into the model's preallocated
parameters, so peak memory is the model plus one float32 tensor. llama.cpp's converter
reorders the rows of ``q_proj`` and ``k_proj`` in ``llama`` files (its RoPE pairs adjacent
elements, Hugging Face's pairs the two halves); :func:`unpermute_rows` undoes that, as
transformers does when it loads the same file. The file's weights are then exactly the
dequantized values; ``dtype`` rounds them once more.

Every way a file can be unusable (missing, not GGUF, an architecture or key graphburst
does not compute, a quant type the ``gguf`` package cannot expand, a missing, unused or
misshapen tensor) raises :class:`CheckpointError` naming the file and the key or tensor.
"""

from __future__ import annotations

import functools
from pathlib import Path

from .llama_config import CheckpointError, LlamaConfig

GGUF_SUFFIX = ".gguf"
ARCH_KEY = "general.architecture"
#: GGUF architectures graphburst computes, and whether llama.cpp's converter reordered their
#: q/k rows. Mistral files say ``llama``; Qwen2 and Qwen3 keep Hugging Face's order.
ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}
#: GGUF tensors that carry no weights graphburst uses: a tied model's file may still hold its head
#: (``output.weight``; the head is the embedding, as transformers ties it).
TIED_HEAD = "output.weight"


def is_gguf(path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix: what llama.cpp and Ollama write)."""
    return str(path).lower().endswith(GGUF_SUFFIX)


def _gguf():
    try:
        import gguf
    except ImportError as exc:
        raise ImportError(f"GGUF checkpoints need the gguf package (pip install 'graphburst[torch]'): {exc}") from None
    return gguf


@functools.cache
def _reader_class(gguf):
    """``gguf.GGUFReader`` over a plain ndarray view of its ``np.memmap``: the same mapped bytes.

    The reader slices its map once or twice for every metadata value (a tokenizer's vocabulary
    and merges are ~50k strings each), and every slice of an ``np.memmap`` runs memmap's Python
    ``__array_finalize__``: opening SmolLM2's file took ~2.4 s on a small CPU, ~0.8 s without it.
    The view keeps the map alive as its base, so the tensors still read from the file.
    """
    import numpy as np

    class Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapped):
            self._data = mapped.view(np.ndarray)

    return Reader


def open_gguf(path):
    """``gguf.GGUFReader`` over ``path``; CheckpointError naming the file when it is missing or not GGUF."""
    gguf = _gguf()
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    try:
        return _reader_class(gguf)(path)
    except (ValueError, OSError, KeyError, IndexError) as exc:  # a bad magic or version, a truncated file
        raise CheckpointError(f"{path}: not a readable GGUF file: {' '.join(str(exc).split())}") from None


def _architecture(reader, path) -> str:
    field = reader.fields.get(ARCH_KEY)
    if field is None or not field.data:
        raise CheckpointError(f"{path}: no {ARCH_KEY} key")
    arch = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: {ARCH_KEY} {arch!r} is not supported (graphburst computes "
                              f"{', '.join(ARCHITECTURES)})")
    return arch


#: configs already read, by (path, size, mtime): transformers parses the whole file's metadata
#: for a config (~2.4 s for SmolLM2's vocabulary on a small CPU), and a command may size a model's
#: memory from its config before loading it; a file rewritten since is read again
_CONFIGS: dict[tuple, LlamaConfig] = {}


def _file_key(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None  # open_gguf names the file
    return str(path), st.st_size, st.st_mtime_ns


def read_gguf_config(path) -> LlamaConfig:
    """:class:`LlamaConfig` from a GGUF file's metadata (through transformers), checked as a ``config.json``."""
    path = Path(path)
    return _config(None, path)


def _config(reader, path: Path) -> LlamaConfig:
    """:func:`read_gguf_config` over a reader of ``path`` already open (a load maps the file once), or
    None to open one if the config is not known yet."""
    key = _file_key(path)
    if key is not None and key in _CONFIGS:
        return _CONFIGS[key]
    cfg = _read_config(open_gguf(path) if reader is None else reader, path)
    if key is not None:
        _CONFIGS[key] = cfg
    return cfg


def _read_config(reader, path: Path) -> LlamaConfig:
    from transformers import AutoConfig

    arch = _architecture(reader, path)
    try:
        hf = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:  # transformers' refusals of a file it cannot map
        raise CheckpointError(f"{path}: transformers cannot read its config: {' '.join(str(exc).split())}") from None
    cfg = hf.to_dict()
    # transformers maps no head size for every architecture (its Qwen3 config then assumes 128):
    # the file states it, as llama.cpp reads it
    key_length = _int_field(reader, f"{arch}.attention.key_length")
    if key_length is not None:
        cfg["head_dim"] = key_length
    return LlamaConfig.from_hf(cfg, source=str(path))


def _int_field(reader, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None or not field.data else int(field.parts[field.data[0]][0])


def unpermute_rows(w, n_heads: int):
    """``w`` ([n_heads * head_dim, ...] numpy) with llama.cpp's q/k row order undone.

    The converter stores each head's rows interleaved (rows ``0, h, 1, h + 1, ...`` of a head of
    ``2h`` rows, for RoPE on adjacent pairs); Hugging Face keeps the two halves apart.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_llama(path, *, batch: int, capacity: int, dtype="float32", device="cpu", **kw):
    """Build a :class:`Llama` from a GGUF file (the config, then every tensor dequantized into place).

    Parameters as :func:`graphburst.models.checkpoint.load_llama`.

    Raises
    ------
    CheckpointError (a ValueError)
        Naming the file and the key, tensor or quant type that cannot be used.
    """
    import numpy as np
    import torch

    from .llama import Llama, hf_name
    from .torch_model import torch_dtype

    gguf = _gguf()
    path = Path(path)
    reader = open_gguf(path)
    cfg = _config(reader, path)
    arch_name = _architecture(reader, path)
    permuted = ARCHITECTURES[arch_name]
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    model = Llama(cfg, batch=batch, capacity=capacity, dtype=torch_dtype(dtype), device=device, **kw)
    wanted = {}
    for name, dst in model.hf_tensors().items():
        hf = hf_name(name)
        stem, _, kind = hf.rpartition(".")
        mapped = names.get_name(stem)
        if mapped is None or f"{mapped}.{kind}" not in tensors:
            missing = "no GGUF name" if mapped is None else repr(f"{mapped}.{kind}")
            raise CheckpointError(f"{path}: file lacks the tensor for {hf!r} ({missing}; {ARCH_KEY} {arch_name!r})")
        wanted[f"{mapped}.{kind}"] = (hf, dst)
    ignored = {TIED_HEAD} if cfg.tie_word_embeddings else set()
    unused = sorted(n for n in tensors if n not in wanted and n not in ignored)
    if unused:
        raise CheckpointError(f"{path}: tensor {unused[0]!r} is not used by the model its metadata describes "
                              f"({len(unused)} such tensors)")
    with torch.no_grad():
        for gname, (hf, dst) in wanted.items():
            t = tensors[gname]
            try:
                values = gguf.dequantize(t.data, t.tensor_type)
            except (NotImplementedError, ValueError) as exc:
                raise CheckpointError(f"{path}: tensor {gname!r}: quant type {t.tensor_type.name} cannot be "
                                      f"dequantized by the gguf package ({exc})") from None
            shape = tuple(reversed([int(n) for n in t.shape]))  # GGUF lists dimensions fastest first
            if values.size != int(np.prod(shape)):
                raise CheckpointError(f"{path}: tensor {gname!r} holds {values.size} values, its shape {shape} "
                                      f"needs {int(np.prod(shape))}")
            values = values.reshape(shape)
            if permuted and hf.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg.num_attention_heads if hf.endswith("q_proj.weight") else cfg.num_key_value_heads
                values = unpermute_rows(values, heads)
            if shape != tuple(dst.shape):
                raise CheckpointError(f"{path}: tensor {gname!r} ({hf}) has shape {shape}, the metadata implies "
                                      f"{tuple(dst.shape)}")
            # a float32 tensor comes back as a read-only view of the mapped file: copied once, as torch needs
            dst.copy_(torch.from_numpy(np.require(values, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])))
    return model


#: the tokenizer's special tokens and the metadata keys that name their ids
SPECIAL_TOKEN_KEYS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                      "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


def gguf_tokenizer(path):
    """The file's tokenizer as transformers builds it from the metadata (a fast tokenizer; its
    ``chat_template`` is the file's), CheckpointError naming the file when it cannot.

    The special tokens are then set from the file's own ids (:data:`SPECIAL_TOKEN_KEYS`):
    transformers' GGUF conversion has assigned them differently across versions (5.17 gives
    SmolLM2's ``<|im_start|>``, id 1, as its EOS; the file says ``<|im_end|>``, id 2), and the
    EOS is what a chat request stops on."""
    from transformers import AutoTokenizer

    path = Path(path)
    reader = open_gguf(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{path}: transformers cannot build its tokenizer: {' '.join(str(exc).split())}") from None
    size = len(tok)
    for name, key in SPECIAL_TOKEN_KEYS.items():
        token_id = _int_field(reader, key)
        if token_id is None:
            continue
        if not 0 <= token_id < size:
            raise CheckpointError(f"{path}: {key} {token_id} is outside the tokenizer's {size} tokens")
        setattr(tok, name, tok.convert_ids_to_tokens(token_id))
    return tok
