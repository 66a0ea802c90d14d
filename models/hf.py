"""Hugging Face checkpoints <-> ember GPT-2 / Llama-3: `from_hf`, `to_hf`.

Public names: `from_hf`, `to_hf`, `config_from_hf`, `config_to_hf`, `params_from_hf`,
`params_to_hf`, `SUPPORTED_HF_MODELS`.

`from_hf(path)` reads a local Hugging Face folder (`config.json` plus `model.safetensors`, or
shards listed in `model.safetensors.index.json`) with `safetensors` alone: `transformers` is not
imported. `to_hf(model, params, path)` writes `config.json` and `model.safetensors` that
`transformers.AutoModelForCausalLM.from_pretrained(path)` loads (transformers 4.x and 5.x: the
config uses the `rope_theta` / `rope_scaling` keys both read).

Key maps (`L` layers; HF names without the GPT-2 `transformer.` prefix, which is optional on load):

    GPT-2 (GPT2LMHeadModel; Conv1D stores (in, out), so every matrix is transposed)
      wte.weight / wpe.weight              <- wte.weight / wpe.weight
      blocks.i.ln_{1,2}, ln_f              <- h.i.ln_{1,2}, ln_f
      blocks.i.attn.{wq,wk,wv}             <- h.i.attn.c_attn  (transposed, rows [0:d], [d:2d], [2d:3d])
      blocks.i.attn.wo                     <- h.i.attn.c_proj  (transposed)
      blocks.i.mlp.fc / mlp.proj           <- h.i.mlp.c_fc / h.i.mlp.c_proj  (transposed)
      (lm_head is tied to wte; old checkpoints' h.i.attn.bias / masked_bias mask buffers are skipped)
    Llama-3 (LlamaForCausalLM; same layout, no transposes, no q/k permutation)
      wte.weight <- model.embed_tokens.weight        ln_f.weight <- model.norm.weight
      blocks.i.ln_1 / ln_2 <- model.layers.i.input_layernorm / post_attention_layernorm
      blocks.i.attn.{wq,wk,wv,wo} <- model.layers.i.self_attn.{q,k,v,o}_proj
      blocks.i.mlp.{gate,up,down} <- model.layers.i.mlp.{gate,up,down}_proj
      lm_head.weight <- lm_head.weight (absent when tie_word_embeddings)

With `scan_layers=True` the blocks are stacked along a leading `(L,)` dim on load and unstacked on
export. Tensors keep the checkpoint's dtype unless `dtype=` is given.

Example:
    >>> import tempfile, torch
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> from ember.models.hf import from_hf, to_hf
    >>> model = build_model("llama3", "tiny")
    >>> params = model.init(random.key(0))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     to_hf(model, params, d)
    ...     model2, params2 = from_hf(d, scan_layers=True)
    >>> model2.config.scan_layers, tuple(params2["blocks"]["attn"]["wq"]["weight"].shape)
    (True, (2, 128, 128))
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

from ..core import pytree
from ..core.transforms import stack_trees, unstack_trees
from ..core.types import Params
from .gpt2 import GPT2, GPT2Config
from .layers import RopeScaling
from .llama3 import Llama3, Llama3Config
from .registry import replace_config

__all__ = [
    "SUPPORTED_HF_MODELS",
    "config_from_hf",
    "config_to_hf",
    "from_hf",
    "params_from_hf",
    "params_to_hf",
    "to_hf",
]

SUPPORTED_HF_MODELS: Dict[str, Tuple[str, ...]] = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Model"),
    "llama": ("LlamaForCausalLM",),
}
"""HF `model_type` -> the `architectures` entries `from_hf` reads."""

Config = Union[GPT2Config, Llama3Config]
Model = Union[GPT2, Llama3]
PathLike = Union[str, "os.PathLike[str]"]

_SUPPORTED_TEXT = "gpt2 (GPT2LMHeadModel) and llama (LlamaForCausalLM)"
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


# ---- configs ---------------------------------------------------------------------------------


def _require(hf: Mapping[str, Any], key: str, expected: Any, default: Any, why: str) -> None:
    got = hf.get(key, default)
    if got != expected:
        raise ValueError(f"config.json has {key}={got!r}, but ember's {why} needs {key}={expected!r}.")


def _gpt2_config(hf: Mapping[str, Any], overrides: Dict[str, Any]) -> GPT2Config:
    act = hf.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise ValueError(
            f"config.json activation_function={act!r} is not supported for GPT-2; supported: "
            f"{sorted(_GPT2_ACTIVATIONS)}."
        )
    _require(hf, "scale_attn_weights", True, True, "GPT2 (attention scaled by 1/sqrt(head_dim))")
    _require(hf, "scale_attn_by_inverse_layer_idx", False, False, "GPT2")
    _require(hf, "add_cross_attention", False, False, "GPT2 (decoder only)")
    _require(hf, "tie_word_embeddings", True, True, "GPT2 (output projection tied to wte)")
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
        activation=_GPT2_ACTIVATIONS[act],
        init_std=hf.get("initializer_range", 0.02),
    )
    return replace_config(cfg, **overrides)


def _llama_rope(hf: Mapping[str, Any]) -> Tuple[float, Optional[RopeScaling]]:
    """(theta, scaling) from transformers 5.x `rope_parameters` or 4.x `rope_theta` / `rope_scaling`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ValueError(
            f"config.json rope type {kind!r} is not supported; ember's Llama3 supports 'default' and "
            f"'llama3' (Llama-3.1 frequency scaling)."
        )
    scaling = RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_seq_len=int(params.get("original_max_position_embeddings", 8192)),
    )
    return float(theta), scaling


