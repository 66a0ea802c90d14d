"""`pipeline` on DTensor: each process's share of the layers, the batch and the outputs, as plain tensors.

The stacked layers are split by their first dimension over `pp` (`Shard(0)`, the checkpoint's layout), so a
process holds a block of consecutive layers. With one repeat that block is its stages' layers. With `R`
repeats stage `s` runs layers of every repeat (`[R, S, layers per stage]`), so the blocks are exchanged once
per step: one all-to-all over `pp` gives each process its stages' layers, and its backward returns their
gradients to the layers' own layout.

Beside `pp`, an axis that splits the batch's rows (`dp`, `fsdp`, `ep`) leaves each process its rows, plain,
and the layers gathered over it once per step. An axis that splits within the rows (`tp` the heads and
features, `cp` the sequence) stays: each layer runs on DTensors of that slice of the mesh (`in_stage`),
its layer's shares and the microbatch wrapped on the way in, the output made plain on the way out, so
the layer's own rules (a tensor-parallel matmul, context attention) run as they do outside the pipeline.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..local_shards import has_dtensor
from ..pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from ..types import PyTree
from .dtensor import redistribute
from .pipeline_stages import PP, PipelineError, Stages
from .sharding import Sharding, current_sharding, use_sharding

__all__ = ["in_stage", "local_inputs", "stage_layers"]


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
    from ..compat.functional_collectives import all_to_all_single_autograd

    n, size = held.shape[0], len(order)
    sends = [[g - rank * n for g in order[q] if g // n == rank] for q in range(size)]  # to q, in q's order
    comes = [[g for g in order[rank] if g // n == q] for q in range(size)]  # from q, in this process's order
    index = lambda rows: torch.tensor(rows, dtype=torch.int64, device=held.device)  # noqa: E731
    out = all_to_all_single_autograd(held.index_select(0, index([i for s in sends for i in s])).contiguous(),
                                     [len(c) for c in comes], [len(s) for s in sends], group)
    arrived = [g for c in comes for g in c]
    return out.index_select(0, index([arrived.index(g) for g in order[rank]]))


def local_inputs(layer_fn: Callable[..., Any], params: PyTree, x: Any, extras: Dict[str, Any], totals: PyTree,
                 stages: int, repeats: int) -> Tuple[Any, ...]:
    """`(layer_fn, params, x, extras, totals, place, wrap)` as plain tensors with where their stages sit; from
    DTensors, this process's shares (its stages' layers, `[repeats * local stages * layers per stage, ...]` in
    that order), `wrap`, which makes the output a DTensor again (None for plain inputs), and `layer_fn` run on
    DTensors of the axes that split more than the batch (`tp`, `cp`: `in_stage`)."""
    leaves = tree_leaves(params)
    if not has_dtensor([*leaves, x, *extras.values()]):
        return layer_fn, params, x, extras, totals, Stages(stages), None
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = next(t for t in [x, *leaves, *extras.values()] if isinstance(t, DTensor)).device_mesh
    names = mesh.mesh_dim_names or ()
    dim = names.index(PP) if PP in names else None
    wrong = [t for t in [x, *extras.values()] if isinstance(t, DTensor) and dim is not None
             and t.placements[dim] != Replicate()]
    if dim is not None:
        wrong += [t for t in leaves if isinstance(t, DTensor) and t.placements[dim] not in (Shard(0), Replicate())]
    if dim is None or wrong:
        raise PipelineError(
            f"pipeline on DTensor takes the stacked layers split by their first dimension over the mesh axis 'pp' "
            f"and the activations whole over it; got a mesh with axes {names} and {len(wrong)} tensor(s) laid out "
            f"otherwise, e.g. {wrong[0].placements if wrong else None}; shard the layers with the rule "
            f"('layers', 'pp').")
    size, rank, group = mesh.size(dim), mesh.get_local_rank(dim), mesh.get_group(dim)
    if stages % size:
        raise PipelineError(f"{stages} stages do not split over pp={size}: use a multiple of {size} stages.")
    order = stage_layers(leaves[0].shape[0], stages, repeats, size)

    def summed(t):  # a pending sum made whole: each process's share of it is then a value of its own
        if not isinstance(t, DTensor) or not any(p.is_partial() for p in t.placements):
            return t
        return redistribute(t, mesh, [Replicate() if p.is_partial() else p for p in t.placements])

    x, extras = summed(x), {k: summed(v) for k, v in extras.items()}
    rows = list(x.placements) if isinstance(x, DTensor) else [Replicate()] * len(names)
    # beside pp: batch axes split the rows; the others (tp, cp) split within them and stay DTensors in the stages
    inner = [n for i, n in enumerate(names) if n != PP and mesh.size(i) > 1 and rows[i] != Shard(0)]

    def kept(t, n, otherwise):  # t's placement on axis n if the stages keep it, else `otherwise`
        return t.placements[names.index(n)] if n in inner else otherwise

    def share(t):  # this process's stages' layers, gathered over the batch axes once per step (FSDP)
        if isinstance(t, DTensor) and t.placements[dim] == Shard(0):
            split = [Shard(0) if n == PP else kept(t, n, Replicate()) for n in names]
            # a layer's gradient on this process sums over its rows of the batch: partial over the axes that split
            # them; back in the layers' own layout (reduce-scattered over fsdp, all-reduced over dp)
            grads = [Shard(0) if n == PP else kept(t, n, Partial() if r == Shard(0) else Replicate())
                     for n, r in zip(names, rows)]
            held = redistribute(t, mesh, split).to_local(grad_placements=grads)
            return held if repeats == 1 else _exchange(held, order, rank, group)
        t = t.full_tensor() if isinstance(t, DTensor) else t  # held whole along the layers (a key per layer)
        return t.index_select(0, torch.tensor(order[rank], device=t.device))

    def local(t):  # whole over pp, but only the first stage's process reads it: the others add a zero gradient
        if not isinstance(t, DTensor):
            return t
        return t.to_local(grad_placements=[Partial() if n == PP else p for n, p in zip(names, t.placements)])

    def wrap(y, whole=False):  # laid out as the input (whole over pp, the rows as `x`'s), or whole everywhere
        placements = [Replicate()] * len(names) if whole else x.placements
        shape = y.shape if whole else x.shape  # the output is this process's share of x's shape
        return DTensor.from_local(y, mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=tuple(torch.empty(shape, device="meta").stride()))

    batch_groups = [(mesh.get_group(i), mesh.get_local_rank(i), mesh.size(i))
                    for i, (n, r) in enumerate(zip(names, rows)) if n != PP and r == Shard(0)]
    # the totals come back whole on every process, so the gradient each process gets for the given ones is whole
    whole = tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, totals)
    place = Stages(stages, group, rank, size, batch_groups=batch_groups)
    if inner:
        def layout(t):  # on the stages' axes; a layer's dimension d is the stack's d + 1
            if not isinstance(t, DTensor):
                return None
            return [Shard(p.dim - 1) if isinstance(p, Shard) else p for p in (kept(t, n, None) for n in inner)]

        layer_fn = in_stage(layer_fn, inner, [layout(t) for t in leaves], [kept(x, n, None) for n in inner],
                            {k: [kept(v, n, None) for n in inner] if isinstance(v, DTensor) else None
                             for k, v in extras.items()})
        place.vmap = False  # the stages run one after another: a DTensor does not batch under vmap
    return (layer_fn, tree_map(share, params), local(x), {k: local(v) for k, v in extras.items()}, whole, place,
            wrap)


def in_stage(layer_fn: Callable[..., Any], axes: List[str], layer_layout: List[Optional[List[Any]]],
             rows: List[Any], extras: Dict[str, Optional[List[Any]]]) -> Callable[..., Any]:
    """`layer_fn` on plain tensors (one layer's shares, a microbatch's rows) that runs it on DTensors over the
    active mesh's `axes` beside `pp` and the batch axes (`tp`, `cp`), under its layout restricted to them, so the
    layer's constraints and context attention work as they do outside the pipeline.

    Args:
        layer_layout: per leaf of one layer's params, its placements on `axes` (None: a plain tensor, a key).
        rows: the activations' placements on `axes`; `extras` those of each batch tensor (None: plain).
    """
    from torch.distributed.tensor import DTensor, Replicate

    outer = current_sharding()
    if outer is None or outer.mesh.backend != "dtensor":
        raise PipelineError(f"pipeline on DTensor with the activations split over {axes} (beside pp and the batch) "
                            f"runs inside use_sharding of their mesh: enter it around the step.")
    lowering = outer.lowering.slice(axes)
    sharding = Sharding(lowering.mesh, outer.layout.restrict_to(axes), lowering=lowering)
    sub, whole = lowering.device_mesh, [Replicate()] * len(axes)

    def on_mesh(t, placements):
        return t if placements is None else DTensor.from_local(t, sub, placements, run_check=False)

    def plain(t, placements):
        return redistribute(t, sub, placements).to_local() if isinstance(t, DTensor) else t

    def run(p: PyTree, carry: Any, **batch: Tensor) -> Any:
        flat, spec = tree_flatten(p)
        p = tree_unflatten([on_mesh(t, lay) for t, lay in zip(flat, layer_layout)], spec)
        h, totals = (carry, None) if isinstance(carry, Tensor) else carry
        h = on_mesh(h, rows)
        batch = {k: on_mesh(v, extras.get(k)) for k, v in batch.items()}
        with use_sharding(sharding):
            out = layer_fn(p, h if totals is None else (h, totals), **batch)
        if totals is None:
            return plain(out, rows)
        return plain(out[0], rows), tree_map(lambda t: plain(t, whole), out[1])

    return run
