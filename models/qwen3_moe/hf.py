"""Qwen3-MoE <-> Hugging Face `Qwen3MoeForCausalLM`: config keys and tensor names, both directions.

Registers the `"qwen3_moe"` adapter of `ember.models.hf`; `moe_params_from_hf` / `moe_params_to_hf`
also serve `ember.models.dots1`. Attention, norms and embeddings are named as in
`ember.models.qwen3.hf`; the feed-forward layer of block i is, by kind:

    MoE:    mlp.router.weight (E, d)      <- model.layers.i.mlp.gate.weight
            mlp.router.expert_bias (E,)   <- model.layers.i.mlp.gate.e_score_correction_bias    (dots1)
            mlp.{gate,up}[j] (I, d)       <- model.layers.i.mlp.experts.j.{gate,up}_proj.weight
            mlp.down[j] (d, I)            <- model.layers.i.mlp.experts.j.down_proj.weight
            mlp.shared.{gate,up,down}     <- model.layers.i.mlp.shared_experts.{gate,up,down}_proj (dots1)
    dense:  mlp.{gate,up,down}.weight     <- model.layers.i.mlp.{gate,up,down}_proj.weight

Files hold one tensor per expert, as `save_pretrained` writes them and the released checkpoints
are; transformers fuses them in memory into `mlp.experts.gate_up_proj (E, 2I, d)` (gate rows, then
up) and `mlp.experts.down_proj (E, d, I)`, which are read too (a `state_dict()`), and split.
`to_hf` writes the per-expert layout. Which layers are dense is config.json's `mlp_only_layers`
and `decoder_sparse_step`; ember's `first_dense_layers` is written into `mlp_only_layers`.

Example:
    >>> from ember.models import get_config
    >>> hf = qwen3_moe_config_to_hf(get_config("qwen3_moe", "30b-a3b"))
    >>> hf["model_type"], hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]
    ('qwen3_moe', 128, 8, 768)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from ...core import pytree
from ...core.types import Params
from ..hf import HFAdapter, StateReader, check_tied_head, register_hf_adapter, require_hf_value
from ..llama3.hf import llama_fields_from_hf, llama_fields_to_hf
from ..registry import replace_config
from .config import Qwen3MoeConfig
from .model import Qwen3Moe

__all__ = ["check_llama_attention", "hf_expert_count", "moe_params_from_hf", "moe_params_to_hf",
           "qwen3_moe_config_from_hf", "qwen3_moe_config_to_hf"]

_HF_DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                "moe_intermediate_size": 768, "num_experts_per_tok": 8, "norm_topk_prob": False,
                "decoder_sparse_step": 1, "router_aux_loss_coef": 0.001}
"""transformers' `Qwen3MoeConfig` defaults that differ from `LlamaConfig`'s, for keys config.json leaves out
(its head width is hidden_size / num_attention_heads unless `head_dim` is given; 128 experts unless named)."""

_BLOCK = (  # (ember path inside a block, HF name inside model.layers.{i}): every layer
    ("ln_1.weight", "input_layernorm.weight"),
    ("attn.wq.weight", "self_attn.q_proj.weight"),
    ("attn.wk.weight", "self_attn.k_proj.weight"),
    ("attn.wv.weight", "self_attn.v_proj.weight"),
    ("attn.wo.weight", "self_attn.o_proj.weight"),
    ("attn.q_norm.weight", "self_attn.q_norm.weight"),
    ("attn.k_norm.weight", "self_attn.k_norm.weight"),
    ("ln_2.weight", "post_attention_layernorm.weight"),
)
_SWIGLU = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))
Names = List[Tuple[str, str]]


def _block_names(c: Qwen3MoeConfig) -> Names:
    """`_BLOCK` without the q/k norms when the config has none (Mixtral)."""
    return [(e, n) for e, n in _BLOCK if c.qk_norm or "_norm." not in e]


def hf_expert_count(hf: Mapping[str, Any], *keys: str) -> Optional[int]:
    """The routed experts of config.json, under whichever of `keys` it uses (transformers 5 writes
    `num_local_experts`, older files the family's own name); a `ValueError` if they disagree."""
    found = {k: hf[k] for k in keys if hf.get(k) is not None}
    if len(set(found.values())) > 1:
        raise ValueError(f"config.json gives the expert count twice, differently: {found}; keep one.")
    return next(iter(found.values()), None)


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


# ---- params ----------------------------------------------------------------------------------


def _node(tree: Any, path: str) -> Any:
    for part in path.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree


def _put(tree: Dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[last] = value


def _experts_from_hf(get: StateReader, h: str, c: Qwen3MoeConfig) -> Dict[str, Any]:
    """The stacked expert weights of the MoE layer whose HF names start with `h` ("model.layers.i.mlp.")."""
    E, I, d = c.n_experts, c.moe_ffn_dim, c.d_model
    if h + "experts.gate_up_proj" in get.left:  # transformers' in-memory (fused) layout
        gate_up = get(h + "experts.gate_up_proj", (E, 2 * I, d))
        gate, up = (None, None) if gate_up is None else (gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous())
        return {"gate": gate, "up": up, "down": get(h + "experts.down_proj", (E, d, I))}
    out = {}
    for e, n in _SWIGLU:  # the file layout: one matrix per expert
        mats = [get(f"{h}experts.{j}.{n}.weight", (d, I) if e == "down" else (I, d)) for j in range(E)]
        out[e] = None if any(m is None for m in mats) else torch.stack(mats)  # (E, I, d) or (E, d, I)
    return out


def moe_params_from_hf(state: Mapping[str, Tensor], c: Qwen3MoeConfig, *,
                       ignore: Optional[Callable[[str], bool]] = None, model_cls: type = Qwen3Moe,
                       attention: Optional[Names] = None) -> Params:
    """ember params (blocks as a list) from an HF Qwen3-MoE, dots1, Mixtral or DeepSeek-V3 state dict; shapes checked.

    `ignore(name)` accepts tensors the model has no place for (dots1's zero-width shared experts);
    `model_cls` is the family's model and `attention` its `(ember, HF)` names inside a block, norms
    included (default: Qwen3's attention, `_block_names`).
    """
    unstacked = model_cls(c.replace(scan_layers=False)).param_shapes()
    shapes = {p: tuple(t.shape) for p, t in pytree.tree_leaves_with_path(unstacked)}
    get = StateReader(state)
    params: Dict[str, Any] = {"wte": {"weight": get("model.embed_tokens.weight", shapes["wte.weight"])}, "blocks": []}
    for i in range(c.n_layers):
        h, block = f"model.layers.{i}.", {}
        for e, n in attention or _block_names(c):
            _put(block, e, get(h + n, shapes[f"blocks.{i}.{e}"]))
        if c.is_moe_layer(i):
            router = {"weight": get(h + "mlp.gate.weight", shapes[f"blocks.{i}.mlp.router.weight"])}
            if c.expert_bias:
                router["expert_bias"] = get(h + "mlp.gate.e_score_correction_bias", (c.n_experts,))
            block["mlp"] = {"router": router, **_experts_from_hf(get, h + "mlp.", c)}
            if c.n_shared_experts:
                block["mlp"]["shared"] = {e: {"weight": get(f"{h}mlp.shared_experts.{n}.weight",
                                                            shapes[f"blocks.{i}.mlp.shared.{e}.weight"])}
                                          for e, n in _SWIGLU}
        else:
            block["mlp"] = {e: {"weight": get(f"{h}mlp.{n}.weight", shapes[f"blocks.{i}.mlp.{e}.weight"])}
                            for e, n in _SWIGLU}
        params["blocks"].append(block)
    params["ln_f"] = {"weight": get("model.norm.weight", shapes["ln_f.weight"])}
    if not c.tie_embeddings:
        params["lm_head"] = {"weight": get("lm_head.weight", shapes["lm_head.weight"])}
    get.finish(ignore=lambda k: k.endswith("rotary_emb.inv_freq") or (c.tie_embeddings and k == "lm_head.weight")
               or (ignore is not None and ignore(k)))
    if c.tie_embeddings:
        check_tied_head(state.get("lm_head.weight"), params["wte"]["weight"], "model.embed_tokens.weight")
    return params


def moe_params_to_hf(params: Params, c: Qwen3MoeConfig, *, attention: Optional[Names] = None) -> Dict[str, Tensor]:
    """The HF state dict (file layout: one tensor per expert, views of the stacked params) for ember params
    (`attention` as in `moe_params_from_hf`)."""
    out = {"model.embed_tokens.weight": params["wte"]["weight"]}
    for i, block in enumerate(params["blocks"]):
        h, mlp = f"model.layers.{i}.", block["mlp"]
        out.update({h + n: _node(block, e) for e, n in attention or _block_names(c)})
        if not c.is_moe_layer(i):
            out.update({f"{h}mlp.{n}.weight": mlp[e]["weight"] for e, n in _SWIGLU})
            continue
        out[h + "mlp.gate.weight"] = mlp["router"]["weight"]
        if c.expert_bias:
            out[h + "mlp.gate.e_score_correction_bias"] = mlp["router"]["expert_bias"]
        for e, n in _SWIGLU:
            out.update({f"{h}mlp.experts.{j}.{n}.weight": mlp[e][j] for j in range(c.n_experts)})
        if c.n_shared_experts:
            out.update({f"{h}mlp.shared_experts.{n}.weight": mlp["shared"][e]["weight"] for e, n in _SWIGLU})
    out["model.norm.weight"] = params["ln_f"]["weight"]
    if not c.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"]["weight"]
    return out


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
