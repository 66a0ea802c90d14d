"""Hugging Face checkpoints <-> ember models: folder I/O, and one adapter per family behind one API.

Public names: `from_hf`, `to_hf`, `config_from_hf`, `config_to_hf`, `params_from_hf`,
`params_to_hf`, `SUPPORTED_HF_MODELS`, `HFAdapter`, `register_hf_adapter`, `save_safetensors`.

`from_hf(path)` reads a local Hugging Face folder (`config.json` plus `model.safetensors`, or
shards listed in `model.safetensors.index.json`) with `safetensors` alone: `transformers` is not
imported. `to_hf(model, params, path)` writes `config.json` and `model.safetensors` that
`transformers.AutoModelForCausalLM.from_pretrained(path)` loads.

What is family-specific (config keys, tensor names, transposes) lives in each family's `hf.py`,
which registers an `HFAdapter` for its HF `model_type`; this module picks the adapter and does what
every family shares: stacking blocks (the default `scan_layers=True`; unstacking on export), checking params
against the model, files. `StateReader`, `require_hf_value` and `check_tied_head` help adapters.

Example:
    >>> import tempfile, torch
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> from ember.models.hf import from_hf, to_hf
    >>> model = build_model("llama3", "tiny")
    >>> params = model.init(random.key(0))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     to_hf(model, params, d)
    ...     model2, params2 = from_hf(d)
    ...     listed, params3 = from_hf(d, scan_layers=False)
    >>> tuple(params2["blocks"]["attn"]["wq"]["weight"].shape), len(params3["blocks"])
    ((2, 128, 128), 2)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

from ..core import pytree
from ..core.types import Params
from ._safetensors import read_safetensors_folder, save_safetensors
from .layers.stacked import as_list

__all__ = [
    "HFAdapter",
    "SUPPORTED_HF_MODELS",
    "config_from_hf",
    "config_to_hf",
    "from_hf",
    "params_from_hf",
    "params_to_hf",
    "register_hf_adapter",
    "save_safetensors",
    "to_hf",
]

PathLike = Union[str, "os.PathLike[str]"]


@dataclasses.dataclass(frozen=True)
class HFAdapter:
    """How one ember family maps to one Hugging Face `model_type` (both directions).

    The params functions see the blocks as a list (`scan_layers=False` layout); stacking is done here.
    """

    model_type: str
    """HF `config.json` `model_type`, e.g. "llama"."""
    architectures: Tuple[str, ...]
    """HF `architectures` entries read; the first is written on export."""
    model_cls: type
    """The ember model class; `model_cls(config)` builds it."""
    config_cls: type
    """The ember config class."""
    config_from_hf: Callable[[Mapping[str, Any], Dict[str, Any]], Any]
    """(HF config dict, ember field overrides) -> ember config with the overrides applied."""
    config_to_hf: Callable[[Any], Dict[str, Any]]
    """ember config -> HF config dict."""
    params_from_hf: Callable[[Mapping[str, Tensor], Any], Params]
    """(HF state dict, ember config) -> params with `blocks` as a list."""
    params_to_hf: Callable[[Params, Any], Dict[str, Tensor]]
    """(params with `blocks` as a list, ember config) -> HF state dict."""


_ADAPTERS: Dict[str, HFAdapter] = {}

SUPPORTED_HF_MODELS: Dict[str, Tuple[str, ...]] = {}
"""HF `model_type` -> the `architectures` entries `from_hf` reads (filled by `register_hf_adapter`)."""


def register_hf_adapter(adapter: HFAdapter) -> HFAdapter:
    """Make `from_hf` / `to_hf` handle `adapter.model_type` (a `ValueError` if it is already handled)."""
    if adapter.model_type in _ADAPTERS:
        raise ValueError(f"a Hugging Face adapter for model_type {adapter.model_type!r} is already registered.")
    _ADAPTERS[adapter.model_type] = adapter
    SUPPORTED_HF_MODELS[adapter.model_type] = tuple(adapter.architectures)
    return adapter


def _adapters() -> List[HFAdapter]:
    return [_ADAPTERS[t] for t in sorted(_ADAPTERS)]


def _names(items: List[str], last: str) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}"


def _supported_text() -> str:
    return _names([f"{a.model_type} ({a.architectures[0]})" for a in _adapters()], "and")


def _adapter_for_config(config: Any, what: str) -> HFAdapter:
    for adapter in _adapters():  # the exact class: the Qwen, Mistral and Gemma configs subclass Llama3Config
        if type(config) is adapter.config_cls:
            return adapter
    raise TypeError(what.format(_names([a.config_cls.__name__ for a in _adapters()], "or"), type(config).__name__))


# ---- helpers for adapters --------------------------------------------------------------------


def require_hf_value(hf: Mapping[str, Any], key: str, expected: Any, default: Any, why: str) -> None:
    """Raise unless `hf.get(key, default) == expected`; `why` names the ember model that needs it."""
    got = hf.get(key, default)
    if got != expected:
        raise ValueError(f"config.json has {key}={got!r}, but ember's {why} needs {key}={expected!r}.")


class StateReader:
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
        """Raise if a tensor was missing or one that `ignore` does not accept was left over."""
        if self.missing:
            raise ValueError(
                f"checkpoint is missing {len(self.missing)} tensor(s), e.g. {self.missing[:5]}; is it a "
                f"complete {_supported_text()} checkpoint matching config.json?"
            )
        unexpected = sorted(k for k in self.left if not ignore(k))
        if unexpected:
            raise ValueError(
                f"checkpoint has {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:5]}; ember's "
                f"model has no place for them (another variant of the architecture?)."
            )


def check_tied_head(head: Optional[Tensor], embedding: Tensor, name: str) -> None:
    """A tied checkpoint may still store lm_head.weight; it must then equal the embedding."""
    if head is not None and (head.shape != embedding.shape or not torch.equal(head, embedding)):
        raise ValueError(
            f"config.json ties the output projection to {name} (tie_word_embeddings=true), but the "
            f"checkpoint's lm_head.weight differs from it; fix config.json or the weights."
        )


# ---- configs and params ----------------------------------------------------------------------


def config_from_hf(hf_config: Mapping[str, Any], **overrides: Any) -> Any:
    """The ember config for a Hugging Face `config.json` dict.

    Args:
        hf_config: the parsed `config.json` (`model_type` of a native family: "gpt2", "llama", "qwen2", ...).
        **overrides: ember config fields to set (e.g. `scan_layers=False`, `remat=True`, `dropout=0.0`).

    Returns:
        The family's config (`GPT2Config`, `Llama3Config`, `Qwen2Config`, ...).

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
    if model_type not in _ADAPTERS:
        raise ValueError(
            f"Hugging Face model_type {model_type!r} (architectures {archs}) has no native ember family; "
            f"the native ones are {_supported_text()}. from_hf(path) still trains it through the "
            f"from_torch bridge."
        )
    bad = [a for a in archs if a not in _ADAPTERS[model_type].architectures]
    if bad:
        raise ValueError(
            f"Hugging Face architectures {bad} are not supported for model_type {model_type!r}; "
            f"ember.models.from_hf reads {_supported_text()}."
        )
    return _ADAPTERS[model_type].config_from_hf(hf_config, dict(overrides))


