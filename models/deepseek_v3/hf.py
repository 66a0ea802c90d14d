"""DeepSeek-V3 <-> Hugging Face `DeepseekV3ForCausalLM`: config keys and tensor names, both directions.

Registers the `"deepseek_v3"` adapter of `ember.models.hf`. The mixture is named as in
`ember.models.dots1.hf` (DeepSeek's router, correction bias and shared experts;
`deepseek_moe_params_from_hf` / `_to_hf` serve both), the attention of block i as:

    attn.wq_a / q_norm / wq_b   <- model.layers.i.self_attn.q_a_proj / q_a_layernorm / q_b_proj
    attn.wq                     <- model.layers.i.self_attn.q_proj                  (q_lora_rank null)
    attn.wkv_a / kv_norm / wkv_b <- model.layers.i.self_attn.kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj
    attn.wo                     <- model.layers.i.self_attn.o_proj

DeepSeek's files interleave the rotary dimensions (`rope_interleave`, true in the released ones):
those rows of the query and shared-key projections are permuted into the rotate-half pairing on
import and back on export (the config's `rope_interleave` keeps the file's layout). The multi-token-prediction layers
(`model.layers.{n_layers}...`, `num_nextn_predict_layers`) are skipped, as transformers skips them.
Attention biases and activations other than SwiGLU are refused.

Example:
    >>> from ember.models import get_config
    >>> hf = deepseek_v3_config_to_hf(get_config("deepseek_v3", "671b-a37b"))
    >>> hf["model_type"], hf["kv_lora_rank"], hf["rope_scaling"]["rope_type"], hf["first_k_dense_replace"]
    ('deepseek_v3', 512, 'yarn', 3)
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Mapping, Optional

import torch
from torch import Tensor

from ...core.types import Params
from ..hf import HFAdapter, register_hf_adapter, require_hf_value
from ..llama3.hf import llama_fields_from_hf, llama_fields_to_hf
from ..moe_decoder.hf import Names, hf_expert_count, moe_params_from_hf, moe_params_to_hf
from ..registry import replace_config
from .config import DeepseekV3Config
from .model import DeepseekV3

__all__ = ["deepseek_moe_params_from_hf", "deepseek_moe_params_to_hf", "deepseek_v3_config_from_hf",
           "deepseek_v3_config_to_hf"]

_HF_DEFAULTS = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
                "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6, "rope_interleave": True}
"""transformers' `DeepseekV3Config` defaults that differ from `LlamaConfig`'s, for keys config.json leaves out."""


def deepseek_v3_config_from_hf(hf: Mapping[str, Any], overrides: Dict[str, Any]) -> DeepseekV3Config:
    """The `DeepseekV3Config` for an HF `DeepseekV3Config` dict, with ember field `overrides` applied."""
    hf = {**_HF_DEFAULTS, **hf}
    require_hf_value(hf, "hidden_act", "silu", "silu", "DeepSeek-V3 (SwiGLU experts)")
    require_hf_value(hf, "attention_bias", False, False, "DeepSeek-V3 (no attention biases)")
    fields = llama_fields_from_hf(hf, family="DeepSeek-V3")
    heads = fields["n_heads"]
    if fields["n_kv_heads"] != heads:
        raise ValueError(f"config.json has num_key_value_heads={fields['n_kv_heads']} and num_attention_heads={heads}; "
                         f"latent attention expands a key and value per head: set num_key_value_heads={heads}.")
    experts = hf_expert_count(hf, "n_routed_experts", "num_local_experts")
    fields.update(
        attn_head_dim=None, n_experts=experts, experts_per_token=hf["num_experts_per_tok"],
        moe_ffn_dim=hf["moe_intermediate_size"], n_shared_experts=hf["n_shared_experts"] or 0,
        n_expert_groups=hf["n_group"] or 1, topk_groups=hf["topk_group"] or 1,
        routed_scaling_factor=float(hf["routed_scaling_factor"]), norm_topk_prob=bool(hf["norm_topk_prob"]),
        first_dense_layers=hf["first_k_dense_replace"] or 0, router="sigmoid", expert_bias=True,
        router_aux_loss_coef=0.0,  # transformers' DeepSeek-V3 has no auxiliary loss
        q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        rope_interleave=bool(hf["rope_interleave"]),
    )
    return replace_config(DeepseekV3Config(**fields), **overrides)


def _check(c: DeepseekV3Config) -> None:
    if c.router != "sigmoid" or c.decoder_sparse_step != 1 or any(i >= c.first_dense_layers for i in c.mlp_only_layers):
        raise ValueError(f"Hugging Face DeepSeek-V3 routes by sigmoid scores and makes only the first "
                         f"first_k_dense_replace layers dense, got router={c.router!r}, decoder_sparse_step="
                         f"{c.decoder_sparse_step}, mlp_only_layers={c.mlp_only_layers}; set router='sigmoid', "
                         f"decoder_sparse_step=1, mlp_only_layers=().")


def deepseek_v3_config_to_hf(c: DeepseekV3Config) -> Dict[str, Any]:
    """The HF `DeepseekV3Config` dict for `c` (`capacity_factor`, `dropless`, the router losses and the bias update
    rate are ember's training choices)."""
    _check(c)
    out = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **llama_fields_to_hf(c)}
    out.update(
        attention_bias=False, rope_interleave=c.rope_interleave, n_routed_experts=c.n_experts,
        num_experts_per_tok=c.experts_per_token, moe_intermediate_size=c.moe_ffn_dim,
        n_shared_experts=c.n_shared_experts, n_group=c.n_expert_groups, topk_group=c.topk_groups,
        routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=c.norm_topk_prob,
        first_k_dense_replace=c.first_dense_layers, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
        num_nextn_predict_layers=0,
    )
    return out


