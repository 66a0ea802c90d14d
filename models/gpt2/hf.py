"""GPT-2 <-> Hugging Face `GPT2LMHeadModel`: config keys and tensor names, both directions.

Registers the `"gpt2"` adapter of `ember.models.hf` (`from_hf`, `to_hf` dispatch to it). HF's
`Conv1D` stores weights as `(in, out)`, so every matrix is transposed, and q/k/v are one fused
`c_attn` matrix (HF names without the `transformer.` prefix, which is optional on load):

    wte.weight / wpe.weight              <- wte.weight / wpe.weight
    blocks.i.ln_{1,2}, ln_f              <- h.i.ln_{1,2}, ln_f
    blocks.i.attn.{wq,wk,wv}             <- h.i.attn.c_attn  (transposed, rows [0:d], [d:2d], [2d:3d])
    blocks.i.attn.wo                     <- h.i.attn.c_proj  (transposed)
    blocks.i.mlp.fc / mlp.proj           <- h.i.mlp.c_fc / h.i.mlp.c_proj  (transposed)

`lm_head` is tied to `wte`; old checkpoints' `h.i.attn.bias` / `masked_bias` mask buffers are skipped.

Example:
    >>> from ember.models import get_config
    >>> hf = gpt2_config_to_hf(get_config("gpt2", "tiny"))
    >>> hf["architectures"], hf["n_embd"], hf["activation_function"]
    (['GPT2LMHeadModel'], 64, 'gelu_new')
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch
from torch import Tensor

from ...core.types import Params
from ..hf import HFAdapter, StateReader, check_tied_head, register_hf_adapter, require_hf_value
from ..registry import replace_config
from .config import GPT2Config
from .model import GPT2

__all__ = ["gpt2_config_from_hf", "gpt2_config_to_hf", "gpt2_params_from_hf", "gpt2_params_to_hf"]

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
"""HF `activation_function` -> `GPT2Config.activation`."""


def gpt2_config_from_hf(hf: Mapping[str, Any], overrides: Dict[str, Any]) -> GPT2Config:
    """The `GPT2Config` for an HF `GPT2Config` dict, with ember field `overrides` applied."""
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"config.json activation_function={act!r} is not supported for GPT-2; supported: "
            f"{sorted(_ACTIVATIONS)}."
        )
    require_hf_value(hf, "scale_attn_weights", True, True, "GPT2 (attention scaled by 1/sqrt(head_dim))")
    require_hf_value(hf, "scale_attn_by_inverse_layer_idx", False, False, "GPT2")
    require_hf_value(hf, "add_cross_attention", False, False, "GPT2 (decoder only)")
    require_hf_value(hf, "tie_word_embeddings", True, True, "GPT2 (output projection tied to wte)")
    if "dropout" not in overrides:
        rates = {k: hf.get(k, 0.1) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
        if len(set(rates.values())) > 1:
            raise ValueError(
                f"config.json has different dropout rates {rates}, but ember's GPT2Config has one "
                f"`dropout`; pass one explicitly, e.g. from_hf(path, dropout=0.0)."
            )
        overrides["dropout"] = rates["resid_pdrop"]
    cfg = GPT2Config(
        vocab_size=hf.get("vocab_size", 50257),
        max_seq_len=hf.get("n_positions", hf.get("n_ctx", 1024)),
        n_layers=hf.get("n_layer", 12),
        n_heads=hf.get("n_head", 12),
        d_model=hf.get("n_embd", 768),
        ffn_dim=hf.get("n_inner"),
        bias=True,
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=_ACTIVATIONS[act],
        init_std=hf.get("initializer_range", 0.02),
    )
    return replace_config(cfg, **overrides)


def gpt2_config_to_hf(c: GPT2Config) -> Dict[str, Any]:
    """The HF `GPT2Config` dict for `c`."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": c.vocab_size, "n_positions": c.max_seq_len, "n_embd": c.d_model,
        "n_layer": c.n_layers, "n_head": c.n_heads, "n_inner": c.ffn_dim,
        "activation_function": "gelu_new" if c.activation == "gelu_tanh" else "gelu",
        "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
        "layer_norm_epsilon": c.layer_norm_eps, "initializer_range": c.init_std,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
    }