def config_to_hf(config: Any) -> Dict[str, Any]:
    """The Hugging Face `config.json` dict for the config of a native ember family.

    Raises:
        TypeError: `config` is not the config of a native family.

    Example:
        >>> from ember.models import get_config
        >>> hf = config_to_hf(get_config("gpt2", "tiny"))
        >>> hf["architectures"], hf["n_embd"], hf["activation_function"]
        (['GPT2LMHeadModel'], 64, 'gelu_new')
    """
    return _adapter_for_config(config, "config_to_hf supports {}, got {}.").config_to_hf(config)


def params_from_hf(state: Mapping[str, Tensor], config: Any) -> Params:
    """Map an HF state dict (e.g. `GPT2LMHeadModel.state_dict()` or a loaded safetensors file) to ember params.

    Args:
        state: HF tensor name -> tensor.
        config: the ember config (from `config_from_hf`); `scan_layers` (the default) stacks the blocks.

    Returns:
        The params tree of the family's model for `config` (tensors are the checkpoint's, or
        transposed copies for GPT-2's Conv1D matrices).

    Raises:
        ValueError: a tensor has the wrong shape (named), or tensors are missing / unexpected
            (a few are listed).
        TypeError: `config` is not the config of a native family.
    """
    adapter = _adapter_for_config(config, "expected a {}, got {}.")
    params = adapter.params_from_hf(state, config)
    model = adapter.model_cls(config)
    if config.scan_layers:
        params["blocks"] = model.children["blocks"].stack(params["blocks"])
    _check_params(model, params)
    return params


