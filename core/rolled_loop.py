"""The op under `remat_scan`: a loop that stays one node of ember's Inductor step.

Public name: `rolling`, which tells a caller whether a loop would roll where it stands.

Inside `jit(backend="inductor")` a Python loop unrolls into the traced graph. Here the loop runs at
run time instead: the step's graph holds one `ember::rolled_loop` node, whose implementation calls
the body, compiled apart by `jit` once for every iteration, on each slice. The step's compile time
then does not grow with the trip count. On torch_xla the loops are XLA `While`s; elsewhere (eagerly,
under Dynamo, under `vmap`, with DTensor inputs) the loop is plain Python with the same result: with
DTensors the step's graph then holds every iteration.

The node names its loop by an identifier unique in the process (`<name>#<n>:<digest of its output
shapes>`, in trace order, so a second process tracing the same step names it alike and Inductor's
on-disk cache still hits); the loop itself is registered by the trace that emits the node.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from .compat.shared_subgraph import sharing
from .define_once import define_once
from .jit_backends.dtensor_local import has_dtensor
from .jit_backends.traced import compiling_with_fresh_keys
from .pytree import tree_flatten, tree_unflatten
from .types import PyTree

__all__ = ["rolling"]

Meta = Tuple[Tuple[int, ...], Tuple[int, ...], torch.dtype, torch.device]  # shape, stride, dtype, device


@dataclasses.dataclass
class _Loop:
    """A registered loop: `run(inputs) -> outputs`, what the outputs look like, and which inputs
    (positions) it overwrites in place."""

    run: Callable[[List[Tensor]], List[Tensor]]
    outputs: List[Meta]
    writes: Tuple[int, ...] = ()


class _Registry:
    """The loops registered in this process, and how many each name has had."""

    def __init__(self) -> None:
        self.loops: Dict[str, _Loop] = {}
        self.counts: Dict[str, int] = {}


def _define_op() -> _Registry:
    """Define `ember::rolled_loop`, whose kernel runs the loops of `registry`."""
    registry = _Registry()

    @torch.library.custom_op("ember::rolled_loop", mutates_args=())
    def rolled_loop(identifier: str, inputs: List[Tensor]) -> List[Tensor]:
        loop = registry.loops.get(identifier)
        if loop is None:
            raise RuntimeError(
                f"ember::rolled_loop {identifier!r} is not registered in this process: a graph holding "
                "it runs only where ember's jit traced it. Call the step through ember.core.jit.")
        with compiling_with_fresh_keys():
            outs = loop.run(list(inputs))
        # An op's output may not share memory with an input or another output (a layer passing part
        # of its carry through returns it as it came; one tensor can stand for two leaves).
        given = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
        results = []
        for out, (shape, stride, dtype, device) in zip(outs, loop.outputs):
            if tuple(out.shape) != shape or out.dtype != dtype:
                raise RuntimeError(
                    f"{identifier}: the loop returned {tuple(out.shape)} {out.dtype} where its fake kernel "
                    f"said {shape} {dtype}; a loop body's outputs must not change shape between calls.")
            if (out.numel() and out.untyped_storage().data_ptr() in given) or out.stride() != stride:
                out = torch.empty_strided(shape, stride, dtype=dtype, device=device).copy_(out)
            if out.numel():
                given.add(out.untyped_storage().data_ptr())
            results.append(out)
        return results

    @rolled_loop.register_fake
    def _(identifier: str, inputs: List[Tensor]) -> List[Tensor]:
        return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for shape, stride, dtype, device in registry.loops[identifier].outputs]

    return registry


_REGISTRY = define_once("rolled_loop", _define_op)  # one registry, however often ember is imported


def rolling(tree: PyTree) -> bool:
    """Whether a loop over `tree`'s tensors would run as one `ember::rolled_loop` node here: inside
    ember's Inductor trace, under no `torch.func` transform, with no DTensor among them."""
    if not sharing():
        return False
    tensors = [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor)]
    return not has_dtensor(tensors) and all(t.device.type != "xla" for t in tensors)


