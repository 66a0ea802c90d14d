"""`--init_from PATH`: a run's first parameters from a Hugging Face folder or an ember checkpoint.

Public names: `load_initial_params`, `check_init_from`, `with_saved_model`, `with_saved_tokenizer`, `saved_model`,
`hf_folder_config`.

A Hugging Face folder (`config.json` with a `model_type`, safetensors weights) of a native family is
read with `ember.models.from_hf`'s mapping, into the configured layer layout (`scan_layers` either
way) and the configured parameter dtype (a bf16 folder still trains float32 master weights). An ember
run directory or checkpoint directory gives the params of its latest step (no optimizer state, no
step count: the run starts at step 0), restored into the configured model, so its `scan_layers` must
be the checkpoint's. Either way the saved architecture is checked against the configured one first,
and every difference is named. A run config without a model (`--config sft`) takes the saved one
(`with_saved_model`), so one run config fine-tunes a folder of any native family. The run reads the
tokenizer the weights were trained with (a Hugging Face folder's own, or the model tokenizer an ember run
read) unless `--data.tokenizer` names another (`with_saved_tokenizer`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from ember.core import random
from ember.core.dataclass_json import to_dict
from ember.core.types import Params
from ember.launch.model_mismatch import refusal

__all__ = ["check_init_from", "hf_folder_config", "load_initial_params", "saved_model", "with_saved_model",
           "with_saved_tokenizer"]

def hf_folder_config(path: str) -> Optional[Dict[str, Any]]:
    """The folder's `config.json` if it is a Hugging Face model's (it names a `model_type`), else None."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as fh:
        config = json.load(fh)
    return config if isinstance(config, dict) and "model_type" in config else None


def _hf_model(path: str, hf: Mapping[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """(family, config dict) of the Hugging Face folder at `path` (its `config.json` is `hf`)."""
    from ember import models
    from ember.models.hf import SUPPORTED_HF_MODELS, config_from_hf

    if hf["model_type"] not in SUPPORTED_HF_MODELS:
        raise ValueError(
            f"--init_from {path}: model_type {hf['model_type']!r} has no native ember family "
            f"({', '.join(sorted(SUPPORTED_HF_MODELS))} do), so launch/train.py cannot build it; it "
            f"trains from Python through the bridge: ember.models.from_hf({path!r})."
        )
    saved = config_from_hf(hf)
    family = next((f for f in models.list_families() for a in models.list_archs(f)[:1]
                   if type(models.get_config(f, a)) is type(saved)), hf["model_type"])
    return family, to_dict(saved)


def saved_model(path: str) -> Tuple[str, Any, Optional[str]]:
    """(family, model config, tokenizer folder or None) of the weights at `path` (no weights read)."""
    hf = hf_folder_config(path)
    if hf is not None:
        from ember.models.hf import config_from_hf

        return _hf_model(path, hf)[0], config_from_hf(hf), path
    if not os.path.exists(path):
        raise ValueError(f"--init_from {path}: no such folder; pass a Hugging Face model folder (config.json + "
                         f"*.safetensors) or an ember run directory (the --out of launch/train.py).")
    from ember.core.checkpoint import CheckpointError, CheckpointManager
    from ember.launch.ckpt_tools import checkpoint_root, model_config_from_dict

    with CheckpointManager(checkpoint_root(path), read_only=True) as ckpt:
        meta = ckpt.read_meta()
    info, data = meta.model or {}, (meta.config or {}).get("data") or {}
    if not (info.get("family") and info.get("config")):
        raise CheckpointError(f"--init_from {path}: its checkpoint records no model config, so the run config cannot "
                              f"take its model from it; pass --config a run config of its family.")
    tokenizer = data.get("tokenizer_path") if data.get("tokenizer") == "model" else None
    return info["family"], model_config_from_dict(info["config"]), tokenizer


def with_saved_model(cfg: Any, path: str) -> Any:
    """`cfg` (a `TrainConfig`) with `init_from=path` and the family and model config saved there: a Hugging Face
    folder's `config.json`, or what an ember checkpoint recorded. A `data.tokenizer model` without a
    `tokenizer_path` reads the folder's tokenizer (a checkpoint's: the one its run read).

    Raises:
        ValueError: no folder at `path`, or a model type without a native ember family.
        CheckpointError: `path` holds no checkpoint, or one without a model config.
    """
    family, model, tokenizer = saved_model(path)
    data = cfg.data
    if data.tokenizer == "model" and data.tokenizer_path is None and tokenizer:
        data = dataclasses.replace(data, tokenizer_path=tokenizer)
    return dataclasses.replace(cfg, family=family, model=model, init_from=path, data=data)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
"""A Hugging Face folder holding one of these ships its own tokenizer."""


def _saved_tokenizer(path: str) -> Optional[str]:
    """The folder of the tokenizer the weights at `path` were trained with (None: none, or bytes / a BPE)."""
    if hf_folder_config(path) is not None:
        return path if any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES) else None
    try:
        return saved_model(path)[2]
    except (ValueError, OSError, LookupError):  # no checkpoint, a damaged one: check_init_from names it first
        return None


def with_saved_tokenizer(cfg: Any, *, chosen: bool) -> Any:
    """`cfg` (a `TrainConfig`) reading the tokenizer its `--init_from` weights were trained with: a Hugging
    Face folder's own, or the model tokenizer an ember run read. Unless the command line `chosen` one
    (`--data.tokenizer` / `--data.tokenizer_path`): then `cfg` as it is, as asked."""
    data = cfg.data
    if not cfg.init_from or data.tokenizer_path is not None or (chosen and data.tokenizer != "model"):
        return cfg
    folder = _saved_tokenizer(cfg.init_from)
    if folder is None:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(data, tokenizer="model", tokenizer_path=folder))


