"""Pipeline parallelism as a schedule inside the step: `pipeline` runs a stack of layers as stages.

Public names: `pipeline`, `PipelineSchedule`, `PipelineError`, `bubble_fraction`.

The stacked layer parameters `[L, ...]` are viewed as `[repeats, stages, layers_per_stage, ...]` (one
repeat: today's layout, so checkpoints do not change). Every iteration runs every stage at once
(`vmap` over a `[stages, microbatch, ...]` buffer), then shifts the buffer one stage along, circularly:
what leaves the last stage comes back to the first, for the next repeat or, after the last, as the
output. Microbatches enter stage 0 one per iteration; `repeats * microbatches + stages - 1` iterations
in all. The backward is autodiff of the whole loop (GPipe run in reverse). A stage outside the
schedule's diagonal (the bubble) computes on zeros, whatever its buffer holds, and its result is
never read, so a NaN there reaches no gradient. An iteration is one function of the carried buffer and
its row of a timetable (which microbatch enters, which stages work, on which repeat), so in ember's
Inductor step the iterations are one rolled loop each way (`remat_scan`): the compile does not grow with
the microbatches. Layers that add to totals beside the activations (a mixture of experts' router
statistics) carry them through the stages as a second buffer; each microbatch's are merged at the end.

On DTensor (`ember.core.partition_specs.pipeline_dtensor`), with the layer dimension split over the mesh axis `pp`, each
process runs its own stages on plain tensors (their layers of every repeat, exchanged once per step when
there are several) and the shift is one exchange: its last stage's buffer goes to the next process
(`all_to_all_single` with one non-zero split, whose backward is the shift the other way), never an
all-gather of the buffer. The output, held by the first stage's process, is broadcast to every process of
`pp`. Beside `pp` the DTensor form takes every axis. Over the batch axes (`dp`, `fsdp`, `ep`) each process
runs its rows of the batch, its stages' layers gathered over `fsdp` (and experts over `ep`) once per step,
not once per microbatch, their gradients reduce-scattered back, and totals merged over the batch axes too.
Over the axes that split within the rows (`tp`, `cp`) the stages run their layers one after another on
DTensors of a slice of the mesh, under the layout restricted to it (`pipeline_dtensor.in_stage`). The
iterations roll there too: the shift, a collective, is inside the loop's body. Under torch_xla SPMD the same code is one program over every stage: the stage buffer is pinned to
`pp` (the rule of `"layers"`), XLA lowers the shift to a collective-permute, and the layers inside a stage
constrain nothing.

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
import functools
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from ..remat_scan import remat_scan
from ..types import PyTree
from .pipeline_dtensor import local_inputs
from .pipeline_stages import LAYERS, PP, PipelineError, Stages, hand_out
from .sharding import constrain, current_sharding, use_sharding

__all__ = ["PipelineError", "PipelineSchedule", "bubble_fraction", "pipeline"]

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


class _Totals:
    """Sums the layers add to beside the activations (a mixture of experts' router statistics), packed as one
    vector so they ride through the stage buffer as one more tensor; `merge(a, b)` adds two totals."""

    def __init__(self, totals: PyTree, merge: Callable[[PyTree, PyTree], PyTree]):
        leaves, self.spec = tree_flatten(totals)
        self.shapes, self.dtypes, self.merge = [t.shape for t in leaves], [t.dtype for t in leaves], merge
        self.size = sum(math.prod(s) for s in self.shapes)
        self.dtype = functools.reduce(torch.promote_types, self.dtypes)

    def pack(self, totals: PyTree) -> Tensor:
        return torch.cat([t.reshape(-1).to(self.dtype) for t in tree_flatten(totals)[0]])

    def unpack(self, flat: Tensor) -> PyTree:
        parts = torch.split(flat, [math.prod(s) for s in self.shapes])
        return tree_unflatten([p.reshape(s).to(d) for p, s, d in zip(parts, self.shapes, self.dtypes)], self.spec)

    def fold(self, flats: Sequence[Tensor]) -> Tensor:
        total = flats[0]
        for flat in flats[1:]:
            total = self.pack(self.merge(self.unpack(total), self.unpack(flat)))
        return total

    def across(self, flat: Tensor, groups: Sequence[Tuple[Any, int, int]]) -> Tensor:
        """`flat` merged over the processes of each `(group, rank, size)` (the batch axes beside `pp`). The
        others' terms come as values, this process's own term live: the loss is the same on every process,
        so each process's gradient reaches its own rows' totals once."""
        from ..compat.functional_collectives import all_gather, wait_tensor

        for group, rank, size in groups:
            every = wait_tensor(all_gather(flat.detach().unsqueeze(0), 0, group))
            flat = self.fold([flat if q == rank else every[q] for q in range(size)])
        return flat


def pipeline(layer_fn: Callable[..., Any], params: PyTree, x: Tensor, *, stages: int, microbatches: int,
             repeats: int = 1, batch_kwargs: Optional[Dict[str, Tensor]] = None, totals: Optional[PyTree] = None,
             merge: Optional[Callable[[PyTree, PyTree], PyTree]] = None) -> Any:
    """`x` through every layer of `params` in order, scheduled as a pipeline of `stages`.

    Args:
        layer_fn: `(one layer's params, h, **batch_kwargs) -> h`, `h` of one microbatch (`vmap` runs it over
            the stages); with `totals`, `(params, (h, totals), **batch_kwargs) -> (h, totals)`.
        params: the stacked layers, every leaf `[L, ...]`; on DTensor split by `L` over `pp`.
        x: `(B, ...)`, split into `microbatches` along dim 0.
        stages: pipeline stages `S`; each runs `L / (S * repeats)` consecutive layers per repeat.
        microbatches: `M >= S`.
        repeats: circular passes `R` through the stages (stage s holds layers of every repeat).
        batch_kwargs: `(B, ...)` tensors each layer also gets, its microbatch's rows (segment ids, masks).
        totals: sums the layers add to beside `h` (a mixture of experts' router statistics); each microbatch
            starts from zeros, and `merge(a, b)` adds two totals (zeros must be its identity).

    Returns:
        `(B, ...)`, what applying the layers one after another gives; with `totals`, `(y, totals merged with
        every microbatch's)`.
    """
    leaves = tree_leaves(params)
    if not leaves:
        raise PipelineError("pipeline got no layer parameters: pass the stacked layers (leaves [L, ...]).")
    if (totals is None) != (merge is None):
        raise PipelineError("pipeline takes totals and merge together: pass both (the totals and how two add) or "
                            "neither.")
    n_layers = leaves[0].shape[0]
    _check(n_layers, x.shape[0], stages, microbatches, repeats)
    layer_fn, params, x, extras, given, place, wrap = local_inputs(layer_fn, params, x, dict(batch_kwargs or {}),
                                                                   totals, stages, repeats)
    if x.shape[0] % microbatches:
        raise PipelineError(
            f"each process's share of the batch ({x.shape[0]} rows, the batch split over the batch axes beside pp) "
            f"does not split into {microbatches} microbatches; use a batch size that is a multiple of the "
            f"microbatches times those axes' size.")
    per_stage = n_layers // (stages * repeats)
    staged = tree_map(lambda p: p.reshape(repeats, place.local, per_stage, *p.shape[1:]), params)
    sums = None if totals is None else _Totals(given, merge)
    sharding = current_sharding()
    if wrap is None and (sharding is None or sharding.mesh.sizes().get(PP, 1) == 1):
        y, flats = _schedule(layer_fn, staged, x, place, stages, microbatches, repeats, extras, sums)
    else:
        if wrap is None:  # torch_xla: one program of every stage, the stage buffer pinned to pp
            place.pin = lambda t: constrain(t, (LAYERS,) + (None,) * (t.dim() - 1), sharding=sharding)
        with use_sharding(None):  # the stages constrain nothing (the stage's vmap has no rule), or their own mesh
            y, flats = _schedule(layer_fn, staged, x, place, stages, microbatches, repeats, extras, sums)
        y = y if wrap is None else wrap(y)
    if sums is None:
        return y
    ours = sums.across(sums.fold(flats.unbind(0)), place.batch_groups)  # every microbatch, every process's rows
    out = sums.unpack(sums.fold([sums.pack(given), ours]))
    return y, (out if wrap is None else tree_map(lambda t: wrap(t, whole=True), out))


def _run_stage(layer_fn: Callable, stage_params: PyTree, lanes: Tuple[Tensor, ...], extras: Dict[str, Tensor],
               sums: Optional[_Totals]) -> Tuple[Tensor, ...]:
    """One stage's layers over its lanes: the activations, and with `sums` the packed totals."""
    n = tree_leaves(stage_params)[0].shape[0]
    h = lanes[0] if sums is None else (lanes[0], sums.unpack(lanes[1]))
    for j in range(n):
        h = layer_fn(tree_map(lambda p: p[j], stage_params), h, **extras)
    return (h,) if sums is None else (h[0], sums.pack(h[1]))


def _timetable(S: int, M: int, R: int, place: Stages, device: torch.device) -> Dict[str, Tensor]:
    """What differs from one iteration to the next, as tensors stacked over the `R * M + S - 1` iterations:
    `enters` (a microbatch enters stage 0), `enter` (which one), `again` (it comes back for another repeat),
    `working` (per local stage: on the schedule's diagonal, not the bubble), `repeat` and `microbatch` (per
    local stage: the repeat it runs and the microbatch it holds), `done` (one-hot over `M`: the microbatch
    the last stage finished, now in slot 0)."""
    rows: Dict[str, List[Any]] = {k: [] for k in ("enters", "enter", "again", "working", "repeat", "microbatch",
                                                  "done")}
    stages = range(place.first, place.first + place.local)
    for i in range(R * M + S - 1):
        rows["enters"].append(i < R * M)
        rows["enter"].append(i % M)
        rows["again"].append(i >= M)
        rows["working"].append([0 <= i - g < R * M for g in stages])
        rows["repeat"].append([min(max((i - g) // M, 0), R - 1) for g in stages])
        rows["microbatch"].append([(i - g) % M for g in stages])
        done = i - (S - 1)
        rows["done"].append([0 <= done < R * M and done % M == m for m in range(M)])
    ints = {"enter", "repeat", "microbatch"}
    return {k: torch.tensor(v, dtype=torch.int64 if k in ints else torch.bool, device=device) for k, v in rows.items()}


def _schedule(layer_fn: Callable, staged: PyTree, x: Tensor, place: Stages, stages: int, microbatches: int,
              repeats: int, extras: Optional[Dict[str, Tensor]] = None,
              sums: Optional[_Totals] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """`(y, flats)`: the output and, with `sums`, each microbatch's packed totals `(M, n)` (else None)."""
    # One iteration is one function of the carried stage buffers and the microbatches returned so far,
    # and of its row of the timetable: a loop that rolls in ember's Inductor step (`remat_scan`, every
    # iteration's activations kept as autograd keeps them), so the compile does not grow with the
    # microbatches. Every process runs the same ops and takes every shift's backward (a process that
    # dropped a shifted buffer would skip its backward exchange and leave the others waiting): what
    # differs by process is chosen by `torch.where`, whose unchosen side gets a zero gradient. The
    # buffers are lanes: the activations, and the packed totals where the layers add to some.
    S, M, R = stages, microbatches, repeats
    mbs = x.reshape(M, x.shape[0] // M, *x.shape[1:])  # (M, mb, ...)
    sources = (mbs,) if sums is None else (mbs, mbs.new_zeros(M, sums.size, dtype=sums.dtype))
    extras = {k: v.reshape(M, v.shape[0] // M, *v.shape[1:]) for k, v in (extras or {}).items()}
    buffers = tuple(m.new_zeros(place.local, *m.shape[1:]) for m in sources)  # (local stages, ...) a lane
    first_process = torch.tensor(place.first == 0, device=x.device)
    if place.vmap:
        run = torch.func.vmap(lambda p, lanes, e: _run_stage(layer_fn, p, lanes, e, sums))
    else:
        def run(p, lanes, e):
            each = [_run_stage(layer_fn, tree_map(lambda t: t[s], p), tuple(lane[s] for lane in lanes),
                               {k: v[s] for k, v in e.items()}, sums) for s in range(place.local)]
            return tuple(torch.stack(out) for out in zip(*each))

    def lead(flag: Tensor, t: Tensor) -> Tensor:  # a (stages,) or (M,) flag against a lane
        return flag.view(-1, *[1] * (t.dim() - 1))

    def iteration(carry: Tuple[Tuple[Tensor, ...], Tuple[Tensor, ...]], now: Dict[str, Tensor],
                  consts: Tuple[Any, ...]):
        buffers, returned = carry
        sources, extras, staged, first_process = consts
        enter = now["enter"].view(1)
        lanes = []
        for buffer, back, source in zip(buffers, returned, sources):
            new = torch.where(now["again"], back.index_select(0, enter)[0], source.index_select(0, enter)[0])
            entering = torch.where(now["enters"] & first_process, new, buffer[0])  # into stage 0, first process
            buffer = torch.cat([entering.unsqueeze(0), buffer[1:]])
            lanes.append(place.pin(torch.where(lead(now["working"], buffer), buffer, 0.0)))  # the bubble: zeros
        rows = {k: v.index_select(0, now["microbatch"]) for k, v in extras.items()}
        out = run(tree_map(lambda p: _pick(p, now["repeat"]), staged), tuple(lanes), rows)
        buffers = tuple(place.shift(lane) for lane in out)
        returned = tuple(torch.where(lead(now["done"], r), b[0].unsqueeze(0), r) for b, r in zip(buffers, returned))
        return buffers, returned

    carry = (buffers, tuple(torch.zeros_like(m) for m in sources))
    timetable = _timetable(S, M, R, place, x.device)
    consts = (sources, extras, staged, first_process)
    _, returned = remat_scan(iteration, carry, timetable, consts, policy="none", name="ember.pipeline")
    returned = tuple(hand_out(r, place) for r in returned)
    return returned[0].reshape(x.shape), (returned[1] if sums is not None else None)


def _pick(p: Tensor, repeat_of_stage: Tensor) -> Tensor:
    """`[repeats, local stages, layers per stage, ...]`: each stage's layers of the repeat it runs now
    (chosen elementwise, so a layout split over the stages stays split)."""
    out = p[0]
    for r in range(1, p.shape[0]):
        out = torch.where((repeat_of_stage == r).view(-1, *[1] * (out.dim() - 1)), p[r], out)
    return out
