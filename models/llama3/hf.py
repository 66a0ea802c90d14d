"""Llama-3 <-> Hugging Face `LlamaForCausalLM`: config keys and tensor names, both directions.

Registers the `"llama"` adapter of `ember.models.hf` (`from_hf`, `to_hf` dispatch to it). The
layout is HF's own, so there are no transposes and no q/k permutation, only renames:

    wte.weight                      <- model.embed_tokens.weight
    blocks.i.ln_1 / ln_2            <- model.layers.i.input_layernorm / post_attention_layernorm
    blocks.i.attn.{wq,wk,wv,wo}     <- model.layers.i.self_attn.{q,k,v,o}_proj
    blocks.i.mlp.{gate,up,down}     <- model.layers.i.mlp.{gate,up,down}_proj
    ln_f.weight                     <- model.norm.weight
    lm_head.weight                  <- lm_head.weight (absent when tie_word_embeddings)

The config reads transformers 5.x `rope_parameters` and 4.x `rope_theta` / `rope_scaling`, and
writes the keys both read. `pad_token_id` becomes `Llama3Config.pad_token_id` (transformers makes it the
embedding's `padding_idx`: that row gets no gradient from the lookup) and is written back. Settings
transformers honours and ember does not (biases, another activation or RoPE type, attention dropout) are
refused with the key and its value.

Example:
    >>> from ember.models import get_config
    >>> hf = llama3_config_to_hf(get_config("llama3", "tiny"))
    >>> hf["model_type"], hf["num_key_value_heads"], hf["tie_word_embeddings"]
    ('llama', 2, True)
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from torch import Tensor

from ...core import pytree
from ...core.types import Params
from ..hf import HFAdapter, StateReader, check_tied_head, register_hf_adapter, require_hf_value
from ..layers import RopeScaling, YarnScaling
from ..registry import replace_config
from .config import Llama3Config
from .model import Llama3

__all__ = [
    "llama3_config_from_hf", "llama3_config_to_hf", "llama3_params_from_hf", "llama3_params_to_hf",
    "llama_fields_from_hf", "llama_fields_to_hf", "require_full_attention",
]

_LAYER_NAMES = (  # (ember path inside a block, HF name inside model.layers.{i})
    ("ln_1", "input_layernorm"),
    ("attn.wq", "self_attn.q_proj"),
    ("attn.wk", "self_attn.k_proj"),
    ("attn.wv", "self_attn.v_proj"),
    ("attn.wo", "self_attn.o_proj"),
    ("ln_2", "post_attention_layernorm"),
    ("mlp.gate", "mlp.gate_proj"),
    ("mlp.up", "mlp.up_proj"),
    ("mlp.down", "mlp.down_proj"),
)


def _rope_from_hf(hf: Mapping[str, Any]) -> Tuple[float, Optional[Union[RopeScaling, YarnScaling]]]:
    """(theta, scaling) from transformers 5.x `rope_parameters` or 4.x `rope_theta` / `rope_scaling`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind == "yarn":
        return float(theta), _yarn_from_hf(params, hf)
    if kind != "llama3":
        raise ValueError(
            f"config.json rope type {kind!r} is not supported; ember's Llama-layout families support 'default', "
            f"'llama3' (Llama-3.1 frequency scaling) and 'yarn'."
        )
    scaling = RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_seq_len=int(params.get("original_max_position_embeddings", 8192)),
    )
    return float(theta), scaling


def _yarn_from_hf(params: Mapping[str, Any], hf: Mapping[str, Any]) -> YarnScaling:
    if params.get("attention_factor") is not None:
        raise ValueError(f"config.json's yarn rope sets attention_factor={params['attention_factor']}; ember derives "
                         f"it from factor, mscale and mscale_all_dim as transformers does by default: remove it.")
    longest = hf.get("max_position_embeddings", 2048)
    original = int(params.get("original_max_position_embeddings") or longest)  # transformers' fallback too
    factor = params.get("factor") or longest / original
    return YarnScaling(factor=float(factor), original_max_seq_len=original,
                       beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                       mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
                       truncate=bool(params.get("truncate", True)))


def _rope_to_hf(c: Llama3Config) -> Optional[Dict[str, Any]]:
    s = c.rope_scaling
    if s is None:
        return None
    if isinstance(s, YarnScaling):
        out = {"rope_type": "yarn", "factor": s.factor, "original_max_position_embeddings": s.original_max_seq_len,
               "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "mscale": s.mscale, "mscale_all_dim": s.mscale_all_dim}
        return out if s.truncate else {**out, "truncate": False}
    return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_seq_len}


