"""The model, params and tokenizer an evaluation reads from a path: a Hugging Face folder or an ember run.

Public names: `load_model`, `xla_sharding`.

    model, params, tokenizer = load_model("runs/a/hf")   # `launch/ckpt.py export --hf` output, any HF folder
    model, params, tokenizer = load_model("runs/a")      # a run directory (--out) or its checkpoints/: latest step

A Hugging Face folder of a native family is read by `ember.models.from_hf` (no transformers); another
causal LM folder goes through the `from_torch` bridge (needs transformers). A run directory gives its
latest step's params (a LoRA run's adapters merged in) and the tokenizer the run read: a model folder's,
the byte tokenizer, or the BPE it trained on its corpus (trained again, the same way). `xla_sharding(mesh)`
is the torch_xla SPMD layout `launch/eval.py --backend xla --mesh ...` places the params by.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Tuple

__all__ = ["load_model", "xla_sharding"]


def _folder_tokenizer(path: str) -> Any:
    from ember.data import load_model_tokenizer

    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ValueError(f"{path} holds a model but no tokenizer.json; an evaluation needs the tokenizer the model "
                         f"was trained with: copy its tokenizer files into {path} (launch/ckpt.py export --hf does).")
    return load_model_tokenizer(path)


def _run_tokenizer(path: str, folder: Any) -> Any:
    """The tokenizer of the ember run at `path` (its saved data config), or of the model `folder` it read."""
    if folder:
        return _folder_tokenizer(folder)
    from ember.core.checkpoint import CheckpointManager
    from ember.data import build_tokenizer
    from ember.data.config import DataConfig
    from ember.launch.ckpt_tools import checkpoint_root

    with CheckpointManager(checkpoint_root(path), read_only=True) as ckpt:
        saved = (ckpt.read_meta().config or {}).get("data") or {}
    names = {f.name for f in dataclasses.fields(DataConfig)}
    return build_tokenizer(DataConfig(**{k: v for k, v in saved.items() if k in names and not isinstance(v, dict)}))


def load_model(path: str, *, device: Any = "cpu") -> Tuple[Any, Any, Any]:
    """`(model, params, tokenizer)` of the folder or run at `path` (see the module docstring).

    Raises:
        ValueError: no such path, a folder without a tokenizer, a model type ember cannot build.
        CheckpointError: a run directory without (intact) checkpoints.
    """
    from ember.core import to_device
    from ember.launch.init_from import hf_folder_config, saved_model

    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such folder; pass a Hugging Face model folder (config.json + *.safetensors + "
                         f"tokenizer.json), an exported run (launch/ckpt.py export --hf) or a run directory (--out).")
    hf = hf_folder_config(path)
    if hf is not None:
        from ember.models import SUPPORTED_HF_MODELS, from_hf

        if hf["model_type"] in SUPPORTED_HF_MODELS:
            model, params = from_hf(path)
        else:
            import transformers

            from ember.models import from_torch

            model, params = from_torch(transformers.AutoModelForCausalLM.from_pretrained(path))
        return model, to_device(params, device), _folder_tokenizer(path)
    from ember.core.checkpoint import model_info
    from ember.launch.init_from import load_initial_params
    from ember.models import build_model

    family, config, folder = saved_model(path)
    model = build_model(family, config)
    params = load_initial_params(path, model, model_info=model_info(family, config), device=device)
    return model, params, _run_tokenizer(path, folder)


def xla_sharding(mesh_text: str) -> Any:
    """`--backend xla --mesh ...`: one process, torch_xla SPMD over every XLA device (as launch/tpu_pod.py)."""
    import torch_xla.runtime as xr

    from ember.core.mesh import Mesh
    from ember.core.partition_specs import MESH_ORDER, Sharding, for_mesh
    from ember.core.partition_specs.xla import enable_spmd

    enable_spmd()  # before the runtime starts (counting devices starts it)
    mesh = Mesh.parse(mesh_text, devices=xr.global_runtime_device_count(), backend="xla").in_order(MESH_ORDER)
    return Sharding(mesh, for_mesh(mesh.names))
