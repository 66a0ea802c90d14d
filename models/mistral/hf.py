"""Mistral <-> Hugging Face `MistralForCausalLM`: Llama's tensor names, plus the sliding window.

Registers the `"mistral"` adapter of `ember.models.hf`. The tensors are named and laid out as in
`ember.models.llama3.hf`; the config adds `sliding_window` (null in v0.2 and later; 4096, transformers'
default, when config.json leaves it out).

Example:
    >>> from ember.models import get_config
    >>> hf = mistral_config_to_hf(get_config("mistral", "7b-v0.1"))
    >>> hf["model_type"], hf["sliding_window"], hf["vocab_size"]
    ('mistral', 4096, 32000)
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from ..hf import HFAdapter, register_hf_adapter, require_hf_value
from ..llama3.hf import llama3_params_from_hf, llama3_params_to_hf, llama_fields_from_hf, llama_fields_to_hf
from ..registry import replace_config
from .config import MistralConfig
from .model import Mistral

__all__ = ["mistral_config_from_hf", "mistral_config_to_hf"]

_HF_DEFAULTS = {"intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "sliding_window": 4096}
"""transformers' `MistralConfig` defaults that differ from `LlamaConfig`'s, for keys config.json leaves out."""


def mistral_config_from_hf(hf: Mapping[str, Any], overrides: Dict[str, Any]) -> MistralConfig:
    """The `MistralConfig` for an HF `MistralConfig` dict, with ember field `overrides` applied."""
    hf = {**_HF_DEFAULTS, **hf}
    require_hf_value(hf, "hidden_act", "silu", "silu", "Mistral (SwiGLU)")
    fields = llama_fields_from_hf(hf, family="Mistral")
    return replace_config(MistralConfig(**fields, sliding_window=hf["sliding_window"]), **overrides)


def mistral_config_to_hf(c: MistralConfig) -> Dict[str, Any]:
    """The HF `MistralConfig` dict for `c`."""
    if c.qkv_bias or c.qk_norm:
        raise ValueError("Hugging Face Mistral has no attention biases or q/k norms; set qkv_bias=False and "
                         "qk_norm=False, or export as qwen2 / qwen3.")
    return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **llama_fields_to_hf(c),
            "sliding_window": c.sliding_window}


register_hf_adapter(HFAdapter(
    model_type="mistral",
    architectures=("MistralForCausalLM",),
    model_cls=Mistral,
    config_cls=MistralConfig,
    config_from_hf=mistral_config_from_hf,
    config_to_hf=mistral_config_to_hf,
    params_from_hf=llama3_params_from_hf,
    params_to_hf=llama3_params_to_hf,
))
