"""Writing a safetensors file with the mode `open(path, "w")` would give it (the umask's).

Private module of `ember.models`; `save_safetensors` is public as `ember.models.hf.save_safetensors`.
"""

from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Union

from torch import Tensor

__all__ = ["save_safetensors"]


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
