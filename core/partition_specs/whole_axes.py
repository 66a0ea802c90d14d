"""`on_whole_axes`: run a function that needs some axes of a sharded tensor whole (Muon's Newton-Schulz needs
each matrix whole), placed so that it equals the function on the full tensor on one device.

Public names: `on_whole_axes`, `WholeAxesPlacement`.

A DTensor whose whole axes are split (an FSDP or tensor-parallel matrix) is laid out again first, by one of
two placements (collectives per step for each in BENCHMARKS.md, "Muon on meshes"); the default is `"owner"`
on a mesh whose process group has an all-to-all (NCCL), `"gather"` on a CPU mesh (gloo has none, and
DTensor runs each all-to-all as an all-gather there: twice the gather's bytes, measured):

- `"owner"`: each matrix whole on one process. The shards of the whole axes move to the leading
  axis, which stacks matrices (layers, experts): one all-to-all; `fn` runs on this process's matrices; one
  all-to-all moves the result back. Each process computes `1/n` of the matrices. A mesh dimension whose size
  does not divide the stack (or a leaf with no stacking axis) falls back to `"gather"` on that dimension.
- `"gather"`: every process gathers whole matrices (one all-gather), runs `fn` on all of them and keeps its
  own shard of the result (a slice, no collective). Each process computes every matrix.

A split of any other axis (experts under `ep`, layers under a pipeline) is kept: those matrices are whole on
their process already and move nowhere. On torch_xla, given the tensor's logical `axes`, the same placements are
sharding constraints around `fn` (the params rules' spec with the whole axes' split dropped, or moved to the
stacking axis; default `"owner"`: XLA has an all-to-all), and XLA's partitioner emits the same collectives;
without `axes` it places the work itself (it keeps the matrices split and communicates inside `fn`). A plain
tensor (one device) goes straight to `fn`.

Example:
    >>> import torch
    >>> on_whole_axes(lambda m: m / m.norm(dim=(-2, -1), keepdim=True), torch.ones(2, 3, 4), (1, 2)).shape
    torch.Size([2, 3, 4])
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple

from torch import Tensor

from ..local_shards import Layout, is_dtensor
from ..trace_context import here
from .rules import resolve
from .spec import PartitionSpec

__all__ = ["WholeAxesPlacement", "on_whole_axes"]

WholeAxesPlacement = Literal["owner", "gather"]


def _spec_laid_out(spec: PartitionSpec, shape: Sequence[int], whole: Sequence[int], placement: WholeAxesPlacement,
                   mesh_sizes: Dict[str, int]) -> PartitionSpec:
    """`spec` with no split of a `whole` dimension: that split's mesh axes moved to dimension 0 (`"owner"`, where
    the stack divides evenly; in mesh order, `mesh_sizes`' order) or dropped (`"gather"`)."""
    entries = [list(spec.mesh_axes_of(d)) for d in range(len(shape))]
    stack = 0 if 0 not in whole else None
    for d in whole:
        for axis in entries[d]:
            pieces = math.prod([mesh_sizes[a] for a in entries[stack]]) if stack is not None else 0
            if placement == "owner" and stack is not None and shape[stack] % (pieces * mesh_sizes[axis]) == 0:
                entries[stack] = sorted([*entries[stack], axis], key=list(mesh_sizes).index)
        entries[d] = []
    return PartitionSpec(*(tuple(e) or None for e in entries))


def _dtensor_spec(x: Any) -> Tuple[PartitionSpec, Dict[str, int]]:
    """A DTensor's placements as a spec over its mesh's axes (a pending sum reads as whole), and the axes' sizes."""
    from torch.distributed.tensor import Shard

    mesh = x.device_mesh
    names = mesh.mesh_dim_names or tuple(f"mesh_dim{i}" for i in range(mesh.ndim))
    entries: List[List[str]] = [[] for _ in range(x.ndim)]
    for name, p in zip(names, x.placements):
        if isinstance(p, Shard):
            entries[p.dim % x.ndim].append(name)
    return PartitionSpec(*(tuple(e) or None for e in entries)), {n: mesh.size(i) for i, n in enumerate(names)}


def _on_xla(fn: Callable[[Tensor], Tensor], x: Tensor, whole: Sequence[int], axes: Sequence[Optional[str]],
            placement: Optional[WholeAxesPlacement], sharding: Any) -> Tensor:
    """The placement as constraints around `fn`, the split batch axes put first: `fn` may merge its batch axes,
    and a merge keeps a split only where the split axis is the major one (else XLA gathers it)."""
    sizes, low = sharding.mesh.sizes(), sharding.lowering
    spec = resolve(tuple(axes), sharding.layout.params, mesh_sizes=sizes, name=f"parameter {tuple(axes)}")
    batch = [d for d in range(x.ndim) if d not in whole]
    order = [d for d in batch if spec.mesh_axes_of(d)] + [d for d in batch if not spec.mesh_axes_of(d)] + list(whole)
    if list(whole) != list(range(len(batch), x.ndim)):
        order = list(range(x.ndim))  # `fn` reads the whole axes where they are: keep the batch axes' order
    moved = x.permute(order)
    moved_spec = PartitionSpec(*[spec[d] for d in order])
    want = _spec_laid_out(moved_spec, moved.shape, [order.index(d) for d in whole], placement or "owner", sizes)
    out = low.constrain(low.constrain(fn(low.constrain(moved, want)), want), moved_spec)
    return low.constrain(out.permute([order.index(d) for d in range(x.ndim)]), spec)


def on_whole_axes(fn: Callable[[Tensor], Tensor], x: Tensor, whole: Sequence[int], *,
                  placement: Optional[WholeAxesPlacement] = None,
                  axes: Optional[Sequence[Optional[str]]] = None) -> Tensor:
    """`fn(x)` for an `fn` that maps each slice along `whole` (axes of `x`) on its own, with `x`'s layout.

    `fn` must return a tensor of `x`'s shape; on a DTensor it runs on this process's whole slices, as plain
    tensors (any other tensor it reads must be plain too: a replicated DTensor's `to_local()`). `axes`, the
    tensor's logical axes (a parameter's, or its optimizer state's), places the work on torch_xla.
    """
    if placement not in (None, "owner", "gather"):
        raise ValueError(f"on_whole_axes: placement must be 'owner', 'gather' or None (the mesh's default), got "
                         f"{placement!r}.")
    if not is_dtensor(x):
        sharding = here().sharding
        if axes is not None and sharding is not None and sharding.mesh.backend == "xla":
            return _on_xla(fn, x, tuple(sorted(a % x.ndim for a in whole)), axes, placement, sharding)
        return fn(x)
    from .dtensor import placements as placements_of

    if placement is None:
        placement = "gather" if x.device_mesh.device_type == "cpu" else "owner"
    spec, sizes = _dtensor_spec(x)
    want_spec = _spec_laid_out(spec, x.shape, tuple(sorted(a % x.ndim for a in whole)), placement, sizes)
    want = tuple(placements_of(want_spec, list(sizes), ndim=x.ndim))
    mesh, source = x.device_mesh, tuple(x.placements)
    laid = x if want == source else x.redistribute(mesh, want)
    local_in = laid.to_local()
    local = fn(local_in)
    if local.shape != local_in.shape:
        raise ValueError(f"on_whole_axes: fn must keep its input's shape {tuple(local_in.shape)}, "
                         f"got {tuple(local.shape)}.")
    out = Layout(mesh, want, tuple(laid.shape), tuple(laid.stride())).wrap(local)
    return out if want == source else out.redistribute(mesh, source)
