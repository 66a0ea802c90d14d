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
their process already and move nowhere. A plain tensor (one device) and a torch_xla tensor, whose SPMD
partitioner places the work from the shardings it propagates, go straight to `fn`.

Example:
    >>> import torch
    >>> on_whole_axes(lambda m: m / m.norm(dim=(-2, -1), keepdim=True), torch.ones(2, 3, 4), (1, 2)).shape
    torch.Size([2, 3, 4])
"""

from __future__ import annotations

from typing import Any, Callable, List, Literal, Optional, Sequence

from torch import Tensor

from ..local_shards import Layout, is_dtensor

__all__ = ["WholeAxesPlacement", "on_whole_axes"]

WholeAxesPlacement = Literal["owner", "gather"]


def _laid_out(x: Any, whole: Sequence[int], placement: WholeAxesPlacement) -> List[Any]:
    """`x`'s placements with no split of a `whole` axis: that split moved to axis 0 (`"owner"`, where the
    stack divides evenly) or dropped (`"gather"`, and any pending sum made whole)."""
    from torch.distributed.tensor import Replicate, Shard

    stack = 0 if 0 not in whole else None
    split = 1  # how many pieces axis 0 is cut into so far
    for i, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim % x.ndim == stack:
            split *= x.device_mesh.size(i)
    out = []
    for i, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim % x.ndim in whole:
            size = x.device_mesh.size(i)
            if placement == "owner" and stack is not None and x.shape[stack] % (split * size) == 0:
                out.append(Shard(stack))
                split *= size
                continue
            out.append(Replicate())
        else:
            out.append(Replicate() if p.is_partial() else p)
    return out


def on_whole_axes(fn: Callable[[Tensor], Tensor], x: Tensor, whole: Sequence[int], *,
                  placement: Optional[WholeAxesPlacement] = None) -> Tensor:
    """`fn(x)` for an `fn` that maps each slice along `whole` (axes of `x`) on its own, with `x`'s layout.

    `fn` must return a tensor of `x`'s shape; on a DTensor it runs on this process's whole slices, as plain
    tensors (any other tensor it reads must be plain too: a replicated DTensor's `to_local()`).
    """
    if placement not in (None, "owner", "gather"):
        raise ValueError(f"on_whole_axes: placement must be 'owner', 'gather' or None (the mesh's default), got "
                         f"{placement!r}.")
    if not is_dtensor(x):
        return fn(x)
    if placement is None:
        placement = "gather" if x.device_mesh.device_type == "cpu" else "owner"
    whole = tuple(sorted(a % x.ndim for a in whole))
    want = _laid_out(x, whole, placement)
    mesh, source = x.device_mesh, tuple(x.placements)
    laid = x if tuple(want) == source else x.redistribute(mesh, want)
    local = fn(laid.to_local())
    if local.shape != laid.to_local().shape:
        raise ValueError(f"on_whole_axes: fn must keep its input's shape {tuple(laid.to_local().shape)}, "
                         f"got {tuple(local.shape)}.")
    out = Layout(mesh, tuple(want), tuple(laid.shape), tuple(laid.stride())).wrap(local)
    return out if tuple(want) == source else out.redistribute(mesh, source)
