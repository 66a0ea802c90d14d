"""Trace a function once per input signature with `make_fx` on fake tensors, compile it with Inductor.

Used by `jit(backend="inductor")` (see `inductor.py` for when). This is `jax.jit`'s model: the
Python function runs once, abstractly, for each new signature (pytree structure and static fields,
each tensor's shape, strides, dtype and device, which arguments are the same tensor, every
non-tensor leaf's value, grad mode and autocast), and the resulting ATen graph goes to Inductor's
`compile_fx` as is.

Why not `torch.compile` (Dynamo): Dynamo interprets the function's bytecode, which for a whole
training step (model, `torch.func.grad`, optimizer over every leaf, pytree plumbing) cost 23 s of
the tiny Llama's first call on a 2-core CPU (`make_fx`: 3-4 s), and it pays that again in every
new process, since Dynamo's own work is never cached. `make_fx` runs the Python at (fake) tensor
speed, and the graph it hands over carries a shape environment, so Inductor's FX-graph cache and
AOTAutograd's cache both hit in a second process. A pure step loses nothing: it has no graph
breaks to fall back on anyway (`fullgraph=True` was already required), and reading a tensor's
value (`.item()`, `if x > 0`) fails at trace time instead of being baked in.

`FxCompiled.accepts` only plain tensors that do not require grad; DTensor arguments reach it as
their local shards (`dtensor_local.py`), and tensors that require grad go to Dynamo.
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..compat import compiling_with
from ..compat.gloo_all_gather import gloo_all_gather_out
from ..compat.pytree import spec_children
from ..compat.inductor_batching import batched_cpu_kernels
from ..compat.inductor_frees import frees_after_last_read
from ..compat.inductor_isa import vec_isa_probe_memo
from ..compat.inductor_loop_order import foreach_loop_reordering
from ..compat.inductor_scan_cache import scan_graph_cache
from ..compat.inductor_transpose import transposed_tiles_of_direct_indices
from ..compat.inductor_while_loop import while_loop_aliased_carries
from ..compat.shared_subgraph import shared_subgraphs
from ..pytree import TreeSpec, tree_flatten, tree_unflatten
from ..trace_context import FunctionError, sharing_subgraphs
from .trace import DataDependentError, trace_and_compile

__all__ = ["FxCompiled"]


_MSG_READS_VALUE = (
    "jit(backend='inductor') traces the function once on shapes only, but it reads a tensor's value "
    "({detail}): `.item()`, `float(t)`, `bool(t)` or `if t > 0:` on a tensor. A compiled step keeps "
    "values on the device: use `torch.where` for branches, return metrics as 0-d tensors and read "
    "them after the call, or use backend='eager' to debug."
)


@contextlib.contextmanager
def _shared_subgraphs() -> Iterator[None]:
    """The `shared_subgraph` patch, and ember's calls told they may share (`here().shares`)."""
    with shared_subgraphs(), sharing_subgraphs():
        yield


class _NotDonatable(Exception):
    """Raised inside the trace when the entry reports its output cannot be donated."""


@dataclass(frozen=True)
class _Graph:
    """One compiled signature: the callable and how to rebuild the output pytree from its results."""

    compiled: Callable[..., Any]
    out_spec: Any
    # Per output leaf: ("graph", k) = k-th graph output, ("input", j) = j-th unique input tensor
    # itself (a donated or passed-through leaf), ("const", value) = a non-tensor leaf.
    out_leaves: Tuple[Tuple[str, Any], ...]


def _leaf_key(leaf: Any, seen: Dict[Any, int], keep: List[Any]) -> Any:
    """A hashable signature of one leaf; `seen` numbers tensor objects and storages in order."""
    if isinstance(leaf, Tensor):
        storage = ("storage", leaf.untyped_storage().data_ptr() if leaf.numel() else id(leaf))
        return ("T", seen.setdefault(id(leaf), len(seen)), seen.setdefault(storage, len(seen)),
                tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device)
    try:
        hash(leaf)
        return ("C", type(leaf), leaf)
    except TypeError:
        keep.append(leaf)
        return ("O", id(leaf))


def leaf_signature(leaves: List[Any], keep: Optional[List[Any]] = None) -> Tuple[Any, ...]:
    """What `FxCompiled` keys leaves on: shapes, strides, dtypes, devices, which leaves are one
    object or share a storage, and constants (unhashable ones by identity, held in `keep`). A call
    with a new signature traces and compiles."""
    seen: Dict[Any, int] = {}
    keep = [] if keep is None else keep
    return tuple(_leaf_key(x, seen, keep) for x in leaves)


