"""Pipeline parallelism as a schedule inside the step: `pipeline` runs a stack of layers as stages.

Public names: `pipeline`, `PipelineSchedule`, `PipelineError`, `bubble_fraction`.

The stacked layer parameters `[L, ...]` are viewed as `[repeats, stages, layers_per_stage, ...]` (one
repeat: today's layout, so checkpoints do not change). Every iteration runs every stage at once
(`vmap` over a `[stages, microbatch, ...]` buffer), then shifts the buffer one stage along, circularly:
what leaves the last stage comes back to the first, for the next repeat or, after the last, as the
output. Microbatches enter stage 0 one per iteration; `repeats * microbatches + stages - 1` iterations
in all. The backward is autodiff of the whole loop (GPipe run in reverse). A stage outside the
schedule's diagonal (the bubble) computes on zeros, whatever its buffer holds, and its result is
never read, so a NaN there reaches no gradient.

On DTensor, with the layer dimension split over the mesh axis `pp` (stage-major: each process holds
its stages' layers), each process runs its own stages on plain tensors and the shift is one
exchange: its last stage's buffer goes to the next process (`all_to_all_single` with one non-zero
split, whose backward is the shift the other way), never an all-gather of the buffer. The output,
held by the first stage's process, is broadcast to every process of `pp`. So far the DTensor form
takes a mesh whose other axes replicate the layers, and one repeat. Under torch_xla SPMD the same code
is one program over every stage: the stage buffer is pinned to `pp` (the rule of `"layers"`), XLA
lowers the shift to a collective-permute, and the layers inside a stage constrain nothing.

Example:
    >>> import torch
    >>> w = torch.randn(4, 3, 3) / 3                        # four layers
    >>> x = torch.randn(8, 3)
    >>> y = pipeline(lambda p, h: torch.tanh(h @ p), w, x, stages=2, microbatches=4)
    >>> ref = x
    >>> for layer in w: ref = torch.tanh(ref @ layer)
    >>> torch.allclose(y, ref, atol=1e-6)
    True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .partition_specs.sharding import constrain, current_sharding, use_sharding
from .pytree import tree_leaves, tree_map
from .types import PyTree

__all__ = ["PipelineError", "PipelineSchedule", "bubble_fraction", "pipeline"]

PP = "pp"
LAYERS = "layers"  # the logical axis of the stacked layers, which the rule ("layers", "pp") splits


class PipelineError(ValueError):
    """A pipeline that cannot be scheduled as asked; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """How stacked layers run over a mesh with `pp` (`Sharding(..., pipeline=PipelineSchedule(8))`).

    Attributes:
        microbatches: the batch is cut into this many (None: one per stage, the fewest possible).
        repeats: circular passes through the stages.
    """

    microbatches: Optional[int] = None
    repeats: int = 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of stage-iterations that compute nothing: `(S - 1) / (R * M + S - 1)`."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