def _llama_config(hf: Mapping[str, Any], overrides: Dict[str, Any]) -> Llama3Config:
    _require(hf, "hidden_act", "silu", "silu", "Llama3 (SwiGLU)")
    _require(hf, "attention_bias", False, False, "Llama3 (no attention biases)")
    _require(hf, "mlp_bias", False, False, "Llama3 (no MLP biases)")
    d, heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    if hf.get("head_dim") not in (None, d // heads):
        raise ValueError(
            f"config.json head_dim={hf['head_dim']} differs from hidden_size / num_attention_heads = "
            f"{d} / {heads} = {d // heads}; ember's Llama3 derives head_dim from d_model and n_heads."
        )
    theta, scaling = _llama_rope(hf)
    cfg = Llama3Config(
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
        init_std=hf.get("initializer_range", 0.02),
    )
    return replace_config(cfg, **overrides)


def config_from_hf(hf_config: Mapping[str, Any], **overrides: Any) -> Config:
    """The ember config for a Hugging Face `config.json` dict.

    Args:
        hf_config: the parsed `config.json` (`model_type` "gpt2" or "llama").
        **overrides: ember config fields to set (e.g. `scan_layers=True`, `remat=True`, `dropout=0.0`).

    Returns:
        A `GPT2Config` or `Llama3Config`.

    Raises:
        ValueError: another architecture (names the supported ones), a setting ember's model does
            not implement (biases in Llama, another activation or RoPE type), or an unknown override.

    Example:
        >>> cfg = config_from_hf({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        ...                       "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2,
        ...                       "vocab_size": 100, "rope_theta": 500000.0})
        >>> cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.norm_eps
        (2, 16, 500000.0, 1e-06)
    """
    model_type = hf_config.get("model_type")
    archs = hf_config.get("architectures") or []
    if model_type not in SUPPORTED_HF_MODELS:
        raise ValueError(
            f"Hugging Face model_type {model_type!r} (architectures {archs}) is not supported; "
            f"ember.models.from_hf reads {_SUPPORTED_TEXT}."
        )
    bad = [a for a in archs if a not in SUPPORTED_HF_MODELS[model_type]]
    if bad:
        raise ValueError(
            f"Hugging Face architectures {bad} are not supported for model_type {model_type!r}; "
            f"ember.models.from_hf reads {_SUPPORTED_TEXT}."
        )
    build = _gpt2_config if model_type == "gpt2" else _llama_config
    return build(hf_config, dict(overrides))


def config_to_hf(config: Config) -> Dict[str, Any]:
    """The Hugging Face `config.json` dict for an ember GPT-2 or Llama-3 config.

    Raises:
        TypeError: `config` is neither a `GPT2Config` nor a `Llama3Config`.

    Example:
        >>> from ember.models import get_config
        >>> hf = config_to_hf(get_config("gpt2", "tiny"))
        >>> hf["architectures"], hf["n_embd"], hf["activation_function"]
        (['GPT2LMHeadModel'], 64, 'gelu_new')
    """
    if isinstance(config, GPT2Config):
        c = config
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
    if isinstance(config, Llama3Config):
        c = config
        s = c.rope_scaling
        rope_scaling = None if s is None else {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_seq_len,
        }
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": c.vocab_size, "max_position_embeddings": c.max_seq_len,
            "hidden_size": c.d_model, "intermediate_size": c.ffn_dim, "num_hidden_layers": c.n_layers,
            "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
            "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta, "rope_scaling": rope_scaling,
            "tie_word_embeddings": c.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": c.init_std,
        }
    raise TypeError(
        f"config_to_hf supports GPT2Config and Llama3Config, got {type(config).__name__}."
    )


