"""Qwen3-MoE <-> Hugging Face `Qwen3MoeForCausalLM`: config keys and tensor names, both directions.

Registers the `"qwen3_moe"` adapter of `ember.models.hf`. The tensors are the generic MoE decoder's
(`ember.models.moe_decoder.hf`: Qwen3's attention with q/k norms, one tensor per expert on disk).
Which layers are dense is config.json's `mlp_only_layers` and `decoder_sparse_step`; ember's
`first_dense_layers` is written into `mlp_only_layers`.

Example:
    >>> from ember.models import get_config
    >>> hf = qwen3_moe_config_to_hf(get_config("qwen3_moe", "30b-a3b"))
    >>> hf["model_type"], hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]
    ('qwen3_moe', 128, 8, 768)
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from torch import Tensor

from ...core.types import Params
from ..hf import HFAdapter, register_hf_adapter, require_hf_value
from ..llama3.hf import llama_fields_from_hf, llama_fields_to_hf
from ..moe_decoder.hf import hf_expert_count, moe_params_from_hf, moe_params_to_hf
from ..registry import replace_config
from .config import Qwen3MoeConfig
from .model import Qwen3Moe

__all__ = ["check_llama_attention", "qwen3_moe_config_from_hf", "qwen3_moe_config_to_hf"]

_HF_DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                "moe_intermediate_size": 768, "num_experts_per_tok": 8, "norm_topk_prob": False,
                "decoder_sparse_step": 1, "router_aux_loss_coef": 0.001}
"""transformers' `Qwen3MoeConfig` defaults that differ from `LlamaConfig`'s, for keys config.json leaves out
(its head width is hidden_size / num_attention_heads unless `head_dim` is given; 128 experts unless named)."""

def check_llama_attention(c: Qwen3MoeConfig, family: str) -> None:
    """Refuse an attention that Hugging Face's Qwen3-MoE and dots1 do not have."""
    if c.qkv_bias or not c.qk_norm or c.sliding_window is not None:
        raise ValueError(f"Hugging Face {family} has q/k norms, and no q/k/v biases or sliding window; set "
                         f"qk_norm=True, qkv_bias=False, sliding_window=None.")


def qwen3_moe_config_from_hf(hf: Mapping[str, Any], overrides: Dict[str, Any]) -> Qwen3MoeConfig:
    """The `Qwen3MoeConfig` for an HF `Qwen3MoeConfig` dict, with ember field `overrides` applied."""
    hf = {**_HF_DEFAULTS, **hf}
    require_hf_value(hf, "hidden_act", "silu", "silu", "Qwen3-MoE (SwiGLU experts)")
    require_hf_value(hf, "attention_bias", False, False, "Qwen3-MoE (no attention biases)")
    require_hf_value(hf, "use_sliding_window", False, False, "Qwen3-MoE (full attention in every layer)")
    experts = hf_expert_count(hf, "num_local_experts", "num_experts")
    experts = 128 if experts is None else experts
    if not experts:
        raise ValueError(f"config.json has num_experts={experts!r}: every layer is dense, a dense Qwen3; ember's "
                         f"Qwen3-MoE needs num_experts >= 1 (load a dense model as model_type 'qwen3').")
    fields = llama_fields_from_hf(hf, family="Qwen3-MoE")
    fields["attn_head_dim"] = hf.get("head_dim") or fields["d_model"] // fields["n_heads"]
    fields.update(
        n_experts=experts, experts_per_token=hf["num_experts_per_tok"], moe_ffn_dim=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf["norm_topk_prob"]), decoder_sparse_step=hf["decoder_sparse_step"],
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()), router_aux_loss_coef=float(hf["router_aux_loss_coef"]),
    )
    return replace_config(Qwen3MoeConfig(**fields), **overrides)


def qwen3_moe_config_to_hf(c: Qwen3MoeConfig) -> Dict[str, Any]:
    """The HF `Qwen3MoeConfig` dict for `c` (`capacity_factor` and the z-loss are ember's training choices)."""
    _check_qwen3_moe(c)
    dense = sorted(set(range(c.first_dense_layers)) | set(c.mlp_only_layers))
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **llama_fields_to_hf(c),
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
        # both names: transformers 5 reads either into num_local_experts, 4.x reads num_experts
        "num_experts": c.n_experts, "num_local_experts": c.n_experts, "num_experts_per_tok": c.experts_per_token,
        "moe_intermediate_size": c.moe_ffn_dim, "norm_topk_prob": c.norm_topk_prob,
        "decoder_sparse_step": c.decoder_sparse_step, "mlp_only_layers": [i for i in dense if i < c.n_layers],
        "router_aux_loss_coef": c.router_aux_loss_coef,
    }


def _check_qwen3_moe(c: Qwen3MoeConfig) -> None:
    check_llama_attention(c, "Qwen3-MoE")
    if c.router != "softmax" or c.expert_bias or c.n_expert_groups != 1 or c.routed_scaling_factor != 1.0:
        raise ValueError(f"Hugging Face Qwen3-MoE routes by softmax top-k, got router={c.router!r}, expert_bias="
                         f"{c.expert_bias}, n_expert_groups={c.n_expert_groups}, routed_scaling_factor="
                         f"{c.routed_scaling_factor}; export DeepSeek-V3-style routing as the dots1 family.")
    if c.n_shared_experts:
        raise ValueError(f"Hugging Face Qwen3-MoE has no shared experts, got n_shared_experts={c.n_shared_experts}; "
                         f"export as the dots1 family, or set n_shared_experts=0.")


def _qwen3_moe_params_to_hf(params: Params, c: Qwen3MoeConfig) -> Dict[str, Tensor]:
    _check_qwen3_moe(c)
    return moe_params_to_hf(params, c)


register_hf_adapter(HFAdapter(
    model_type="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_cls=Qwen3Moe,
    config_cls=Qwen3MoeConfig,
    config_from_hf=qwen3_moe_config_from_hf,
    config_to_hf=qwen3_moe_config_to_hf,
    params_from_hf=moe_params_from_hf,
    params_to_hf=_qwen3_moe_params_to_hf,
))
