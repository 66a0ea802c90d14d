"""Qwen2 <-> Hugging Face `Qwen2ForCausalLM`: Llama's tensor names plus the q, k, v biases.

Registers the `"qwen2"` adapter of `ember.models.hf` (Qwen2 and Qwen2.5 folders). The tensors are
named as in `ember.models.llama3.hf`, with `model.layers.{i}.self_attn.{q,k,v}_proj.bias` added.
Qwen2's sliding window (`use_sliding_window`, off in every released Qwen2 / Qwen2.5) is not
implemented: a folder that turns it on is refused.

Example:
    >>> from ember.models import get_config
    >>> hf = qwen2_config_to_hf(get_config("qwen2", "tiny"))
    >>> hf["model_type"], hf["use_sliding_window"], hf["tie_word_embeddings"]
    ('qwen2', False, True)
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from ..hf import HFAdapter, register_hf_adapter, require_hf_value
from ..llama3.hf import (llama3_params_from_hf, llama3_params_to_hf, llama_fields_from_hf, llama_fields_to_hf,
                         require_full_attention)
from ..registry import replace_config
from .config import Qwen2Config
from .model import Qwen2

__all__ = ["qwen2_config_from_hf", "qwen2_config_to_hf"]

_HF_DEFAULTS = {"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768}
"""transformers' `Qwen2Config` defaults that differ from `LlamaConfig`'s, for keys config.json leaves out."""


def qwen2_config_from_hf(hf: Mapping[str, Any], overrides: Dict[str, Any]) -> Qwen2Config:
    """The `Qwen2Config` for an HF `Qwen2Config` dict, with ember field `overrides` applied."""
    hf = {**_HF_DEFAULTS, **hf}
    require_hf_value(hf, "hidden_act", "silu", "silu", "Qwen2 (SwiGLU)")
    require_hf_value(hf, "use_sliding_window", False, False, "Qwen2 (full attention in every layer)")
    require_full_attention(hf, "Qwen2")
    return replace_config(Qwen2Config(**llama_fields_from_hf(hf, family="Qwen2")), **overrides)


def qwen2_config_to_hf(c: Qwen2Config) -> Dict[str, Any]:
    """The HF `Qwen2Config` dict for `c`."""
    if not c.qkv_bias or c.sliding_window is not None or c.qk_norm:
        raise ValueError(
            "Hugging Face Qwen2 always has q/k/v biases, and no sliding window or q/k norms here; set "
            "qkv_bias=True, sliding_window=None, qk_norm=False, or export as the llama, mistral or qwen3 family."
        )
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **llama_fields_to_hf(c),
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": c.n_layers,
    }


register_hf_adapter(HFAdapter(
    model_type="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_cls=Qwen2,
    config_cls=Qwen2Config,
    config_from_hf=qwen2_config_from_hf,
    config_to_hf=qwen2_config_to_hf,
    params_from_hf=llama3_params_from_hf,
    params_to_hf=llama3_params_to_hf,
))
