"""The Hugging Face tensor names of the generic MoE decoder, which the MoE families' adapters share.

Public names: `moe_params_from_hf`, `moe_params_to_hf`, `hf_expert_count`, `Names`.

Attention, norms and embeddings are named as in `ember.models.llama3.hf` (q/k norms as in Qwen3's,
where the config has them; another attention passes its own names); the feed-forward layer of
block i is, by kind:

    MoE:    mlp.router.weight (E, d)      <- model.layers.i.mlp.gate.weight
            mlp.router.expert_bias (E,)   <- model.layers.i.mlp.gate.e_score_correction_bias    (sigmoid router)
            mlp.{gate,up}[j] (I, d)       <- model.layers.i.mlp.experts.j.{gate,up}_proj.weight
            mlp.down[j] (d, I)            <- model.layers.i.mlp.experts.j.down_proj.weight
            mlp.shared.{gate,up,down}     <- model.layers.i.mlp.shared_experts.{gate,up,down}_proj (shared experts)
    dense:  mlp.{gate,up,down}.weight     <- model.layers.i.mlp.{gate,up,down}_proj.weight

Files hold one tensor per expert, as `save_pretrained` writes them and the released checkpoints
are; transformers fuses them in memory into `mlp.experts.gate_up_proj (E, 2I, d)` (gate rows, then
up) and `mlp.experts.down_proj (E, d, I)`, which are read too (a `state_dict()`), and split.
Mixtral's files rename these (`ember.models.mixtral.hf`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from ...core import pytree
from ...core.types import Params
from ..hf import StateReader, check_tied_head
from .config import MoEDecoderConfig
from .model import MoEDecoder

__all__ = ["Names", "hf_expert_count", "moe_params_from_hf", "moe_params_to_hf"]

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


def _block_names(c: MoEDecoderConfig) -> Names:
    """`_BLOCK` without the q/k norms when the config has none (Mixtral)."""
    return [(e, n) for e, n in _BLOCK if c.qk_norm or "_norm." not in e]


def hf_expert_count(hf: Mapping[str, Any], *keys: str) -> Optional[int]:
    """The routed experts of config.json, under whichever of `keys` it uses (transformers 5 writes
    `num_local_experts`, older files the family's own name); a `ValueError` if they disagree."""
    found = {k: hf[k] for k in keys if hf.get(k) is not None}
    if len(set(found.values())) > 1:
        raise ValueError(f"config.json gives the expert count twice, differently: {found}; keep one.")
    return next(iter(found.values()), None)


def _node(tree: Any, path: str) -> Any:
    for part in path.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree


def _put(tree: Dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[last] = value


def _experts_from_hf(get: StateReader, h: str, c: MoEDecoderConfig) -> Dict[str, Any]:
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


def moe_params_from_hf(state: Mapping[str, Tensor], c: MoEDecoderConfig, *,
                       ignore: Optional[Callable[[str], bool]] = None, model_cls: type = MoEDecoder,
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


def moe_params_to_hf(params: Params, c: MoEDecoderConfig, *, attention: Optional[Names] = None) -> Dict[str, Tensor]:
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
