"""Gemma <-> Hugging Face `GemmaForCausalLM`: Llama's tensor names, always tied.

Registers the `"gemma"` adapter of `ember.models.hf`. The tensors are named and laid out as in
`ember.models.llama3.hf` (the norm weights are the `weight` of `1 + weight`, as HF stores them); the
activation must be GELU with the tanh approximation (`gelu_pytorch_tanh`), and the head width is
`head_dim` of config.json. `pad_token_id` is 0 when config.json leaves it out, as in transformers'
`GemmaConfig` (released Gemma configs set 0): the pad row gets no gradient from the embedding lookup.

Example:
    >>> from ember.models import get_config
    >>> hf = gemma_config_to_hf(get_config("gemma", "2b"))
    >>> hf["model_type"], hf["head_dim"], hf["hidden_activation"]
    ('gemma', 256, 'gelu_pytorch_tanh')
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from ..hf import HFAdapter, register_hf_adapter, require_hf_value
from ..llama3.hf import llama3_params_from_hf, llama3_params_to_hf, llama_fields_from_hf, llama_fields_to_hf
from ..registry import replace_config
from .config import GemmaConfig
from .model import Gemma

__all__ = ["gemma_config_from_hf", "gemma_config_to_hf"]

_HF_DEFAULTS = {"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
                "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "max_position_embeddings": 8192,
                "pad_token_id": 0, "tie_word_embeddings": True}
"""transformers' `GemmaConfig` defaults that differ from `LlamaConfig`'s, for keys config.json leaves out."""

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")  # transformers runs Gemma's legacy "gelu" as the tanh form


def gemma_config_from_hf(hf: Mapping[str, Any], overrides: Dict[str, Any]) -> GemmaConfig:
    """The `GemmaConfig` for an HF `GemmaConfig` dict, with ember field `overrides` applied."""
    hf = {**_HF_DEFAULTS, **hf}
    for key in ("hidden_act", "hidden_activation"):  # transformers 5 reads the first, 4.x the second
        if hf.get(key) not in (None, *_GELU_TANH):
            raise ValueError(f"config.json has {key}={hf[key]!r}, but ember's Gemma needs 'gelu_pytorch_tanh' "
                             f"(GELU, tanh approximation).")
    require_hf_value(hf, "attention_bias", False, False, "Gemma (no attention biases)")
    require_hf_value(hf, "tie_word_embeddings", True, True, "Gemma (the output projection is the embedding)")
    if hf.get("use_bidirectional_attention"):  # saved as null by default
        raise ValueError(f"config.json has use_bidirectional_attention={hf['use_bidirectional_attention']!r}, but "
                         f"ember's Gemma needs causal attention (use_bidirectional_attention null or false).")
    fields = llama_fields_from_hf(hf, family="Gemma")
    fields["attn_head_dim"] = hf.get("head_dim") or fields["d_model"] // fields["n_heads"]
    return replace_config(GemmaConfig(**fields), **overrides)


def gemma_config_to_hf(c: GemmaConfig) -> Dict[str, Any]:
    """The HF `GemmaConfig` dict for `c`."""
    if c.qkv_bias or c.qk_norm or c.sliding_window is not None:
        raise ValueError("Hugging Face Gemma has no q/k/v biases, q/k norms or sliding window; set qkv_bias=False, "
                         "qk_norm=False and sliding_window=None.")
    fields = llama_fields_to_hf(c)
    del fields["hidden_act"]
    return {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", **fields,
            "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False}


register_hf_adapter(HFAdapter(
    model_type="gemma",
    architectures=("GemmaForCausalLM",),
    model_cls=Gemma,
    config_cls=GemmaConfig,
    config_from_hf=gemma_config_from_hf,
    config_to_hf=gemma_config_to_hf,
    params_from_hf=llama3_params_from_hf,
    params_to_hf=llama3_params_to_hf,
))
