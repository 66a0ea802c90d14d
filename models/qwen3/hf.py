"""Qwen3 <-> Hugging Face `Qwen3ForCausalLM`: Llama's tensor names plus the q/k norms.

Registers the `"qwen3"` adapter of `ember.models.hf`. The tensors are named as in
`ember.models.llama3.hf`, with `model.layers.{i}.self_attn.{q_norm,k_norm}.weight` added; the head
width is `head_dim` of config.json. Qwen3's sliding window (`use_sliding_window`, off in the
released dense models) is not implemented: a folder that turns it on is refused.

Example:
    >>> from ember.models import get_config
    >>> hf = qwen3_config_to_hf(get_config("qwen3", "0.6b"))
    >>> hf["model_type"], hf["head_dim"], hf["hidden_size"] // hf["num_attention_heads"]
    ('qwen3', 128, 64)
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from ..hf import HFAdapter, register_hf_adapter, require_hf_value
from ..llama3.hf import (llama3_params_from_hf, llama3_params_to_hf, llama_fields_from_hf, llama_fields_to_hf,
                         require_full_attention)
from ..registry import replace_config
from .config import Qwen3Config
from .model import Qwen3

__all__ = ["qwen3_config_from_hf", "qwen3_config_to_hf"]

_HF_DEFAULTS = {"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768, "head_dim": 128}
"""transformers' `Qwen3Config` defaults that differ from `LlamaConfig`'s, for keys config.json leaves out."""


def qwen3_config_from_hf(hf: Mapping[str, Any], overrides: Dict[str, Any]) -> Qwen3Config:
    """The `Qwen3Config` for an HF `Qwen3Config` dict, with ember field `overrides` applied."""
    hf = {**_HF_DEFAULTS, **hf}
    require_hf_value(hf, "hidden_act", "silu", "silu", "Qwen3 (SwiGLU)")
    require_hf_value(hf, "attention_bias", False, False, "Qwen3 (no attention biases)")
    require_hf_value(hf, "use_sliding_window", False, False, "Qwen3 (full attention in every layer)")
    require_full_attention(hf, "Qwen3")
    fields = llama_fields_from_hf(hf, family="Qwen3")
    fields["attn_head_dim"] = hf.get("head_dim") or fields["d_model"] // fields["n_heads"]
    return replace_config(Qwen3Config(**fields), **overrides)


def qwen3_config_to_hf(c: Qwen3Config) -> Dict[str, Any]:
    """The HF `Qwen3Config` dict for `c`."""
    if c.qkv_bias or not c.qk_norm or c.sliding_window is not None:
        raise ValueError("Hugging Face Qwen3 has q/k norms, and no q/k/v biases or sliding window here; set "
                         "qk_norm=True, qkv_bias=False, sliding_window=None, or export as another family.")
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **llama_fields_to_hf(c),
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": c.n_layers}


register_hf_adapter(HFAdapter(
    model_type="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_cls=Qwen3,
    config_cls=Qwen3Config,
    config_from_hf=qwen3_config_from_hf,
    config_to_hf=qwen3_config_to_hf,
    params_from_hf=llama3_params_from_hf,
    params_to_hf=llama3_params_to_hf,
))