def _check(n_layers: int, batch: int, stages: int, microbatches: int, repeats: int) -> None:
    for name, value in (("stages", stages), ("microbatches", microbatches), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PipelineError(f"pipeline {name} must be an int >= 1, got {value!r}.")
    if n_layers % (stages * repeats):
        raise PipelineError(
            f"{n_layers} layers do not split into {stages} stages x {repeats} repeats: the layer count must be a "
            f"multiple of stages x repeats ({stages * repeats}); change n_layers, the pp degree or the repeats.")
    if microbatches < stages:
        raise PipelineError(
            f"{microbatches} microbatches are fewer than the {stages} stages: every stage would wait on one that "
            f"never comes; use at least {stages} microbatches (--pipeline_microbatches {stages}) or fewer stages.")
    if batch % microbatches:
        raise PipelineError(
            f"a batch of {batch} does not split into {microbatches} microbatches: the batch size must be a multiple "
            f"of the microbatches.")


class _Stages:
    """Where this process's stages sit: `first`, the global index of its first stage, `local` of them,
    and the `pp` process group it exchanges with (None: one process holds every stage)."""

    def __init__(self, stages: int, group: Any = None, rank: int = 0, size: int = 1,
                 pin: Callable[[Tensor], Tensor] = lambda t: t):
        self.local, self.group, self.rank, self.size, self.pin = stages // size, group, rank, size, pin
        self.first = rank * self.local

    def shift(self, out: Tensor) -> Tensor:
        """The buffer one stage along, circularly: slot s gets stage s-1's output, slot 0 the last stage's."""
        if self.group is None:
            return self.pin(torch.roll(out, 1, dims=0))
        from .compat.functional_collectives import all_to_all_single_autograd

        last = out[-1]
        mb = last.shape[0]
        send = [mb if j == (self.rank + 1) % self.size else 0 for j in range(self.size)]
        recv = [mb if j == (self.rank - 1) % self.size else 0 for j in range(self.size)]
        came = all_to_all_single_autograd(last.contiguous(), recv, send, self.group)
        return torch.cat([came.unsqueeze(0), out[:-1]])


def _hand_out(result: Tensor, place: _Stages) -> Tensor:
    """The first process's `result` on every process of `pp`. The output is replicated, so each process's
    loss sees the whole gradient: it flows to the first process's `result` alone (the others' did not
    count), through a term that adds zero."""
    if place.group is None:
        return result
    import torch.distributed as dist
    from .compat.functional_collectives import broadcast, wait_tensor

    sent = wait_tensor(broadcast(result.detach().contiguous(), dist.get_global_rank(place.group, 0), place.group))
    return sent + (result - result.detach()) * float(place.rank == 0)


def _local_inputs(params: PyTree, x: Any, extras: Dict[str, Any], stages: int) -> Tuple[Any, ...]:
    """`(params, x, extras, place, wrap)` as plain tensors with where their stages sit; from DTensors,
    this process's shares and `wrap`, which makes the output a DTensor again (None for plain inputs)."""
    from .jit_backends.dtensor_local import has_dtensor

    leaves = tree_leaves(params)
    if not has_dtensor([*leaves, x, *extras.values()]):
        return params, x, extras, _Stages(stages), None
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = next(t for t in [x, *leaves, *extras.values()] if isinstance(t, DTensor)).device_mesh
    names = mesh.mesh_dim_names or ()
    split, whole = [Shard(0) if n == PP else Replicate() for n in names], [Replicate()] * len(names)
    wrong = [t for t in leaves if isinstance(t, DTensor) and list(t.placements) not in (split, whole)]
    wrong += [t for t in [x, *extras.values()] if isinstance(t, DTensor) and list(t.placements) != whole]
    if PP not in names or wrong:
        raise PipelineError(
            f"pipeline on DTensor takes the stacked layers split by their first dimension over the mesh axis 'pp' "
            f"and whole over the rest of the mesh ({split}), the activations replicated; got a mesh with axes {names} and "
            f"{len(wrong)} tensor(s) laid out otherwise, e.g. {wrong[0].placements if wrong else None}; shard the "
            f"layers with the rule ('layers', 'pp') on a mesh of pp alone.")
    dim = names.index(PP)
    size, rank = mesh.size(dim), mesh.get_local_rank(dim)
    if stages % size:
        raise PipelineError(f"{stages} stages do not split over pp={size}: use a multiple of {size} stages.")

    def share(t):  # a tensor of every layer held whole (a key per layer) gives this process's layers
        if isinstance(t, DTensor) and list(t.placements) == split:
            return t.to_local()
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.reshape(size, -1, *t.shape[1:])[rank]

    def local(t):  # held whole, but only the first stage's process reads it: the others add a zero gradient
        return t.to_local(grad_placements=partial) if isinstance(t, DTensor) else t

    partial = [Partial() if n == PP else Replicate() for n in names]
    return (tree_map(share, params), local(x), {k: local(v) for k, v in extras.items()},
            _Stages(stages, mesh.get_group(dim), rank, size),
            lambda y: DTensor.from_local(y, mesh, whole, run_check=False))


def pipeline(layer_fn: Callable[..., Tensor], params: PyTree, x: Tensor, *, stages: int, microbatches: int,
             repeats: int = 1, batch_kwargs: Optional[Dict[str, Tensor]] = None) -> Tensor:
    """`x` through every layer of `params` in order, scheduled as a pipeline of `stages`.

    Args:
        layer_fn: `(one layer's params, h, **batch_kwargs) -> h`, `h` of one microbatch (`vmap` runs it over
            the stages).
        params: the stacked layers, every leaf `[L, ...]`; on DTensor split by `L` over `pp`.
        x: `(B, ...)`, split into `microbatches` along dim 0.
        stages: pipeline stages `S`; each runs `L / (S * repeats)` consecutive layers per repeat.
        microbatches: `M >= S`.
        repeats: circular passes `R` through the stages (stage s holds layers of every repeat).
        batch_kwargs: `(B, ...)` tensors each layer also gets, its microbatch's rows (segment ids, masks).

    Returns:
        `(B, ...)`, what applying the layers one after another gives.
    """
    leaves = tree_leaves(params)
    if not leaves:
        raise PipelineError("pipeline got no layer parameters: pass the stacked layers (leaves [L, ...]).")
    n_layers = leaves[0].shape[0]
    _check(n_layers, x.shape[0], stages, microbatches, repeats)
    params, x, extras, place, wrap = _local_inputs(params, x, dict(batch_kwargs or {}), stages)
    if place.size > 1 and repeats > 1:
        raise PipelineError(f"repeats={repeats} under pp={place.size} is not supported yet: run repeats=1.")
    per_stage = n_layers // (stages * repeats)
    staged = tree_map(lambda p: p.reshape(repeats, place.local, per_stage, *p.shape[1:]), params)
    sharding = current_sharding()
    if wrap is None and (sharding is None or sharding.mesh.sizes().get(PP, 1) == 1):
        return _schedule(layer_fn, staged, x, place, stages, microbatches, repeats, extras)
    if wrap is None:  # torch_xla: one program of every stage, the stage buffer pinned to pp
        place.pin = lambda t: constrain(t, (LAYERS,) + (None,) * (t.dim() - 1), sharding=sharding)
    with use_sharding(None):  # the layers inside a stage constrain nothing (the stage's vmap has no rule)
        y = _schedule(layer_fn, staged, x, place, stages, microbatches, repeats, extras)
    return y if wrap is None else wrap(y)


def _run_stage(layer_fn: Callable, stage_params: PyTree, h: Tensor, extras: Dict[str, Tensor]) -> Tensor:
    n = tree_leaves(stage_params)[0].shape[0]
    for j in range(n):
        h = layer_fn(tree_map(lambda p: p[j], stage_params), h, **extras)
    return h


def _schedule(layer_fn: Callable, staged: PyTree, x: Tensor, place: _Stages, stages: int, microbatches: int,
              repeats: int, extras: Optional[Dict[str, Tensor]] = None) -> Tensor:
    # Every process runs the same ops and takes every shift's backward (a process that dropped a
    # shifted buffer would skip its backward exchange and leave the others waiting): what differs
    # by process is chosen by `torch.where`, whose unchosen side gets a zero gradient.
    S, M, R = stages, microbatches, repeats
    mbs = list(x.reshape(M, x.shape[0] // M, *x.shape[1:]).unbind(0))
    extras = {k: v.reshape(M, v.shape[0] // M, *v.shape[1:]) for k, v in (extras or {}).items()}
    zero = torch.zeros_like(mbs[0])
    buffer = zero.unsqueeze(0).expand(place.local, *zero.shape)
    first_process = torch.tensor(place.first == 0, device=x.device)
    returned: List[Tensor] = [zero] * M  # what came back to slot 0 (stage 0's on the first process)
    run = torch.func.vmap(lambda p, h, e: _run_stage(layer_fn, p, h, e))
    for i in range(R * M + S - 1):
        if i < R * M:  # microbatch i % M enters stage 0, for the first time or the next repeat
            entering = torch.where(first_process, mbs[i % M] if i < M else returned[i % M], buffer[0])
            buffer = torch.cat([entering.unsqueeze(0), buffer[1:]])
        global_stage = range(place.first, place.first + place.local)
        working = torch.tensor([0 <= i - g < R * M for g in global_stage], device=x.device)
        inputs = place.pin(torch.where(working.view(-1, *[1] * zero.dim()), buffer, zero))  # the bubble: zeros
        rep = [min(max((i - g) // M, 0), R - 1) for g in global_stage]
        mine = [(i - g) % M for g in global_stage]  # the microbatch each stage holds now
        batch_rows = {k: v[mine] for k, v in extras.items()}
        buffer = place.shift(run(tree_map(lambda p: _pick(p, rep), staged), inputs, batch_rows))
        done = i - (S - 1)  # the microbatch the last stage finished, now in slot 0 of the first process
        if 0 <= done < R * M:
            returned[done % M] = buffer[0]
    return _hand_out(torch.cat(returned), place)


def _pick(p: Tensor, repeat_of_stage: Sequence[int]) -> Tensor:
    """`[local stages, layers per stage, ...]`: each stage's layers of the repeat it runs now."""
    if all(r == repeat_of_stage[0] for r in repeat_of_stage):
        return p[repeat_of_stage[0]]
    return torch.stack([p[r, s] for s, r in enumerate(repeat_of_stage)])
