"""Mixtral <-> Hugging Face `MixtralForCausalLM`: config keys and tensor names, both directions.

Registers the `"mixtral"` adapter of `ember.models.hf`. Attention, norms and embeddings are named as
in `ember.models.llama3.hf`; the mixture of block i as in `ember.models.moe_decoder.hf`, under Mixtral's
file names:

    mlp.router.weight (E, d)    <- model.layers.i.block_sparse_moe.gate.weight
    mlp.gate[j] (I, d)          <- model.layers.i.block_sparse_moe.experts.j.w1.weight
    mlp.up[j] (I, d)            <- model.layers.i.block_sparse_moe.experts.j.w3.weight
    mlp.down[j] (d, I)          <- model.layers.i.block_sparse_moe.experts.j.w2.weight

transformers 5 renames `block_sparse_moe` to `mlp` and fuses the experts in memory (`mlp.gate.weight`,
`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`): those names are read too. `intermediate_size`
is the experts' width; every layer is a mixture.

Example:
    >>> from ember.models import get_config
    >>> hf = mixtral_config_to_hf(get_config("mixtral", "8x7b"))
    >>> hf["model_type"], hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"]
    ('mixtral', 8, 2, 14336)
"""

from __future__ import annotations

import re
from typing import Any, Dict, Mapping

from torch import Tensor

from ...core.types import Params
from ..hf import HFAdapter, register_hf_adapter, require_hf_value
from ..llama3.hf import llama_fields_from_hf, llama_fields_to_hf
from ..moe_decoder.hf import hf_expert_count, moe_params_from_hf, moe_params_to_hf
from ..registry import replace_config
from .config import MixtralConfig
from .model import Mixtral

__all__ = ["mixtral_config_from_hf", "mixtral_config_to_hf"]

_HF_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "num_experts_per_tok": 2,
                "router_aux_loss_coef": 0.001, "sliding_window": None}
"""transformers' `MixtralConfig` defaults that differ from `LlamaConfig`'s, for keys config.json leaves out
(8 experts unless named)."""

_FILE_TO_FUSED = ((r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
                  (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
                  (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
                  (r"\.block_sparse_moe\.", r".mlp."))
_FUSED_TO_FILE = ((r"\.mlp\.experts\.(\d+)\.gate_proj\.", r".block_sparse_moe.experts.\1.w1."),
                  (r"\.mlp\.experts\.(\d+)\.up_proj\.", r".block_sparse_moe.experts.\1.w3."),
                  (r"\.mlp\.experts\.(\d+)\.down_proj\.", r".block_sparse_moe.experts.\1.w2."),
                  (r"\.mlp\.gate\.", r".block_sparse_moe.gate."))


def _renamed(name: str, table) -> str:
    for pattern, replacement in table:
        name = re.sub(pattern, replacement, name)
    return name


def mixtral_config_from_hf(hf: Mapping[str, Any], overrides: Dict[str, Any]) -> MixtralConfig:
    """The `MixtralConfig` for an HF `MixtralConfig` dict, with ember field `overrides` applied."""
    hf = {**_HF_DEFAULTS, **hf}
    require_hf_value(hf, "hidden_act", "silu", "silu", "Mixtral (SwiGLU experts)")
    require_hf_value(hf, "router_jitter_noise", 0.0, 0.0, "Mixtral (a deterministic router, no jitter noise)")
    experts = hf_expert_count(hf, "num_local_experts")
    fields = llama_fields_from_hf(hf, family="Mixtral")
    fields.update(n_experts=8 if experts is None else experts, experts_per_token=hf["num_experts_per_tok"],
                  moe_ffn_dim=hf["intermediate_size"], sliding_window=hf["sliding_window"],
                  router_aux_loss_coef=float(hf["router_aux_loss_coef"]))
    return replace_config(MixtralConfig(**fields), **overrides)


def mixtral_config_to_hf(c: MixtralConfig) -> Dict[str, Any]:
    """The HF `MixtralConfig` dict for `c` (`capacity_factor`, `dropless` and the z-loss are ember's training
    choices)."""
    every_layer = all(c.is_moe_layer(i) for i in range(c.n_layers))
    if c.qkv_bias or c.qk_norm or not every_layer or c.n_shared_experts:
        raise ValueError("Hugging Face Mixtral has no attention biases, q/k norms, dense layers or shared experts; "
                         "set qkv_bias=False, qk_norm=False, first_dense_layers=0, decoder_sparse_step=1, "
                         "mlp_only_layers=(), n_shared_experts=0, or export as qwen3_moe / dots1.")
    if c.router != "softmax" or not c.norm_topk_prob or c.expert_bias or c.n_expert_groups != 1 \
            or c.routed_scaling_factor != 1.0:
        raise ValueError(f"Hugging Face Mixtral routes by softmax top-k renormalised, got router={c.router!r}, "
                         f"norm_topk_prob={c.norm_topk_prob}, expert_bias={c.expert_bias}, n_expert_groups="
                         f"{c.n_expert_groups}, routed_scaling_factor={c.routed_scaling_factor}; export "
                         f"DeepSeek-V3-style routing as the dots1 family.")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **llama_fields_to_hf(c),
            "intermediate_size": c.moe_ffn_dim, "sliding_window": c.sliding_window,
            "num_local_experts": c.n_experts, "num_experts_per_tok": c.experts_per_token,
            "router_aux_loss_coef": c.router_aux_loss_coef, "router_jitter_noise": 0.0}


def mixtral_params_from_hf(state: Mapping[str, Tensor], c: MixtralConfig) -> Params:
    """ember params from an HF Mixtral state dict (file or in-memory names); shapes checked."""
    return moe_params_from_hf({_renamed(k, _FILE_TO_FUSED): v for k, v in state.items()}, c)


def mixtral_params_to_hf(params: Params, c: MixtralConfig) -> Dict[str, Tensor]:
    """The HF state dict under Mixtral's file names (one tensor per expert)."""
    mixtral_config_to_hf(c)
    return {_renamed(k, _FUSED_TO_FILE): v for k, v in moe_params_to_hf(params, c).items()}


register_hf_adapter(HFAdapter(
    model_type="mixtral",
    architectures=("MixtralForCausalLM",),
    model_cls=Mixtral,
    config_cls=MixtralConfig,
    config_from_hf=mixtral_config_from_hf,
    config_to_hf=mixtral_config_to_hf,
    params_from_hf=mixtral_params_from_hf,
    params_to_hf=mixtral_params_to_hf,
))