def _t(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.t().contiguous()  # Conv1D (in, out) <-> Linear (out, in)


def gpt2_params_from_hf(state: Mapping[str, Tensor], c: GPT2Config) -> Params:
    """ember params (blocks as a list) from an HF GPT-2 state dict; shapes checked against `c`."""
    prefix = "transformer." if any(k.startswith("transformer.") for k in state) else ""
    get = StateReader(state, prefix=prefix)
    d, f = c.d_model, c.hidden_dim

    def lin(name: str, i: int, o: int) -> Dict[str, Optional[Tensor]]:
        return {"weight": _t(get(f"{name}.weight", (i, o))), "bias": get(f"{name}.bias", (o,))}

    def ln(name: str) -> Dict[str, Optional[Tensor]]:
        return {"weight": get(f"{name}.weight", (d,)), "bias": get(f"{name}.bias", (d,))}

    blocks = []
    for i in range(c.n_layers):
        h = f"h.{i}"
        w, b = get(f"{h}.attn.c_attn.weight", (d, 3 * d)), get(f"{h}.attn.c_attn.bias", (3 * d,))
        split = {  # Conv1D (d, 3d) -> three (d, d) Linear weights, each its own contiguous copy
            "weight": (None,) * 3 if w is None else tuple(_t(x) for x in w.split(d, dim=1)),
            "bias": (None,) * 3 if b is None else tuple(x.clone() for x in b.split(d)),
        }
        blocks.append({
            "ln_1": ln(f"{h}.ln_1"),
            "attn": {
                **{n: {"weight": split["weight"][j], "bias": split["bias"][j]} for j, n in enumerate(("wq", "wk", "wv"))},
                "wo": lin(f"{h}.attn.c_proj", d, d),
            },
            "ln_2": ln(f"{h}.ln_2"),
            "mlp": {"fc": lin(f"{h}.mlp.c_fc", d, f), "proj": lin(f"{h}.mlp.c_proj", f, d)},
        })
    params = {
        "wte": {"weight": get("wte.weight", (c.vocab_size, d))},
        "wpe": {"weight": get("wpe.weight", (c.max_seq_len, d))},
        "blocks": blocks,
        "ln_f": ln("ln_f"),
    }
    get.finish(ignore=lambda k: k == "lm_head.weight" or k.endswith((".attn.bias", ".attn.masked_bias")))
    check_tied_head(state.get("lm_head.weight"), params["wte"]["weight"], "wte.weight")
    return params


def gpt2_params_to_hf(params: Params, c: GPT2Config) -> Dict[str, Tensor]:
    """The HF GPT-2 state dict for ember params (blocks as a list): matrices transposed, q/k/v fused."""
    out: Dict[str, Tensor] = {"transformer.wte.weight": params["wte"]["weight"], "transformer.wpe.weight": params["wpe"]["weight"]}

    def put(name: str, p: Mapping[str, Tensor], *, transpose: bool = False) -> None:
        w = p["weight"]
        out[f"transformer.{name}.weight"] = w.t() if transpose else w
        # HF GPT-2 always has biases; a bias-free ember model exports exact zero biases
        out[f"transformer.{name}.bias"] = p["bias"] if "bias" in p else w.new_zeros(w.shape[0])

    for i, b in enumerate(params["blocks"]):
        h = f"h.{i}"
        put(f"{h}.ln_1", b["ln_1"])
        a = b["attn"]
        qkv = {"weight": torch.cat([a[n]["weight"] for n in ("wq", "wk", "wv")], dim=0)}  # (3d, d)
        if "bias" in a["wq"]:
            qkv["bias"] = torch.cat([a[n]["bias"] for n in ("wq", "wk", "wv")], dim=0)  # (3d,)
        put(f"{h}.attn.c_attn", qkv, transpose=True)
        put(f"{h}.attn.c_proj", a["wo"], transpose=True)
        put(f"{h}.ln_2", b["ln_2"])
        put(f"{h}.mlp.c_fc", b["mlp"]["fc"], transpose=True)
        put(f"{h}.mlp.c_proj", b["mlp"]["proj"], transpose=True)
    put("ln_f", params["ln_f"])
    return out


register_hf_adapter(HFAdapter(
    model_type="gpt2",
    architectures=("GPT2LMHeadModel", "GPT2Model"),
    model_cls=GPT2,
    config_cls=GPT2Config,
    config_from_hf=gpt2_config_from_hf,
    config_to_hf=gpt2_config_to_hf,
    params_from_hf=gpt2_params_from_hf,
    params_to_hf=gpt2_params_to_hf,
))