def run_loop(name: str, run: Callable[[List[Tensor]], List[Tensor]], inputs: Sequence[Tensor],
             outputs: Sequence[Meta], writes: Sequence[int] = ()) -> List[Tensor]:
    """One `ember::rolled_loop` node that calls `run(inputs)` at run time; `outputs` describes its results.

    `run` must not return its inputs, returns contiguous tensors, and writes no input but those at
    positions `writes` (a donated state updated in place). The graph does not see those writes:
    whatever reads such an input's old value must be an input of the loop too (so it runs first);
    `written_inputs` names them for who must know (`jit(cuda_graph=True)`).
    """
    counts = _REGISTRY.counts
    counts[name] = counts.get(name, -1) + 1
    # The outputs' shapes are only in the fake kernel, not in the graph Inductor's cache keys on,
    # which may treat input sizes as symbolic: put them in the name, or a graph traced for 2 layers
    # could be loaded for 8.
    digest = hashlib.sha1(repr(list(outputs)).encode()).hexdigest()[:12]
    identifier = f"{name}#{counts[name]}:{digest}"
    _REGISTRY.loops[identifier] = _Loop(run, list(outputs), tuple(writes))
    return list(torch.ops.ember.rolled_loop(identifier, list(inputs)))


def written_inputs(node: torch.fx.Node) -> List[Any]:
    """The arguments (graph nodes) that `node`, an `ember::rolled_loop` call of a traced graph, writes
    in place; none for any other node."""
    if node.op != "call_function" or node.target is not torch.ops.ember.rolled_loop.default:
        return []
    identifier, inputs = node.args
    return [inputs[i] for i in _REGISTRY.loops[identifier].writes]


def dense_strides(t: Tensor) -> Tuple[int, ...]:
    """The strides of `torch.empty_like(t)`: `t`'s dimension order, without gaps."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))  # outermost first; ties keep their order
    strides, step = [0] * t.dim(), 1
    for d in reversed(order):
        strides[d], step = step, step * t.shape[d]
    return tuple(strides)


def meta(t: Tensor, stacked: int = 0) -> Meta:
    """How the loop returns `t`, or (`stacked` > 0) `stacked` tensors like `t` stacked along a new
    first dim, each laid out like `t` (a replayed result must have the strides the forward saw)."""
    if not stacked:
        return (tuple(t.shape), dense_strides(t), t.dtype, t.device)
    return ((stacked, *t.shape), (t.numel(), *dense_strides(t)), t.dtype, t.device)


def new_stacked(t: Tensor, length: int) -> Tensor:
    """An empty buffer for `length` tensors like `t` (`meta(t, length)`)."""
    shape, stride, dtype, device = meta(t, length)
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


class Flat:
    """A pytree split into its tensors (the loop's inputs) and everything else (kept as is)."""

    def __init__(self, tree: PyTree) -> None:
        leaves, self.spec = tree_flatten(tree)
        self.positions = [i for i, v in enumerate(leaves) if isinstance(v, Tensor)]
        self.others = [None if isinstance(v, Tensor) else v for v in leaves]
        self.tensors: List[Tensor] = [leaves[i] for i in self.positions]

    def rebuild(self, tensors: Sequence[Tensor]) -> PyTree:
        leaves = list(self.others)
        for i, t in zip(self.positions, tensors):
            leaves[i] = t
        return tree_unflatten(leaves, self.spec)


class Compiled:
    """`jit(fn, backend="inductor", **options)`: the loop's body, compiled apart from the step on its first call.

    It is called from the loop's kernel, inside the step's running graph, where a call that compiles
    does so with the dispatch keys of a new thread (`compiling_with_fresh_keys`).
    """

    def __init__(self, fn: Callable, **options: Any) -> None:
        self.fn, self.options, self.jitted = fn, options, None

    def __call__(self, *args: Any) -> Any:
        if self.jitted is None:
            from .jit import jit  # jit's backends import the tracing context this module reads

            self.jitted = jit(self.fn, backend="inductor", **self.options)
        return self.jitted(*args)