class FxCompiled:
    """`fn(*args, **kwargs)` compiled per signature; `compiler(gm, example_inputs)` builds each graph.

    `fn` returns `(out, ok)` like jit's entry: `ok=False` means the output cannot be donated, in
    which case the call runs `fn` eagerly (it leaves the state untouched) so jit can raise its
    precise error.
    """

    def __init__(self, fn: Callable[..., Tuple[Any, bool]], compiler: Callable[..., Any]) -> None:
        self._fn = fn
        self._compiler = compiler
        self._graphs: Dict[Any, _Graph] = {}
        self._alive: List[Any] = []  # what keys hold by id() (unhashable leaves, specs): ids stay unique

    @staticmethod
    def accepts(leaves: List[Any]) -> bool:
        """Whether every tensor leaf is a plain tensor that does not require grad."""
        return all(type(t) is Tensor and not t.requires_grad
                   for t in leaves if isinstance(t, Tensor))

    def __call__(self, leaves: List[Any], spec: Any) -> Tuple[Any, bool]:
        keep: List[Any] = []
        # Storage pointers tell aliasing views apart; they cost a lookup per call, as Dynamo's
        # guards do in C++. Global modes that change the traced graph are part of the key too.
        key = (spec, leaf_signature(leaves, keep), torch.is_grad_enabled(),
               torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"),
               torch.get_autocast_dtype("cpu"), torch.get_autocast_dtype("cuda"))
        unique = _unique_tensors(leaves)
        graph = self._graphs.get(key)
        if graph is None:
            # Static fields compare by `==`, so a rebuilt optimizer (new closures, same code and
            # hyperparameters) misses the exact key; a structural fingerprint finds its graph.
            structural = (_fingerprint(spec), key[1:])
            graph = self._graphs.get(structural)
            if graph is None:
                try:
                    graph = self._compile(leaves, spec, unique)
                except _NotDonatable:
                    args, kwargs = tree_unflatten(leaves, spec)
                    return self._fn(*args, **kwargs)  # ok is False: the state is untouched
                self._graphs[structural] = graph
            self._graphs[key] = graph
            self._alive.append((spec, keep))
        results = graph.compiled(*unique)
        out = []
        for kind, value in graph.out_leaves:
            out.append(results[value] if kind == "graph" else unique[value] if kind == "input" else value)
        return tree_unflatten(out, graph.out_spec), True

    def _compile(self, leaves: List[Any], spec: Any, unique: List[Tensor]) -> _Graph:
        position = {id(t): j for j, t in enumerate(unique)}  # a tensor passed twice is one input
        recorded: Dict[str, Any] = {}

        def flat(*tensors: Tensor) -> Tuple[Tensor, ...]:
            rebuilt = [tensors[position[id(x)]] if isinstance(x, Tensor) else x for x in leaves]
            args, kwargs = tree_unflatten(rebuilt, spec)
            out, ok = self._fn(*args, **kwargs)
            if not ok:
                raise _NotDonatable()
            out_flat, recorded["spec"] = tree_flatten(out)
            which = {id(t): j for j, t in enumerate(tensors)}
            graph_out: List[Tensor] = []
            kinds = []
            for leaf in out_flat:
                if isinstance(leaf, Tensor) and id(leaf) in which:
                    kinds.append(("input", which[id(leaf)]))
                elif isinstance(leaf, Tensor):
                    kinds.append(("graph", len(graph_out)))
                    graph_out.append(leaf)
                else:
                    kinds.append(("const", leaf))
            recorded["kinds"] = tuple(kinds)
            return tuple(graph_out)

        def trace_then_compile() -> Callable[..., Any]:
            return trace_and_compile(flat, unique, self._compiler)

        patches = [("frees_after_last_read", frees_after_last_read), ("shared_subgraph", _shared_subgraphs),
                   ("foreach_loop_reordering", foreach_loop_reordering),
                   ("while_loop_aliased_carries", while_loop_aliased_carries), ("scan_graph_cache", scan_graph_cache)]
        if any(t.device.type == "cpu" for t in unique):
            # The ISA checks start first, so they run (or are remembered) while the step is traced.
            patches = [("vec_isa_probe_memo", vec_isa_probe_memo), *patches,
                       ("cpp_kernel_batching", batched_cpu_kernels),
                       ("cpp_transpose_indirect_index", transposed_tiles_of_direct_indices),
                       ("gloo_all_gather_out", gloo_all_gather_out)]  # DTensor steps over gloo
        try:
            compiled = compiling_with(patches, trace_then_compile,
                                      passthrough=(DataDependentError, FunctionError, _NotDonatable))
        except DataDependentError as err:
            raise RuntimeError(_MSG_READS_VALUE.format(detail=err)) from None
        return _Graph(compiled, recorded["spec"], recorded["kinds"])


def _fingerprint(x: Any, depth: int = 0) -> Any:
    """A hashable value equal for structurally equal static values: functions by code and closure.

    Used for treedef contexts (static fields such as a `GradientTransformation`, a NamedTuple of
    closures). Tensors and unhashable objects count by identity (the caller keeps them alive).
    """
    if depth > 40:
        return ("id", id(x))
    d = depth + 1
    if isinstance(x, TreeSpec):
        return ("spec", x.type, _fingerprint(x.context, d), tuple(_fingerprint(c, d) for c in spec_children(x)))
    if isinstance(x, types.FunctionType):
        cells = []
        for cell in x.__closure__ or ():
            try:
                cells.append(_fingerprint(cell.cell_contents, d))
            except ValueError:  # an empty cell
                cells.append(("empty",))
        return ("fn", x.__code__, tuple(cells), _fingerprint(x.__defaults__, d),
                _fingerprint(x.__kwdefaults__, d))
    if isinstance(x, functools.partial):
        return ("partial", _fingerprint(x.func, d), _fingerprint(x.args, d), _fingerprint(x.keywords, d))
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_fingerprint(e, d) for e in x))
    if isinstance(x, dict):
        return (type(x), tuple((k, _fingerprint(v, d)) for k, v in x.items()))
    if isinstance(x, Tensor):
        return ("id", id(x))
    try:
        hash(x)
    except TypeError:
        return ("id", id(x))
    return ("value", type(x), x)


def _unique_tensors(leaves: List[Any]) -> List[Tensor]:
    seen: Dict[int, Tensor] = {}
    for x in leaves:
        if isinstance(x, Tensor):
            seen.setdefault(id(x), x)
    return list(seen.values())

