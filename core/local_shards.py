"""DTensor leaves as their local shards and back: what a function that runs on plain tensors does with them.

Public names: `Layout`, `is_dtensor`, `has_dtensor`, `to_local`, `rewrap`.

`to_local(leaves)` hands back each DTensor leaf's local shard and its `Layout` (mesh, placements,
global shape and stride); `rewrap` builds the DTensors again (`DTensor.from_local`, no check). `jit`
traces a DTensor step on the shards this way (`jit_backends/dtensor_local.py`), and remat's barrier
runs its op on them. Nothing here imports torch.distributed: while nothing has, no leaf is a DTensor.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, List, Optional, Tuple

from torch import Tensor

__all__ = ["Layout", "has_dtensor", "is_dtensor", "rewrap", "to_local"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a DTensor lives: enough to rebuild it from its local shard."""

    mesh: Any
    placements: Tuple[Any, ...]
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]

    def wrap(self, local: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)


def _dtensor_class() -> Optional[type]:
    """`DTensor`, or None while nothing has imported it (then no argument can be one)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_dtensor(x: Any) -> bool:
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(x, dtensor)


def has_dtensor(leaves: List[Any]) -> bool:
    dtensor = _dtensor_class()
    return dtensor is not None and any(isinstance(x, dtensor) for x in leaves)


def to_local(leaves: List[Any]) -> Tuple[List[Any], Tuple[Optional[Layout], ...]]:
    """Each DTensor leaf as its local shard, and per leaf its `Layout` (None for other leaves)."""
    dtensor = _dtensor_class()
    local, layouts = [], []
    for x in leaves:
        if dtensor is not None and isinstance(x, dtensor):
            layouts.append(Layout(x.device_mesh, tuple(x.placements), tuple(x.shape), tuple(x.stride())))
            local.append(x.to_local())
        else:
            layouts.append(None)
            local.append(x)
    return local, tuple(layouts)


def rewrap(leaves: List[Any], layouts: Tuple[Optional[Layout], ...]) -> List[Any]:
    return [x if layout is None else layout.wrap(x) for x, layout in zip(leaves, layouts)]
