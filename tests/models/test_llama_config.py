"""LlamaConfig.from_hf: every malformed key is a ValueError naming the key and the value.

Before these checks, several of them surfaced later as a TypeError, AttributeError or
RuntimeError from inside the model's construction, naming neither.
"""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig as HFConfig

from graphburst.models.checkpoint import load_llama, tiny_random_pair
from graphburst.models.llama_config import LlamaConfig

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def base() -> dict:
    """A config.json as transformers writes it (its own serialisation, not ours)."""
    return HFConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2).to_dict()


def test_transformers_configs_are_read():
    cfg = LlamaConfig.from_hf(base())
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    llama3 = LlamaConfig.from_hf(HFConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, rope_scaling=LLAMA3).to_dict())
    assert llama3.rope_scaling["rope_type"] == "llama3" and llama3.num_key_value_heads == 4


@pytest.mark.parametrize("change,message", [
    ({"num_key_value_heads": "2"}, "num_key_value_heads must be a positive int, got '2'"),
    ({"num_key_value_heads": 2.0}, "num_key_value_heads must be a positive int, got 2.0"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive int, got 0"),
    ({"num_key_value_heads": True}, "num_key_value_heads must be a positive int, got True"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"head_dim": 15}, "head_dim must be a positive even int .* got 15"),
    ({"head_dim": 16.0}, "head_dim must be a positive even int .* got 16.0"),
    ({"head_dim": "16"}, "head_dim must be a positive even int .* got '16'"),
    ({"head_dim": None, "hidden_size": 66}, "hidden_size 66 is not a multiple of num_attention_heads 4"),
    ({"head_dim": None, "hidden_size": 68}, "hidden_size / num_attention_heads = 17 is odd"),
    ({"rope_scaling": "llama3"}, "rope_scaling must be an object or null, got 'llama3'"),
    ({"rope_scaling": [1, 2]}, "rope_scaling must be an object or null"),
    ({"rope_parameters": "x"}, "rope_parameters must be an object, got 'x'"),
    ({"rope_scaling": {**LLAMA3, "factor": "8"}}, "llama3 rope scaling factor must be a positive number, got '8'"),
    ({"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}}, "high_freq_factor 1.0 must exceed low_freq_factor"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a number in \\(0, 1\\), got '1e-6'"),
    ({"rms_norm_eps": None}, "rms_norm_eps must be a number in \\(0, 1\\), got None"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a number in \\(0, 1\\)"),
    ({"rope_theta": "big"}, "rope_theta must be a positive number, got 'big'"),
    ({"rope_theta": 0}, "rope_theta must be a positive number, got 0"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({"hidden_size": 64.0}, "hidden_size must be a positive int, got 64.0"),
])
def test_malformed_config_is_a_value_error_naming_the_key(change, message):
    cfg = base()
    cfg.pop("rope_parameters", None)  # transformers 5 writes theta here; the cases set the v4 keys
    cfg.update(change)
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf(cfg)


def test_a_malformed_checkpoint_config_fails_before_any_tensor_is_read(tmp_path):
    cfg = base()
    cfg["head_dim"] = 15
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # no weights at all: the config is checked first
    with pytest.raises(ValueError, match="head_dim must be a positive even int"):
        load_llama(tmp_path, batch=1, capacity=8)


@pytest.mark.parametrize("field,value,error", [
    ("batch", 0, ValueError), ("batch", 1.5, TypeError), ("capacity", "64", TypeError), ("capacity", -1, ValueError),
])
def test_loaders_check_batch_and_capacity(tmp_path, field, value, error):
    HFConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
             num_attention_heads=4).save_pretrained(tmp_path)  # config only: the check comes first
    sizes = {"batch": 1, "capacity": 8, field: value}
    with pytest.raises(error, match=field):
        load_llama(tmp_path, **sizes)
    with pytest.raises(error, match=field):
        tiny_random_pair(backend="numpy", **sizes)


# ---------------------------------------------------------------------- architectures

from graphburst.models.llama_config import CheckpointError  # noqa: E402


@pytest.mark.parametrize("change,message", [
    # Before: no model_type meant Llama, and the Mistral window was dropped silently.
    ({"model_type": None, "architectures": ["MistralForCausalLM"], "sliding_window": 16},
     "sliding_window 16 is not supported"),
    # Before: only model_type was read, so a GPT-2 file labelled llama loaded.
    ({"architectures": ["GPT2LMHeadModel"]},
     "architectures 'GPT2LMHeadModel' is not supported \\(supported: LlamaForCausalLM, MistralForCausalLM, "
     "Qwen2ForCausalLM, Qwen3ForCausalLM\\)"),
    ({"architectures": ["LlamaForCausalLM", "Qwen2ForCausalLM"]}, "architectures must be a list of one name"),
    ({"model_type": "gemma2", "architectures": None}, "model_type 'gemma2' is not supported"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True},
     "use_sliding_window True is not supported"),
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
      "layer_types": ["full_attention", "sliding_attention"]}, "layer_types entry 'sliding_attention'"),
    ({"sliding_window": 4096}, "sliding_window 4096 is not supported"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "attention_bias": True},
     "attention_bias true is not supported for model_type 'mistral'"),
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "mlp_bias": True},
     "mlp_bias true is not supported for model_type 'qwen3'"),
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": None}, "head_dim is missing"),
])
def test_architecture_and_function_changing_keys_are_checked(change, message):
    cfg = base()
    for key, value in change.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    with pytest.raises(CheckpointError, match=message):
        LlamaConfig.from_hf(cfg)


