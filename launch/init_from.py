"""`--init_from PATH`: a run's first parameters from a Hugging Face folder or an ember checkpoint.

Public names: `load_initial_params`.

A Hugging Face folder (`config.json` with a `model_type`, safetensors weights) of a native family is
read with `ember.models.from_hf`'s mapping, into the configured layer layout (`scan_layers` either
way) and the configured parameter dtype (a bf16 folder still trains float32 master weights). An ember
run directory or checkpoint directory gives the params of its latest step (no optimizer state, no
step count: the run starts at step 0), restored into the configured model, so its `scan_layers` must
be the checkpoint's. Either way the saved architecture is checked against the configured one first,
and every difference is named.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Mapping, Optional

import torch

from ember.core import random
from ember.core.types import Params

__all__ = ["load_initial_params"]

_FREE_FIELDS = ("scan_layers", "remat", "loss_chunk_size", "init_std", "max_seq_len", "dropout")
"""Config fields that may differ from the saved model: they change neither the params nor their meaning."""


def _hf_config(path: str) -> Optional[Dict[str, Any]]:
    """The folder's `config.json` if it is a Hugging Face model's (it names a `model_type`), else None."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as fh:
        config = json.load(fh)
    return config if isinstance(config, dict) and "model_type" in config else None


def _differences(saved: Any, configured: Any) -> List[str]:
    out = []
    if type(saved) is not type(configured):
        out.append(f"family: {type(saved).__name__} in the folder, {type(configured).__name__} configured")
    names = {f.name for f in dataclasses.fields(saved)} & {f.name for f in dataclasses.fields(configured)}
    for name in sorted(names - set(_FREE_FIELDS)):
        a, b = getattr(saved, name), getattr(configured, name)
        if a != b:
            out.append(f"{name}: {a!r} in the folder, {b!r} configured")
    return out


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
    hf = _hf_config(path)
    if hf is not None:
        from ember.models._safetensors import read_safetensors_folder
        from ember.models.hf import SUPPORTED_HF_MODELS, config_from_hf, params_from_hf

        if hf["model_type"] not in SUPPORTED_HF_MODELS:
            raise ValueError(
                f"--init_from {path}: model_type {hf['model_type']!r} has no native ember family "
                f"({', '.join(sorted(SUPPORTED_HF_MODELS))} do), so launch/train.py cannot build it; it "
                f"trains from Python through the bridge: ember.models.from_hf({path!r})."
            )
        diffs = _differences(config_from_hf(hf), model.config)
        if diffs:
            raise ValueError(
                f"--init_from {path} holds another architecture than the run config: {'; '.join(diffs)}. "
                f"Pick the family's run config with --config and set the differing fields with --model.NAME."
            )
        from ember.core import pytree
        from ember.core.device import to_device

        params = params_from_hf(read_safetensors_folder(path, device="cpu"), model.config)
        params = pytree.tree_map(lambda t, like: t.to(like.dtype), params, model.param_shapes())
        return to_device(params, device)
    from ember.core.checkpoint import CheckpointManager
    from ember.launch.ckpt_tools import checkpoint_root

    with CheckpointManager(checkpoint_root(path), read_only=True) as ckpt:
        with torch.device("meta"):
            like = model.init(random.key(0))  # shapes only
        return ckpt.restore_params(like=like, device=device, model_info=model_info)

