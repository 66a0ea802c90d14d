"""dots1 <-> Hugging Face `Dots1ForCausalLM`: config keys and tensor names, both directions.

Registers the `"dots1"` adapter of `ember.models.hf`. The tensors are named as in
`ember.models.moe_decoder.hf` (one tensor per expert on disk), with the router's correction bias
`model.layers.{i}.mlp.gate.e_score_correction_bias` as `router.expert_bias` (transformers keeps it
as a buffer: its optimizer never moves it) and the shared experts `mlp.shared_experts.*_proj` as
`mlp.shared.*`. transformers always builds both: a config without shared experts or without a
bias is written with zero-width shared experts and a zero bias, which compute the same.

config.json keys: `n_routed_experts` (or `num_local_experts`), `num_experts_per_tok`,
`moe_intermediate_size`, `n_shared_experts`, `n_group` / `topk_group` (null reads as 1),
`routed_scaling_factor`, `norm_topk_prob`, `first_k_dense_replace`, plus Qwen3's attention keys.
Sliding-window layers (`layer_types`, or `sliding_window` with `max_window_layers` below the layer
count) are refused, as are biases and activations other than SwiGLU.

Example:
    >>> from ember.models import get_config
    >>> hf = dots1_config_to_hf(get_config("dots1", "142b-a14b"))
    >>> hf["model_type"], hf["n_routed_experts"], hf["n_shared_experts"], hf["first_k_dense_replace"]
    ('dots1', 128, 2, 1)
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

from torch import Tensor

from ...core.types import Params
from ..deepseek_v3.hf import deepseek_moe_params_from_hf, deepseek_moe_params_to_hf
from ..hf import HFAdapter, register_hf_adapter, require_hf_value
from ..llama3.hf import llama_fields_from_hf, llama_fields_to_hf, require_full_attention
from ..moe_decoder.hf import hf_expert_count
from ..qwen3_moe.hf import check_llama_attention
from ..registry import replace_config
from .config import Dots1Config
from .model import Dots1

__all__ = ["dots1_config_from_hf", "dots1_config_to_hf", "dots1_params_from_hf", "dots1_params_to_hf"]

_HF_DEFAULTS = {"vocab_size": 152064, "hidden_size": 4608, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                "num_hidden_layers": 62, "num_attention_heads": 32, "max_position_embeddings": 2048,
                "norm_topk_prob": False, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0,
                "sliding_window": 4096, "max_window_layers": 62}
"""transformers' `Dots1Config` defaults that differ from `LlamaConfig`'s, for keys config.json leaves out
(the head width is hidden_size / num_attention_heads unless `head_dim` is given)."""


def _layer_types(hf: Mapping[str, Any]) -> List[str]:
    """config.json's `layer_types`, or what transformers' Dots1Config derives without it."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    window, full = hf.get("sliding_window"), hf.get("max_window_layers")
    return ["sliding_attention" if window is not None and full is not None and i >= full else "full_attention"
            for i in range(hf["num_hidden_layers"])]


def _required(hf: Mapping[str, Any], key: str, value: Any) -> Any:
    if value is None:
        raise ValueError(f"config.json has no {key} (or null); transformers' Dots1 cannot build the model without "
                         f"it either: set it to the checkpoint's value.")
    return value


def dots1_config_from_hf(hf: Mapping[str, Any], overrides: Dict[str, Any]) -> Dots1Config:
    """The `Dots1Config` for an HF `Dots1Config` dict, with ember field `overrides` applied."""
    hf = {**_HF_DEFAULTS, **hf}
    require_hf_value(hf, "hidden_act", "silu", "silu", "dots1 (SwiGLU experts)")
    require_hf_value(hf, "attention_bias", False, False, "dots1 (no attention biases)")
    require_full_attention({"layer_types": _layer_types(hf)}, "dots1")
    fields = llama_fields_from_hf(hf, family="dots1")
    fields["attn_head_dim"] = hf.get("head_dim") or fields["d_model"] // fields["n_heads"]
    fields.update(
        n_experts=_required(hf, "n_routed_experts", hf_expert_count(hf, "n_routed_experts", "num_local_experts")),
        experts_per_token=_required(hf, "num_experts_per_tok", hf.get("num_experts_per_tok")),
        moe_ffn_dim=hf["moe_intermediate_size"],
        n_shared_experts=_required(hf, "n_shared_experts", hf.get("n_shared_experts")),
        n_expert_groups=hf.get("n_group") or 1, topk_groups=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf["routed_scaling_factor"]), norm_topk_prob=bool(hf["norm_topk_prob"]),
        first_dense_layers=hf["first_k_dense_replace"] or 0,
        router="sigmoid", expert_bias=True, router_aux_loss_coef=0.0,  # transformers' Dots1 has no auxiliary loss
    )
    return replace_config(Dots1Config(**fields), **overrides)


def _check_dots1(c: Dots1Config) -> None:
    check_llama_attention(c, "dots1")
    if c.router != "sigmoid":
        raise ValueError(f"Hugging Face dots1 routes by sigmoid scores (DeepSeek-V3), got router={c.router!r}; set "
                         f"router='sigmoid', or export softmax routing as the qwen3_moe family.")
    extra_dense = sorted(i for i in c.mlp_only_layers if i >= c.first_dense_layers)
    if c.decoder_sparse_step != 1 or extra_dense:
        raise ValueError(f"Hugging Face dots1 makes only the first first_k_dense_replace layers dense, got "
                         f"decoder_sparse_step={c.decoder_sparse_step} and mlp_only_layers beyond them {extra_dense}; "
                         f"set decoder_sparse_step=1 and mlp_only_layers=(), or export as the qwen3_moe family.")


def dots1_config_to_hf(c: Dots1Config) -> Dict[str, Any]:
    """The HF `Dots1Config` dict for `c` (`capacity_factor`, the router losses and the bias update rate are
    ember's training choices)."""
    _check_dots1(c)
    return {
        "architectures": ["Dots1ForCausalLM"], "model_type": "dots1", **llama_fields_to_hf(c),
        "attention_bias": False, "sliding_window": None, "max_window_layers": c.n_layers,
        "layer_types": ["full_attention"] * c.n_layers,
        "n_routed_experts": c.n_experts, "num_experts_per_tok": c.experts_per_token,
        "moe_intermediate_size": c.moe_ffn_dim, "n_shared_experts": c.n_shared_experts,
        "n_group": c.n_expert_groups, "topk_group": c.topk_groups, "routed_scaling_factor": c.routed_scaling_factor,
        "norm_topk_prob": c.norm_topk_prob, "first_k_dense_replace": c.first_dense_layers,
    }


def dots1_params_from_hf(state: Mapping[str, Tensor], c: Dots1Config) -> Params:
    """ember params (blocks as a list) from an HF dots1 state dict; zero-width shared experts are dropped."""
    return deepseek_moe_params_from_hf(state, c)


def dots1_params_to_hf(params: Params, c: Dots1Config) -> Dict[str, Tensor]:
    """The HF dots1 state dict for ember params, with the zero bias / zero-width shared experts transformers expects."""
    _check_dots1(c)
    return deepseek_moe_params_to_hf(params, c)


register_hf_adapter(HFAdapter(
    model_type="dots1",
    architectures=("Dots1ForCausalLM",),
    model_cls=Dots1,
    config_cls=Dots1Config,
    config_from_hf=dots1_config_from_hf,
    config_to_hf=dots1_config_to_hf,
    params_from_hf=dots1_params_from_hf,
    params_to_hf=dots1_params_to_hf,
))