def _attention_names(c: DeepseekV3Config) -> Names:
    q = [("attn.wq.weight", "self_attn.q_proj.weight")] if c.q_lora_rank is None else [
        ("attn.wq_a.weight", "self_attn.q_a_proj.weight"), ("attn.q_norm.weight", "self_attn.q_a_layernorm.weight"),
        ("attn.wq_b.weight", "self_attn.q_b_proj.weight")]
    return [("ln_1.weight", "input_layernorm.weight"), *q,
            ("attn.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"),
            ("attn.kv_norm.weight", "self_attn.kv_a_layernorm.weight"),
            ("attn.wkv_b.weight", "self_attn.kv_b_proj.weight"), ("attn.wo.weight", "self_attn.o_proj.weight"),
            ("ln_2.weight", "post_attention_layernorm.weight")]


def _rope_rows(state: Mapping[str, Tensor], c: DeepseekV3Config, *, interleaved_to_halves: bool) -> Dict[str, Tensor]:
    """`state` with the rotary rows of the query and shared-key projections re-paired (interleaved <-> halves)."""
    r = c.qk_rope_head_dim
    halves = torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))  # halves[j]: the interleaved row of row j
    order = halves if interleaved_to_halves else torch.argsort(halves)
    out = dict(state)
    for name, t in state.items():
        if re.search(r"self_attn\.(q_proj|q_b_proj)\.weight$", name):
            per_head = t.view(c.n_heads, c.qk_head_dim, -1)
            rows = per_head[:, c.qk_nope_head_dim:][:, order.to(t.device)]
            out[name] = torch.cat((per_head[:, :c.qk_nope_head_dim], rows), dim=1).reshape(t.shape)
        elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            out[name] = torch.cat((t[:c.kv_lora_rank], t[c.kv_lora_rank:][order.to(t.device)]))
    return out


def deepseek_moe_params_from_hf(state: Mapping[str, Tensor], c, *, ignore: Optional[Callable[[str], bool]] = None,
                                **kwargs: Any) -> Params:
    """ember params from a state dict of DeepSeek's mixture (DeepSeek-V3, dots1): transformers builds the
    shared experts always, zero-width when there are none, which are dropped, as is what `ignore` accepts
    (`kwargs`: `moe_params_from_hf`'s)."""
    return moe_params_from_hf(state, c, ignore=lambda k: (".mlp.shared_experts." in k and state[k].numel() == 0)
                              or (ignore is not None and ignore(k)), **kwargs)


def deepseek_moe_params_to_hf(params: Params, c, **kwargs: Any) -> Dict[str, Tensor]:
    """The HF state dict of DeepSeek's mixture, with the zero bias and zero-width shared experts transformers
    expects where the config has none."""
    out = moe_params_to_hf(params, c, **kwargs)
    E, I, d = c.n_experts, c.moe_ffn_dim * c.n_shared_experts, c.d_model
    like = params["wte"]["weight"]
    for i in range(c.n_layers):
        h = f"model.layers.{i}.mlp."
        if not c.is_moe_layer(i):
            continue
        if not c.expert_bias:
            out[h + "gate.e_score_correction_bias"] = torch.zeros(E, dtype=torch.float32, device=like.device)
        if not c.n_shared_experts:
            for n, shape in (("gate_proj", (I, d)), ("up_proj", (I, d)), ("down_proj", (d, I))):
                out[f"{h}shared_experts.{n}.weight"] = like.new_zeros(shape)
    return out


def deepseek_v3_params_from_hf(state: Mapping[str, Tensor], c: DeepseekV3Config) -> Params:
    """ember params (blocks as a list) from an HF DeepSeek-V3 state dict (interleaved rotary rows re-paired)."""
    prediction_layer = re.compile(r"model\.layers\.(\d+)\.")

    def beyond_the_model(name: str) -> bool:  # the multi-token-prediction layers
        m = prediction_layer.match(name)
        return m is not None and int(m.group(1)) >= c.n_layers

    if c.rope_interleave:
        state = _rope_rows(state, c, interleaved_to_halves=True)
    return deepseek_moe_params_from_hf(state, c, ignore=beyond_the_model, model_cls=DeepseekV3,
                                       attention=_attention_names(c))


def deepseek_v3_params_to_hf(params: Params, c: DeepseekV3Config) -> Dict[str, Tensor]:
    """The HF DeepSeek-V3 state dict (one tensor per expert, rotary rows interleaved as `rope_interleave` says)."""
    _check(c)
    out = deepseek_moe_params_to_hf(params, c, attention=_attention_names(c))
    return _rope_rows(out, c, interleaved_to_halves=False) if c.rope_interleave else out


register_hf_adapter(HFAdapter(
    model_type="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    model_cls=DeepseekV3,
    config_cls=DeepseekV3Config,
    config_from_hf=deepseek_v3_config_from_hf,
    config_to_hf=deepseek_v3_config_to_hf,
    params_from_hf=deepseek_v3_params_from_hf,
    params_to_hf=deepseek_v3_params_to_hf,
))
