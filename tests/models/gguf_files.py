"""Tiny GGUF files written as llama.cpp's converter writes them, for the GGUF loader's tests.

``gguf.GGUFWriter`` (the ``gguf`` package, llama.cpp's own writer) stores the metadata and
the tensors, quantized by ``gguf.quantize``. For the ``llama`` architecture the q/k rows
are reordered as llama.cpp's ``convert_hf_to_gguf.py`` reorders them (``LlamaModel.permute``),
so a loader that forgot to undo it computes another function. transformers loads the same
files (``from_pretrained(dir, gguf_file=...)``) as the independent reference.
"""

from __future__ import annotations

import numpy as np

import gguf

F32, Q8_0, Q4_1 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1
#: per architecture: the switches of its layers (q/k/v biases for Qwen2, per-head q/k norms for Qwen3)
FAMILIES = {"llama": {}, "qwen2": {"bias": True}, "qwen3": {"qk_norm": True}}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (``LlamaModel.permute``): each head's two halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch: str = "llama", qtype=Q8_0, *, vocab: int = 256, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, head_dim: int = 16, ffn: int = 128, layers: int = 2, bias: bool = False,
               qk_norm: bool = False, tied: bool = True, seed: int = 0, extra_tensor: str | None = None,
               drop_tensor: str | None = None) -> str:
    """Write a random model of ``arch`` to ``path``; 2-D weights in ``qtype``, norms and biases in F32.

    ``extra_tensor``: a name written beside the model's tensors (one the model does not use);
    ``drop_tensor``: a name left out. Returns ``path`` as a string.
    """
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)

    def rand(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n):
        return (1 + rand(n, scale=0.1)).astype(np.float32)

    def put(name, a, quantize=True):
        if name == drop_tensor:
            return
        if quantize and qtype != F32:
            w.add_tensor(name, gguf.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

    put("token_embd.weight", rand(vocab, hidden))
    put("output_norm.weight", norm(hidden), quantize=False)
    if not tied:
        put("output.weight", rand(vocab, hidden))
    for i in range(layers):
        q, k = rand(heads * head_dim, hidden), rand(kv_heads * head_dim, hidden)
        if arch == "llama":
            q, k = llama_cpp_permute(q, heads), llama_cpp_permute(k, kv_heads)
        put(f"blk.{i}.attn_q.weight", q)
        put(f"blk.{i}.attn_k.weight", k)
        put(f"blk.{i}.attn_v.weight", rand(kv_heads * head_dim, hidden))
        put(f"blk.{i}.attn_output.weight", rand(hidden, heads * head_dim))
        if bias:
            for part, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                               ("attn_v", kv_heads * head_dim)):
                put(f"blk.{i}.{part}.bias", rand(rows), quantize=False)
        if qk_norm:
            put(f"blk.{i}.attn_q_norm.weight", norm(head_dim), quantize=False)
            put(f"blk.{i}.attn_k_norm.weight", norm(head_dim), quantize=False)
        put(f"blk.{i}.attn_norm.weight", norm(hidden), quantize=False)
        put(f"blk.{i}.ffn_norm.weight", norm(hidden), quantize=False)
        put(f"blk.{i}.ffn_gate.weight", rand(ffn, hidden))
        put(f"blk.{i}.ffn_up.weight", rand(ffn, hidden))
        put(f"blk.{i}.ffn_down.weight", rand(hidden, ffn))
    if extra_tensor is not None:
        w.add_tensor(extra_tensor, rand(hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