def llama_fields_from_hf(hf: Mapping[str, Any], *, family: str = "Llama3") -> Dict[str, Any]:
    """The `Llama3Config` fields that every Llama-layout family (Llama, Qwen2/3, Mistral, Gemma) reads alike.

    A key config.json leaves out reads as transformers' `LlamaConfig` default; other families pass
    `{**their_defaults, **hf}`. Refuses attention dropout (transformers applies it in training;
    ember's `family` has none). `partial_rotary_factor` is ignored, as these transformers models
    ignore it with default RoPE (and fail with Llama-3.1 scaling).
    """
    require_hf_value(hf, "attention_dropout", 0.0, 0.0, f"{family} (no attention dropout)")
    d, heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    head_dim = hf.get("head_dim")
    theta, scaling = _rope_from_hf(hf)
    return dict(
        attn_head_dim=None if head_dim in (None, d // heads) else head_dim,
        vocab_size=hf.get("vocab_size", 32000),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        n_layers=hf.get("num_hidden_layers", 32),
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        d_model=d,
        ffn_dim=hf.get("intermediate_size", 11008),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        pad_token_id=hf.get("pad_token_id"),
        init_std=hf.get("initializer_range", 0.02),
    )


def require_full_attention(hf: Mapping[str, Any], family: str) -> None:
    """transformers 5 windows the layers that `layer_types` marks "sliding_attention"; ember's `family` has none."""
    kinds = sorted(set(hf.get("layer_types") or ["full_attention"]))
    if kinds != ["full_attention"]:
        raise ValueError(f"config.json has layer_types with {kinds}, but ember's {family} needs every entry "
                         f"'full_attention' (no sliding-window layers).")


def llama3_config_from_hf(hf: Mapping[str, Any], overrides: Dict[str, Any]) -> Llama3Config:
    """The `Llama3Config` for an HF `LlamaConfig` dict, with ember field `overrides` applied."""
    require_hf_value(hf, "hidden_act", "silu", "silu", "Llama3 (SwiGLU)")
    require_hf_value(hf, "attention_bias", False, False, "Llama3 (no attention biases)")
    require_hf_value(hf, "mlp_bias", False, False, "Llama3 (no MLP biases)")
    return replace_config(Llama3Config(**llama_fields_from_hf(hf)), **overrides)


def llama3_config_to_hf(c: Llama3Config) -> Dict[str, Any]:
    """The HF `LlamaConfig` dict for `c`."""
    for field, family in (("qkv_bias", "qwen2"), ("sliding_window", "mistral"), ("qk_norm", "qwen3")):
        if getattr(c, field) not in (False, None):
            raise ValueError(f"Hugging Face Llama has no {field}; export this config as the family that has it: {family}.")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **llama_fields_to_hf(c),
        "attention_bias": False, "mlp_bias": False,
    }


def llama_fields_to_hf(c: Llama3Config) -> Dict[str, Any]:
    """The HF config entries that every Llama-layout family writes alike."""
    rope_scaling = _rope_to_hf(c)
    return {
        "vocab_size": c.vocab_size, "max_position_embeddings": c.max_seq_len,
        "hidden_size": c.d_model, "intermediate_size": c.ffn_dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta, "rope_scaling": rope_scaling,
        "tie_word_embeddings": c.tie_embeddings, "hidden_act": "silu", "attention_dropout": 0.0,
        "initializer_range": c.init_std, "pad_token_id": c.pad_token_id,  # always written: Gemma's default is 0
    }


def _names(c: Llama3Config) -> List[Tuple[str, str]]:
    """(ember dotted path, HF name) of every weight, blocks as a list."""
    names = [("wte.weight", "model.embed_tokens.weight")]
    for i in range(c.n_layers):
        names += [(f"blocks.{i}.{e}.weight", f"model.layers.{i}.{h}.weight") for e, h in _LAYER_NAMES]
        if c.qkv_bias:
            names += [(f"blocks.{i}.{e}.bias", f"model.layers.{i}.{h}.bias") for e, h in _LAYER_NAMES[1:4]]
        if c.qk_norm:
            names += [(f"blocks.{i}.attn.{n}.weight", f"model.layers.{i}.self_attn.{n}.weight") for n in ("q_norm", "k_norm")]
    names.append(("ln_f.weight", "model.norm.weight"))
    if not c.tie_embeddings:
        names.append(("lm_head.weight", "lm_head.weight"))
    return names


def llama3_params_from_hf(state: Mapping[str, Tensor], c: Llama3Config) -> Params:
    """ember params (blocks as a list) from an HF Llama-layout state dict (Llama, Qwen2/3, Mistral, Gemma); shapes checked."""
    unstacked = Llama3(c.replace(scan_layers=False)).param_shapes()
    shapes = {p: tuple(t.shape) for p, t in pytree.tree_leaves_with_path(unstacked)}
    get = StateReader(state)
    flat = {e: get(h, shapes[e]) for e, h in _names(c)}
    params: Dict[str, Any] = {
        "wte": {"weight": flat["wte.weight"]},
        "blocks": [{} for _ in range(c.n_layers)],
        "ln_f": {"weight": flat["ln_f.weight"]},
    }
    for path, t in flat.items():
        parts = path.split(".")
        if parts[0] == "blocks":
            node = params["blocks"][int(parts[1])]
            for p in parts[2:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = t
    if not c.tie_embeddings:
        params["lm_head"] = {"weight": flat["lm_head.weight"]}
    get.finish(ignore=lambda k: k.endswith("rotary_emb.inv_freq") or (c.tie_embeddings and k == "lm_head.weight"))
    if c.tie_embeddings:
        check_tied_head(state.get("lm_head.weight"), flat["wte.weight"], "model.embed_tokens.weight")
    return params


def llama3_params_to_hf(params: Params, c: Llama3Config) -> Dict[str, Tensor]:
    """The HF Llama state dict for ember params (blocks as a list): a rename, no copies."""
    flat = dict(pytree.tree_leaves_with_path(params))
    return {h: flat[e] for e, h in _names(c)}


register_hf_adapter(HFAdapter(
    model_type="llama",
    architectures=("LlamaForCausalLM",),
    model_cls=Llama3,
    config_cls=Llama3Config,
    config_from_hf=llama3_config_from_hf,
    config_to_hf=llama3_config_to_hf,
    params_from_hf=llama3_params_from_hf,
    params_to_hf=llama3_params_to_hf,
))
