"""Which device a backend computes on, and moving pytrees there.

Public names: `device_for`, `to_device`.

Example:
    >>> import torch
    >>> device_for("inductor")
    device(type='cpu')
    >>> to_device({"w": torch.ones(1)}, "cpu")["w"].device
    device(type='cpu')
"""

from __future__ import annotations

from typing import Literal

import torch

from .pytree import tree_map
from .types import PyTree

__all__ = ["device_for", "to_device"]

Backend = Literal["eager", "inductor", "xla"]


def device_for(backend: Backend) -> torch.device:
    """The device `ember.core.jit(..., backend=backend)` expects its tensors on.

    `eager` and `inductor` use the first CUDA GPU when one is visible, else the CPU; `xla` uses
    torch_xla's default device (a TPU core, a GPU, or a virtual CPU device with PJRT_DEVICE=CPU).
    """
    if backend == "xla":
        from .xla import require_torch_xla

        return require_torch_xla("backend='xla'").device()
    if backend not in ("eager", "inductor"):
        raise ValueError(f"backend must be one of 'eager', 'inductor', 'xla', got {backend!r}.")
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def to_device(tree: PyTree, device: torch.device | str) -> PyTree:
    """Every tensor leaf of `tree` moved to `device` (leaves already there are kept as they are)."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)
