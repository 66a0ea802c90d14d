"""DTensor leaves as their local shards and back: what a function that runs on plain tensors does with them.

Public names: `Layout`, `is_dtensor`, `has_dtensor`, `to_local`, `rewrap`, `local_as`, `local_tensor`, `like`.

`to_local(leaves)` hands back each DTensor leaf's local shard and its `Layout` (mesh, placements,
global shape and stride); `rewrap` builds the DTensors again (`DTensor.from_local`, no check). `jit`
traces a DTensor step on the shards this way (`jit_backends/dtensor_local.py`), a rolled `scan` runs
its loop on them (`Layout.sliced` and `Layout.stacked` give a slice's and a stack's layout), and
remat's barrier runs its op on them. Nothing here imports torch.distributed: while nothing has, no
leaf is a DTensor.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["Layout", "has_dtensor", "is_dtensor", "like", "local_as", "local_tensor", "rewrap", "to_local"]


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

    def sliced(self) -> Optional["Layout"]:
        """The layout of `t[i]` for a DTensor `t` of this layout, or None where dim 0 is split (no local slice)."""
        from torch.distributed.tensor import Partial, Replicate, Shard

        placements = []
        for p in self.placements:
            if type(p) is Shard and p.dim > 0:
                placements.append(Shard(p.dim - 1))
            elif isinstance(p, (Replicate, Partial)):
                placements.append(p)
            else:  # Shard(0), or a strided shard whose slices are not the local slices
                return None
        return Layout(self.mesh, tuple(placements), self.shape[1:], self.stride[1:])

    def stacked(self, n: int) -> Optional["Layout"]:
        """The layout of `n` tensors of this layout stacked along a new dim 0 (contiguous), or None where a
        placement is not one `sliced` undoes."""
        from torch.distributed.tensor import Shard

        placements = tuple(Shard(p.dim + 1) if type(p) is Shard else p for p in self.placements)
        stacked = Layout(self.mesh, placements, (n, *self.shape), _contiguous_strides((n, *self.shape)))
        return stacked if stacked.sliced() is not None else None


def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, size = [], 1
    for n in reversed(shape):
        strides.append(size)
        size *= max(n, 1)
    return tuple(reversed(strides))


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


def local_tensor(x: Tensor) -> Tensor:
    """The tensor a DTensor holds, itself (no view, no autograd node): what ops on it read."""
    with torch.no_grad():
        return x.to_local()


def local_as(tensors: List[Tensor], layouts: Tuple[Optional[Layout], ...]) -> List[Tensor]:
    """Each DTensor of `tensors` placed as its layout says (a collective where it is not), as its shard."""
    out = []
    for t, layout in zip(tensors, layouts):
        if layout is not None:
            if tuple(t.placements) != layout.placements:
                t = t.redistribute(layout.mesh, layout.placements)
            t = t.to_local()
        out.append(t)
    return out


def like(x: Tensor, dtensor: Tensor) -> Tensor:
    """A plain tensor, the same on every process, as a DTensor on `dtensor`'s mesh and placements."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh, placements = dtensor.device_mesh, tuple(dtensor.placements)
    whole = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    local = whole.redistribute(mesh, [Replicate() if p.is_partial() else p for p in placements]).to_local()
    # a sum over processes: the value on the first process of each summed mesh dim, zeros elsewhere
    coordinate = mesh.get_coordinate()
    if any(p.is_partial() and p.reduce_op == "sum" and coordinate[d] != 0 for d, p in enumerate(placements)):
        local = torch.zeros_like(local)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=dtensor.shape, stride=dtensor.stride())


def rewrap(leaves: List[Any], layouts: Tuple[Optional[Layout], ...]) -> List[Any]:
    return [x if layout is None else layout.wrap(x) for x, layout in zip(leaves, layouts)]