def params_to_hf(params: Params, config: Any) -> Dict[str, Tensor]:
    """Map ember params of a native model for `config` to an HF state dict (as saved on disk).

    Returns:
        HF tensor name -> tensor (tied output projections are left out, as `save_pretrained` does).

    Raises:
        ValueError: `params` does not have the model's structure or shapes (the path is named).
        TypeError: `config` is not the config of a native family.
    """
    adapter = _adapter_for_config(config, "expected a {}, got {}.")
    model = adapter.model_cls(config)
    _check_params(model, params)
    return adapter.params_to_hf(as_list(model, params)[1], config)


def _check_params(model: Any, params: Params) -> None:
    expected = model.param_shapes()
    pytree.check_same_structure(
        params, expected, what="the params and the model's parameters",
        fix="Build params with model.init() or from_hf() for this config.",
    )
    for (path, got), (_, want) in zip(pytree.tree_leaves_with_path(params), pytree.tree_leaves_with_path(expected)):
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"parameter '{path}' has shape {tuple(got.shape)}, expected {tuple(want.shape)}.")


# ---- files -----------------------------------------------------------------------------------


def from_hf(
    path: PathLike,
    *,
    dtype: Optional[torch.dtype] = None,
    device: Union[str, torch.device] = "cpu",
    **overrides: Any,
) -> Tuple[Any, Params]:
    """Load a local Hugging Face causal LM folder as an ember model and its params.

    Folders of the native families (`gpt2`, `llama3`, `qwen2`, `qwen3`, `mistral`, `gemma`, `qwen3_moe`, `mixtral`,
    `dots1`, `deepseek_v3`: GPT-2, Llama, Qwen2, Qwen3, Mistral, Gemma, Qwen3-MoE, Mixtral, dots.llm1 and
    DeepSeek-V3) become native ember models. Any other causal LM that
    transformers loads is bridged (`hf_bridge.bridge_from_hf`, with one warning line): it trains,
    without the native families' extras.

    Args:
        path: a folder with `config.json` and `model.safetensors` (or sharded safetensors with
            `model.safetensors.index.json`).
        dtype: cast every tensor to this dtype; None keeps the checkpoint's.
        device: where to load the tensors.
        **overrides: ember config fields to change (`scan_layers=False`, `remat=True`, `dropout=0.0`...).
            GPT-2 configs carry HF's dropout (0.1 by default), which ember applies whenever `apply`
            gets a key; pass `dropout=0.0` to fine-tune without it.

    Returns:
        `(model, params)`: a native model (`GPT2`, `Llama3`, `Qwen2`, `Qwen3`, `Mistral`, `Gemma`, `Qwen3Moe`,
        `Dots1`, `Mixtral`, `DeepseekV3`) or a bridged `TorchModel`, and its params tree.

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
        hf_config = json.load(fh)
    if hf_config.get("model_type") not in _ADAPTERS:
        from .hf_bridge import bridge_from_hf

        return bridge_from_hf(path, hf_config, supported=_supported_text(), overrides=overrides, dtype=dtype,
                              device=device)
    config = config_from_hf(hf_config, **overrides)
    state = read_safetensors_folder(path, device=str(device))
    if dtype is not None:  # routing correction biases stay float32, as transformers keeps them
        state = {k: v if k.endswith(_FLOAT32_KEYS) else v.to(dtype) for k, v in state.items()}
    params = params_from_hf(state, config)
    return _adapter_for_config(config, "expected a {}, got {}.").model_cls(config), params


_FLOAT32_KEYS = ("e_score_correction_bias",)
"""Tensors `from_hf(dtype=...)` and `to_hf(dtype=...)` leave in float32, as transformers keeps them
(`_keep_in_fp32_modules_strict`): a bfloat16 expert bias would round away the 1e-3 steps that balance the
experts (`ember.models.layers.moe_router.expert_balance`)."""

_DESCRIPTIVE_KEYS = frozenset({"architectures", "max_position_embeddings", "bos_token_id", "eos_token_id",
                               "initializer_range", "use_cache"})
"""`config.json` entries that `to_hf`'s `extra_config` may change: they leave the model's math alone."""


def to_hf(
    model: Any,
    params: Params,
    path: PathLike,
    *,
    dtype: Optional[torch.dtype] = None,
    extra_config: Optional[Mapping[str, Any]] = None,
) -> None:
    """Write `config.json` and `model.safetensors` that `transformers` loads as a causal LM.

    Args:
        model: a native model, e.g. `GPT2`, `Llama3`, `Qwen2` (for a LoRA model, export `merge_lora(...)` with the base model).
        params: its params (either layer layout; gathered to CPU while writing).
        path: the output folder (created if needed; existing files of the same names are replaced).
        dtype: cast every tensor to this dtype (also recorded in config.json) but the routers' correction
            biases, which stay float32 as transformers keeps them; None keeps theirs.
        extra_config: more `config.json` entries, e.g. `{"bos_token_id": 0, "eos_token_id": 1}`; it may not
            change an entry of the model's math that its config writes (`pad_token_id`, shapes, ...),
            only descriptive ones (`_DESCRIPTIVE_KEYS`: `max_position_embeddings`, token ids, ...).

    Raises:
        TypeError: `model` is not a native ember model.
        ValueError: `params` does not fit the model (the path and shapes are named), or `extra_config`
            changes an entry the model's config writes.
    """
    if not isinstance(model, tuple(a.model_cls for a in _adapters())):
        raise TypeError(
            f"to_hf exports ember {_names([a.model_cls.__name__ for a in _adapters()], 'and')} models, got "
            f"{type(model).__name__}; for a LoRA model pass its base model and "
            f"merge_lora(params['base'], params['lora'], ...)."
        )
    hf = config_to_hf(model.config)  # first: a config the HF family cannot hold is the clearer error
    clash = {k: v for k, v in (extra_config or {}).items() if k in hf and hf[k] != v and k not in _DESCRIPTIVE_KEYS}
    if clash:
        k = next(iter(clash))
        raise ValueError(f"extra_config sets {k}={clash[k]!r}, but the model's config writes {k}={hf[k]!r} (it is "
                         f"part of the model's math); change the model config (config.replace(...)) instead.")
    state = params_to_hf(params, model.config)
    tensors = {}
    for k, v in state.items():
        v = v.detach().to("cpu", dtype=None if k.endswith(_FLOAT32_KEYS) else dtype)
        # own, contiguous storage: views of stacked or fused tensors share memory, which safetensors refuses
        tensors[k] = v.clone(memory_format=torch.contiguous_format)
    stored = dtype or next(iter(tensors.values())).dtype
    hf["torch_dtype"] = str(stored).removeprefix("torch.")
    hf.update(extra_config or {})
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    save_safetensors(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(hf, fh, indent=2, sort_keys=True)