# ---- key maps --------------------------------------------------------------------------------


class _Reader:
    """Pops named tensors from an HF state dict, checking shapes and collecting missing names."""

    def __init__(self, state: Mapping[str, Tensor], *, prefix: str = "") -> None:
        self.left = dict(state)
        self.prefix = prefix
        self.missing: List[str] = []

    def __call__(self, name: str, shape: Tuple[int, ...]) -> Optional[Tensor]:
        full = self.prefix + name
        if full not in self.left:
            self.missing.append(full)
            return None
        t = self.left.pop(full)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"checkpoint tensor '{full}' has shape {tuple(t.shape)}, expected {tuple(shape)} from "
                f"config.json; the weights and the config disagree (or the config was edited)."
            )
        return t

    def finish(self, *, ignore: Callable[[str], bool]) -> None:
        if self.missing:
            raise ValueError(
                f"checkpoint is missing {len(self.missing)} tensor(s), e.g. {self.missing[:5]}; is it a "
                f"complete {_SUPPORTED_TEXT} checkpoint matching config.json?"
            )
        unexpected = sorted(k for k in self.left if not ignore(k))
        if unexpected:
            raise ValueError(
                f"checkpoint has {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:5]}; ember's "
                f"model has no place for them (another variant of the architecture?)."
            )


