"""DTensor arguments on the traced path: trace the step on the local shards, rewrap outside.

A step over DTensor state is traced with `make_fx` like any other: its DTensor arguments enter the
graph as their local shards and are rewrapped (`DTensor.from_local` with the recorded mesh,
placements, global shape and stride) inside the traced function, so DTensor's dispatch runs at
trace time and the graph holds the local ops and functional collectives, as `torch.export` does.
DTensor outputs leave as local shards plus their layout, and are rewrapped after the compiled call.
Layouts are part of the graph's signature: a new placement compiles a new graph.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from ..local_shards import Layout, rewrap, to_local
from ..pytree import tree_flatten, tree_unflatten

__all__ = ["local_entry"]


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