@pytest.mark.parametrize("change,family", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None}, "mistral"),
    # Released Qwen2.5 configs carry a window size with the window off.
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
      "sliding_window": 131072, "max_window_layers": 21}, "qwen2"),
    ({"model_type": "qwen3", "architectures": None, "head_dim": 16}, "qwen3"),
    ({"model_type": None, "architectures": None}, "llama"),
])
def test_supported_families_are_read(change, family):
    cfg = base()
    for key, value in change.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    assert LlamaConfig.from_hf(cfg).model_type == family


#: config.json of released checkpoints, as published (Qwen2.5-0.5B, Qwen3-0.6B, Mistral-7B-v0.3)
RELEASED = {
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
              "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
              "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
              "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
              "use_sliding_window": False, "vocab_size": 151936},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
              "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
              "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
              "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
              "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
              "use_sliding_window": False, "vocab_size": 151936},
    "mistral": {"architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
                "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
                "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
                "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
                "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0", "use_cache": True,
                "vocab_size": 32768},
}


@pytest.mark.parametrize("family", list(RELEASED))
def test_released_configs_are_read_with_their_switches(family):
    cfg = LlamaConfig.from_hf(RELEASED[family])
    assert cfg.model_type == family and cfg.rope_theta == 1e6
    assert cfg.qkv_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3") and not cfg.attention_bias
    assert cfg.head_dim == {"qwen2": 64, "qwen3": 128, "mistral": 128}[family]
    assert cfg.tie_word_embeddings == (family != "mistral")


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_a_missing_kv_head_count_is_refused_outside_llama(family):
    """transformers reads a missing num_key_value_heads as 8 (Mistral) or 32 (Qwen), not as the query
    head count a Llama config means by it: the key is required for these families."""
    cfg = {k: v for k, v in RELEASED[family].items() if k != "num_key_value_heads"}
    with pytest.raises(CheckpointError, match=f"num_key_value_heads is missing; a {family} config must give it"):
        LlamaConfig.from_hf(cfg)
    llama = {k: v for k, v in base().items() if k != "num_key_value_heads"}
    assert LlamaConfig.from_hf(llama).num_key_value_heads == llama["num_attention_heads"]