def check_init_from(path: str, family: str, config: Any, *, config_name: Optional[str] = None) -> None:
    """Raise unless `path` holds a model of `family` with `config`'s architecture (cheap: no weights read).

    `config` is the family's config dataclass, or its `to_dict` (`model_info(...)["config"]`);
    `config_name` the run config it came from (`--config`), which the fix then does not name again.

    Raises:
        ValueError: a Hugging Face folder of another architecture, or a model type without a native family.
        CheckpointError: an ember checkpoint of another model, or no checkpoint at `path`.
    """
    from ember.core.checkpoint import CheckpointError

    configured = config if isinstance(config, Mapping) or config is None else to_dict(config)
    hf = hf_folder_config(path)
    if hf is not None:
        saved_family, saved = _hf_model(path, hf)
        message = refusal(f"--init_from {path}", "folder", saved_family, saved, family, configured or {}, config_name)
        if message:
            raise ValueError(message)
        return
    from ember.core.checkpoint import CheckpointManager
    from ember.launch.ckpt_tools import checkpoint_root

    with CheckpointManager(checkpoint_root(path), read_only=True) as ckpt:
        info = ckpt.read_meta().model or {}
    if info.get("family") and info.get("config") and configured:
        message = refusal(f"--init_from {path}", "checkpoint", info["family"], info["config"], family, configured,
                          config_name)
        if message:
            raise CheckpointError(message)


def load_initial_params(path: str, model: Any, *, model_info: Mapping[str, Any],
                        device: Any = "cpu") -> Params:
    """The params of `model` stored at `path` (see the module docstring), on `device`.

    Args:
        path: a Hugging Face model folder, an ember run directory (`--out`) or its `checkpoints/`.
        model: the configured ember model; the params come back in its layout and dtypes.
        model_info: the configured model's description (`ember.core.checkpoint.model_info`), checked
            against the checkpoint's.
        device: where the tensors go.

    Raises:
        ValueError: the folder holds another architecture (each differing field named, and the
            flags to set), or a model type without a native ember family.
        CheckpointError: the checkpoint is missing, damaged, or of another model.
    """
    check_init_from(path, model_info["family"], model_info.get("config"))
    if hf_folder_config(path) is not None:
        from ember.core import pytree
        from ember.core.device import to_device
        from ember.models._safetensors import read_safetensors_folder
        from ember.models.hf import params_from_hf

        params = params_from_hf(read_safetensors_folder(path, device="cpu"), model.config)
        params = pytree.tree_map(lambda t, like: t.to(like.dtype), params, model.param_shapes())
        return to_device(params, device)
    from ember.core.checkpoint import CheckpointManager
    from ember.launch.ckpt_tools import checkpoint_root

    from ember.launch.ckpt_tools import lora_of_run

    with CheckpointManager(checkpoint_root(path), read_only=True) as ckpt:
        adapted = lora_of_run(model, ckpt.read_meta().config)  # a LoRA run: its adapters merged in
        with torch.device("meta"):
            like = adapted.param_shapes() if adapted else model.init(random.key(0))  # shapes only
        params = ckpt.restore_params(like=like, device=device, model_info=model_info)
        return adapted.merged(params) if adapted else params

