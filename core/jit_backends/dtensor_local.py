"""DTensor arguments on the traced path: trace the step on the local shards, rewrap outside.

A step over DTensor state is traced with `make_fx` like any other: its DTensor arguments enter the
graph as their local shards and are rewrapped (`DTensor.from_local` with the recorded mesh,
placements, global shape and stride) inside the traced function, so DTensor's dispatch runs at
trace time and the graph holds the local ops and functional collectives, as `torch.export` does.
DTensor outputs leave as local shards plus their layout, and are rewrapped after the compiled call.
Layouts are part of the graph's signature: a new placement compiles a new graph.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, List, Optional, Tuple

from torch import Tensor

from ..pytree import tree_flatten, tree_unflatten

__all__ = ["Layout", "has_dtensor", "local_entry", "rewrap", "to_local"]


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


def local_entry(entry: Callable[..., Tuple[Any, bool]]) -> Callable[..., Tuple[Any, bool]]:
    """`entry` over local shards: `(layouts, args, kwargs) -> ((out as locals, out layouts), ok)`."""

    def run(layouts: Tuple[Optional[Layout], ...], args: Any, kwargs: Any) -> Tuple[Any, bool]:
        leaves, spec = tree_flatten((args, kwargs))
        args, kwargs = tree_unflatten(rewrap(leaves, layouts), spec)
        out, ok = entry(*args, **kwargs)
        if not ok:
            return out, False
        out_leaves, out_spec = tree_flatten(out)
        local, out_layouts = to_local(out_leaves)
        return (tree_unflatten(local, out_spec), out_layouts), True

    return run
