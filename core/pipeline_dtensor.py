"""`pipeline` on DTensor: each process's share of the layers, the batch and the outputs, as plain tensors.

The stacked layers are split by their first dimension over `pp` (`Shard(0)`, the checkpoint's layout), so a
process holds a block of consecutive layers. With one repeat that block is its stages' layers. With `R`
repeats stage `s` runs layers of every repeat (`[R, S, layers per stage]`), so the blocks are exchanged once
per step: one all-to-all over `pp` gives each process its stages' layers, and its backward returns their
gradients to the layers' own layout.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

from .pipeline import PP, PipelineError, _Stages
from .pytree import tree_leaves, tree_map
from .types import PyTree

__all__ = ["local_inputs", "stage_layers"]


def stage_layers(n_layers: int, stages: int, repeats: int, processes: int) -> List[List[int]]:
    """For each process of `pp`, the layers its stages run, in the order `pipeline` views them: repeat, then
    stage, then layer within the stage.

    Example:
        >>> stage_layers(8, 2, 2, 2)         # 2 stages of 2 layers, 2 repeats: stage 0 runs 0, 1, 4, 5
        [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    per_stage, local = n_layers // (stages * repeats), stages // processes
    return [[(r * stages + s) * per_stage + j for r in range(repeats) for s in range(p * local, (p + 1) * local)
             for j in range(per_stage)] for p in range(processes)]


def _exchange(held: Tensor, order: List[List[int]], rank: int, group: Any) -> Tensor:
    """This process's block of layers (`held`, layers `rank * n` to `(rank + 1) * n`) exchanged over `pp` for
    the layers of `order[rank]`, in that order: one all-to-all, whose backward sends the gradients back."""
    from .compat.functional_collectives import all_to_all_single_autograd

    n, size = held.shape[0], len(order)
    sends = [[g - rank * n for g in order[q] if g // n == rank] for q in range(size)]  # to q, in q's order
    comes = [[g for g in order[rank] if g // n == q] for q in range(size)]  # from q, in this process's order
    index = lambda rows: torch.tensor(rows, dtype=torch.int64, device=held.device)  # noqa: E731
    out = all_to_all_single_autograd(held.index_select(0, index([i for s in sends for i in s])).contiguous(),
                                     [len(c) for c in comes], [len(s) for s in sends], group)
    arrived = [g for c in comes for g in c]
    return out.index_select(0, index([arrived.index(g) for g in order[rank]]))


def local_inputs(params: PyTree, x: Any, extras: Dict[str, Any], totals: PyTree, stages: int,
                 repeats: int) -> Tuple[Any, ...]:
    """`(params, x, extras, totals, place, wrap)` as plain tensors with where their stages sit; from DTensors,
    this process's shares (its stages' layers, `[repeats * local stages * layers per stage, ...]` in that
    order) and `wrap`, which makes the output a DTensor again (None for plain inputs)."""
    from .jit_backends.dtensor_local import has_dtensor

    leaves = tree_leaves(params)
    if not has_dtensor([*leaves, x, *extras.values()]):
        return params, x, extras, totals, _Stages(stages), None
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from .partition_specs.dtensor import redistribute

    mesh = next(t for t in [x, *leaves, *extras.values()] if isinstance(t, DTensor)).device_mesh
    names = mesh.mesh_dim_names or ()
    split = [Shard(0) if n == PP else Replicate() for n in names]

    def batch_layout(t) -> bool:  # whole over pp, split by rows (or whole) over the batch axes
        return all(p == Replicate() if n == PP else p in (Replicate(), Shard(0)) for n, p in zip(names, t.placements))

    dim = names.index(PP) if PP in names else None
    wrong = [t for t in [x, *extras.values()] if isinstance(t, DTensor) and not batch_layout(t)]
    if dim is not None:
        wrong += [t for t in leaves if isinstance(t, DTensor) and t.placements[dim] not in (Shard(0), Replicate())]
    if dim is None or wrong:
        raise PipelineError(
            f"pipeline on DTensor takes the stacked layers split by their first dimension over the mesh axis 'pp' "
            f"and the activations whole over it (split by rows over batch axes); got a mesh with axes {names} and "
            f"{len(wrong)} tensor(s) laid out otherwise, e.g. {wrong[0].placements if wrong else None}; shard the "
            f"layers with the rule ('layers', 'pp').")
    size, rank, group = mesh.size(dim), mesh.get_local_rank(dim), mesh.get_group(dim)
    if stages % size:
        raise PipelineError(f"{stages} stages do not split over pp={size}: use a multiple of {size} stages.")
    order = stage_layers(leaves[0].shape[0], stages, repeats, size)

    rows = list(x.placements) if isinstance(x, DTensor) else [Replicate()] * len(names)
    # a layer's gradient on this process sums over its rows of the batch: partial over the axes that split them
    layer_grads = [Shard(0) if n == PP else Partial() if r == Shard(0) else Replicate() for n, r in zip(names, rows)]

    def share(t):  # this process's stages' layers, gathered over the other axes once per step (FSDP)
        if isinstance(t, DTensor) and t.placements[dim] == Shard(0):
            # backward: the gradient to the layers' own layout (reduce-scattered over fsdp, all-reduced over dp)
            held = redistribute(t, mesh, split).to_local(grad_placements=layer_grads)
            return held if repeats == 1 else _exchange(held, order, rank, group)
        t = t.full_tensor() if isinstance(t, DTensor) else t  # held whole along the layers (a key per layer)
        return t.index_select(0, torch.tensor(order[rank], device=t.device))

    def local(t):  # whole over pp, but only the first stage's process reads it: the others add a zero gradient
        if not isinstance(t, DTensor):
            return t
        return t.to_local(grad_placements=[Partial() if n == PP else p for n, p in zip(names, t.placements)])

    def wrap(y, whole=False):  # laid out as the input (whole over pp, the rows as `x`'s), or whole everywhere
        placements = [Replicate()] * len(names) if whole else x.placements
        shape = y.shape if whole else (x.shape[0], *y.shape[1:])
        return DTensor.from_local(y, mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=tuple(torch.empty(shape, device="meta").stride()))

    batch_groups = [(mesh.get_group(i), mesh.get_local_rank(i), mesh.size(i))
                    for i, (n, r) in enumerate(zip(names, rows)) if n != PP and r == Shard(0)]
    # the totals come back whole on every process, so the gradient each process gets for the given ones is whole
    whole = tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, totals)
    return (tree_map(share, params), local(x), {k: local(v) for k, v in extras.items()}, whole,
            _Stages(stages, group, rank, size, batch_groups=batch_groups), wrap)
