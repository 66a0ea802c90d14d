"""Safetensors files: writing one with the mode `open(path, "w")` would give it (the umask's), and
reading a Hugging Face folder's weights (one file, or the shards its index lists).

Private module of `ember.models`; `save_safetensors` is public as `ember.models.hf.save_safetensors`.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Mapping, Optional, Union

from torch import Tensor

__all__ = ["read_safetensors_folder", "save_safetensors"]


def _umask() -> int:
    """The process's umask; read from /proc where it exists (`os.umask` only reads it by setting it)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: Mapping[str, Tensor], path: Union[str, "os.PathLike[str]"], *,
                     metadata: Optional[Dict[str, str]] = None) -> None:
    """`safetensors.torch.save_file`, leaving the file with the mode the umask gives (0644 under 022).

    safetensors writes a private temporary file (mode 0600) and renames it into place; the mode is
    set afterwards, as `open(path, "w")` would have made it.
    """
    from safetensors.torch import save_file

    save_file(dict(tensors), os.fspath(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def read_safetensors_folder(path: str, *, device: str) -> Dict[str, Tensor]:
    """Every tensor of the folder's `model.safetensors`, or of the shards `model.safetensors.index.json` lists."""
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