def _t(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.t().contiguous()  # Conv1D (in, out) <-> Linear (out, in)


def _check_tied(head: Optional[Tensor], embedding: Tensor, name: str) -> None:
    """A tied checkpoint may still store lm_head.weight; it must then equal the embedding."""
    if head is not None and (head.shape != embedding.shape or not torch.equal(head, embedding)):
        raise ValueError(
            f"config.json ties the output projection to {name} (tie_word_embeddings=true), but the "
            f"checkpoint's lm_head.weight differs from it; fix config.json or the weights."
        )


def _gpt2_from_hf(state: Mapping[str, Tensor], c: GPT2Config) -> Params:
    prefix = "transformer." if any(k.startswith("transformer.") for k in state) else ""
    get = _Reader(state, prefix=prefix)
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
    _check_tied(state.get("lm_head.weight"), params["wte"]["weight"], "wte.weight")
    return params


def _gpt2_to_hf(params: Params, c: GPT2Config) -> Dict[str, Tensor]:
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


_LLAMA_LAYER = (  # (ember path inside a block, HF name inside model.layers.{i})
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


def _llama_names(c: Llama3Config) -> List[Tuple[str, str]]:
    """(ember dotted path, HF name) of every weight, blocks as a list."""
    names = [("wte.weight", "model.embed_tokens.weight")]
    for i in range(c.n_layers):
        names += [(f"blocks.{i}.{e}.weight", f"model.layers.{i}.{h}.weight") for e, h in _LLAMA_LAYER]
    names.append(("ln_f.weight", "model.norm.weight"))
    if not c.tie_embeddings:
        names.append(("lm_head.weight", "lm_head.weight"))
    return names


def _unstacked_shapes(model: Model) -> Dict[str, Tuple[int, ...]]:
    flat_model = type(model)(model.config.replace(scan_layers=False))
    return {p: tuple(t.shape) for p, t in pytree.tree_leaves_with_path(flat_model.param_shapes())}


def _llama_from_hf(state: Mapping[str, Tensor], c: Llama3Config, shapes: Dict[str, Tuple[int, ...]]) -> Params:
    get = _Reader(state)
    flat = {e: get(h, shapes[e]) for e, h in _llama_names(c)}
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
        _check_tied(state.get("lm_head.weight"), flat["wte.weight"], "model.embed_tokens.weight")
    return params


def _llama_to_hf(params: Params, c: Llama3Config) -> Dict[str, Tensor]:
    flat = dict(pytree.tree_leaves_with_path(params))
    return {h: flat[e] for e, h in _llama_names(c)}


def params_from_hf(state: Mapping[str, Tensor], config: Config) -> Params:
    """Map an HF state dict (e.g. `GPT2LMHeadModel.state_dict()` or a loaded safetensors file) to ember params.

    Args:
        state: HF tensor name -> tensor.
        config: the ember config (from `config_from_hf`); `scan_layers=True` stacks the blocks.

    Returns:
        The params tree of `GPT2(config)` / `Llama3(config)` (tensors are the checkpoint's, or
        transposed copies for GPT-2's Conv1D matrices).

    Raises:
        ValueError: a tensor has the wrong shape (named), or tensors are missing / unexpected
            (a few are listed).
        TypeError: `config` is not a `GPT2Config` / `Llama3Config`.
    """
    model = _model_for(config)
    if isinstance(config, GPT2Config):
        params = _gpt2_from_hf(state, config)
    else:
        params = _llama_from_hf(state, config, _unstacked_shapes(model))
    if config.scan_layers:
        params["blocks"] = stack_trees(params["blocks"], what="blocks")
    _check_params(model, params)
    return params


def params_to_hf(params: Params, config: Config) -> Dict[str, Tensor]:
    """Map ember params of `GPT2(config)` / `Llama3(config)` to an HF state dict (as saved on disk).

    Returns:
        HF tensor name -> tensor (tied output projections are left out, as `save_pretrained` does).

    Raises:
        ValueError: `params` does not have the model's structure or shapes (the path is named).
        TypeError: `config` is not a `GPT2Config` / `Llama3Config`.
    """
    _check_params(_model_for(config), params)
    if config.scan_layers:
        params = {**params, "blocks": unstack_trees(params["blocks"])}
    return _gpt2_to_hf(params, config) if isinstance(config, GPT2Config) else _llama_to_hf(params, config)


def _model_for(config: Config) -> Model:
    if isinstance(config, GPT2Config):
        return GPT2(config)
    if isinstance(config, Llama3Config):
        return Llama3(config)
    raise TypeError(f"expected a GPT2Config or Llama3Config, got {type(config).__name__}.")


def _check_params(model: Model, params: Params) -> None:
    expected = model.param_shapes()
    pytree.check_same_structure(
        params, expected, what="the params and the model's parameters",
        fix="Build params with model.init() or from_hf() for this config.",
    )
    for (path, got), (_, want) in zip(pytree.tree_leaves_with_path(params), pytree.tree_leaves_with_path(expected)):
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"parameter '{path}' has shape {tuple(got.shape)}, expected {tuple(want.shape)}.")


# ---- files -----------------------------------------------------------------------------------


def _read_state(path: str, *, device: str) -> Dict[str, Tensor]:
    from safetensors import safe_open

    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(single):
        files = [single]
    elif os.path.exists(index):
        with open(index) as fh:
            weight_map = json.load(fh).get("weight_map", {})
        files = [os.path.join(path, f) for f in dict.fromkeys(weight_map.values())]
        absent = [f for f in files if not os.path.exists(f)]
        if absent:
            raise ValueError(f"{index} lists shards that are not in the folder: {absent[:5]}.")
    else:
        raise ValueError(
            f"no model.safetensors or model.safetensors.index.json in {path} (found {sorted(os.listdir(path))[:10]}). "
            f"A pytorch_model.bin checkpoint can be re-saved with transformers: "
            f"AutoModelForCausalLM.from_pretrained(path).save_pretrained(path, safe_serialization=True)."
        )
    state: Dict[str, Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt", device=device) as f:
            for k in f.keys():
                state[k] = f.get_tensor(k)
    return state


def from_hf(
    path: PathLike,
    *,
    dtype: Optional[torch.dtype] = None,
    device: Union[str, torch.device] = "cpu",
    **overrides: Any,
) -> Tuple[Model, Params]:
    """Load a local Hugging Face GPT-2 or Llama checkpoint folder as an ember model and its params.

    Args:
        path: a folder with `config.json` and `model.safetensors` (or sharded safetensors with
            `model.safetensors.index.json`).
        dtype: cast every tensor to this dtype; None keeps the checkpoint's.
        device: where to load the tensors.
        **overrides: ember config fields to change (`scan_layers=True`, `remat=True`, `dropout=0.0`...).
            GPT-2 configs carry HF's dropout (0.1 by default), which ember applies whenever `apply`
            gets a key; pass `dropout=0.0` to fine-tune without it.

    Returns:
        `(model, params)`: a `GPT2` or `Llama3` and its params tree.

    Raises:
        ValueError: the folder has no config.json or safetensors weights, the checkpoint is of
            another architecture (the supported ones are listed), a setting is not implemented by
            ember's model, or tensors are missing, unexpected, or of the wrong shape (named).
    """
    path = os.fspath(path)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{cfg_file} not found; from_hf needs a Hugging Face model folder (config.json + model.safetensors).")
    with open(cfg_file) as fh:
        config = config_from_hf(json.load(fh), **overrides)
    state = _read_state(path, device=str(device))
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    params = params_from_hf(state, config)
    return _model_for(config), params


def to_hf(
    model: Model,
    params: Params,
    path: PathLike,
    *,
    dtype: Optional[torch.dtype] = None,
    extra_config: Optional[Mapping[str, Any]] = None,
) -> None:
    """Write `config.json` and `model.safetensors` that `transformers` loads as a causal LM.

    Args:
        model: a `GPT2` or `Llama3` (for a LoRA model, export `merge_lora(...)` with the base model).
        params: its params (either layer layout; gathered to CPU while writing).
        path: the output folder (created if needed; existing files of the same names are replaced).
        dtype: cast every tensor to this dtype (also recorded in config.json); None keeps theirs.
        extra_config: more `config.json` entries, e.g. `{"bos_token_id": 0, "eos_token_id": 1}`.

    Raises:
        TypeError: `model` is not a `GPT2` or `Llama3`.
        ValueError: `params` does not fit the model (the path and shapes are named).
    """
    if not isinstance(model, (GPT2, Llama3)):
        raise TypeError(
            f"to_hf exports ember GPT2 and Llama3 models, got {type(model).__name__}; for a LoRA model "
            f"pass its base model and merge_lora(params['base'], params['lora'], ...)."
        )
    from safetensors.torch import save_file

    state = params_to_hf(params, model.config)
    tensors = {}
    for k, v in state.items():
        v = v.detach().to("cpu", dtype=dtype)
        # own, contiguous storage: views of stacked or fused tensors share memory, which safetensors refuses
        tensors[k] = v.clone(memory_format=torch.contiguous_format)
    hf = config_to_hf(model.config)
    stored = dtype or next(iter(tensors.values())).dtype
    hf["torch_dtype"] = str(stored).removeprefix("torch.")
    hf.update(extra_config or {})
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(hf, fh, indent=2, sort_keys=True)
