"""`Sharding`: a mesh, a layout and the lowering that runs them; `shard`, `constrain`, `use_sharding`.

Public names: `Sharding`, `Lowering`, `shard`, `shard_batch`, `constrain`, `use_sharding`,
`current_sharding`, `specs_like_params`, `flatten_specs`.

One `Sharding` object carries everything a sharded run needs: the `Mesh` (named axes, backend),
the `Layout` (params / compute rules) and the backend's `Lowering` (DTensor placements on a
`DeviceMesh`, or `mark_sharding` on a torch_xla SPMD mesh). The step function and the model are
the same objects with or without it:

    sharding = Sharding(mesh, for_mesh(mesh))
    state = shard(state, sharding, axes=model.axes)        # params + optimizer state
    with use_sharding(sharding):                            # `constrain` calls become real
        state, metrics = step(state, shard_batch(batch, sharding))

`constrain(x, axes)` is how a model marks the layout of a parameter it is about to use or of an
activation (`("batch", "sequence", "embed")`), through the layout's compute rules. Without an
active sharding it returns `x` itself, so the same model runs unsharded. `use_sharding` is
trace-time context, like JAX's `with mesh:` or Flax's `nn.logical_axis_rules`: compiled steps read
it while tracing, so enter it around the calls (a compiled step re-traces if it changes).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ContextManager, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch
from ..pytree import MaskedNode, tree_flatten, tree_map, tree_structure, tree_unflatten

from ..mesh import Mesh
from ..trace_context import here, using_sharding
from .layouts import Layout
from .rules import Rules, ShardingRuleError, resolve, resolve_tree
from .spec import PartitionSpec

__all__ = [
    "Lowering",
    "Sharding",
    "constrain",
    "current_sharding",
    "flatten_specs",
    "shard",
    "shard_batch",
    "specs_like_params",
    "use_sharding",
]


class Lowering(Protocol):
    """What a backend provides to run a `PartitionSpec` (implemented by `dtensor.py` and `xla.py`)."""

    def place(self, x: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
        """A full tensor (equal on every process) -> the sharded tensor the backend computes on."""

    def constrain(self, x: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
        """Inside compute: `x` laid out as `spec` (a redistribution / a sharding annotation)."""

    def local_shape(self, x: torch.Tensor) -> Tuple[int, ...]:
        """The shape of the shard one device holds."""

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The full tensor as a plain CPU tensor (for logging, checkpoints, comparisons)."""

    def context(self) -> ContextManager[Any]:
        """Entered by `use_sharding` around the calls (e.g. DTensor's implicit replication)."""


def _lowering_for(mesh: Mesh) -> Lowering:
    if mesh.backend == "dtensor":
        from .dtensor import DTensorLowering

        return DTensorLowering(mesh)
    from .xla import XlaLowering

    return XlaLowering(mesh)


@dataclasses.dataclass(frozen=True, eq=False)
class Sharding:
    """A mesh, a layout (params / compute rules) and the backend lowering built from the mesh.

    Args:
        mesh: the named mesh (its backend picks the lowering).
        layout: a `Layout`, or a list of rules used for both mappings.
        lowering: override the backend lowering (tests); built from `mesh.backend` by default.
        pipeline: how stacked layers run when the mesh has `pp` (`ember.core.partition_specs.pipeline.PipelineSchedule`;
            None: its defaults).
    """

    mesh: Mesh
    layout: Layout
    lowering: Optional[Lowering] = None
    pipeline: Any = None

    def __post_init__(self) -> None:
        layout = self.layout if isinstance(self.layout, Layout) else Layout.same(self.layout)
        layout.params.check_mesh(self.mesh.names)
        layout.compute.check_mesh(self.mesh.names)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "_compute_cache", {})
        if self.lowering is None:
            object.__setattr__(self, "lowering", _lowering_for(self.mesh))

    def param_specs(self, axes: Any, params: Any = None) -> Any:
        """The storage spec of every parameter (the layout's params rules), checked against shapes."""
        return resolve_tree(axes, self.layout.params, mesh_sizes=self.mesh.sizes(), shapes=params)

    def compute_spec(self, axes: Sequence[Optional[str]], shape: Optional[Sequence[int]] = None) -> PartitionSpec:
        """The compute-time spec for a tensor with logical `axes` (cached per axes tuple)."""
        axes = tuple(axes)
        if here().tracer == "dynamo":
            # No cache while Dynamo traces: it would guard on the cache's contents, which the trace
            # itself fills, and the second call of a compiled step would compile again.
            return resolve(axes, self.layout.compute, mesh_sizes=self.mesh.sizes(), name=f"activation {axes}")
        spec = self._compute_cache.get(axes)
        if spec is None:
            spec = resolve(axes, self.layout.compute, mesh_sizes=self.mesh.sizes(), name=f"activation {axes}")
            self._compute_cache[axes] = spec
        return spec

    def __repr__(self) -> str:
        return f"Sharding({self.mesh!r}, layout={self.layout.name!r})"


@contextlib.contextmanager
def use_sharding(sharding: Optional[Sharding]) -> Iterator[Optional[Sharding]]:
    """Make `sharding` the one `constrain` uses in this thread (None: unsharded) and enter its lowering's context."""
    with using_sharding(sharding), (sharding.lowering.context() if sharding is not None else contextlib.nullcontext()):
        yield sharding


def current_sharding() -> Optional[Sharding]:
    """The innermost `use_sharding` value of this thread, or None."""
    return here().sharding


def constrain(x: torch.Tensor, axes: Sequence[Optional[str]], *, sharding: Optional[Sharding] = None,
              rules: Optional[Iterable[Sequence[Any]]] = None) -> torch.Tensor:
    """`x` laid out as the compute rules say for logical `axes`; `x` itself when no sharding applies.

    Models call it on the parameters they are about to use (FSDP's per-layer gather is this
    constraint under the compute rules) and on activations such as `("batch", "sequence", "embed")`.
    Like Flax's `with_logical_constraint`, the context is the fallback: `sharding=` names the mesh
    and layout explicitly (default: this thread's `use_sharding`), and `rules=` replaces the
    layout's compute rules for this one call. With neither an explicit nor an active sharding, `x`
    is returned unchanged (the same model code runs on one device).
    """
    if sharding is None:
        sharding = current_sharding()
    if sharding is None:
        return x
    if len(axes) != x.dim():
        raise ShardingRuleError(f"constrain: axes {tuple(axes)} name {len(axes)} dimensions but the tensor has "
                                f"shape {tuple(x.shape)}; give one logical name (or None) per dimension.")
    if rules is None:
        spec = sharding.compute_spec(axes)
    else:
        spec = resolve(tuple(axes), Rules(rules), mesh_sizes=sharding.mesh.sizes(), name=f"activation {tuple(axes)}")
    return sharding.lowering.constrain(x, spec)


def _replicated(x: Any) -> Any:
    return PartitionSpec(*([None] * x.dim())) if isinstance(x, torch.Tensor) else None


def specs_like_params(tree: Any, params: Any, param_specs: Any) -> Any:
    """Specs for a whole tree (a TrainState, an optimizer state) that inherit each parameter's spec.

    Every subtree with the structure of `params` (Adam's `mu` and `nu`, the params themselves), some of its
    leaves perhaps `MaskedNode`s (the state of one group of `partition` or `masked`), takes `param_specs` leaf
    by leaf, when the leaf has its parameter's shape (factored statistics of another shape are replicated);
    every other tensor (step counts, keys, hyperparameters) is replicated.
    """
    params_def = tree_structure(params)
    flat_params, _ = tree_flatten(params)
    flat_specs, _ = tree_flatten(param_specs)

    def masked_leaves(node: Any) -> Optional[Tuple[List[Any], Any]]:
        """`node`'s leaves, each `MaskedNode` one, and their treedef, if that is `params`' structure; else None."""
        if isinstance(node, torch.Tensor):
            return None
        leaves, treedef = tree_flatten(node, is_leaf=lambda x: isinstance(x, MaskedNode))
        return (leaves, treedef) if treedef == params_def else None

    def spec_for(node: Any) -> Any:
        found = masked_leaves(node)
        if found is None:
            return _replicated(node)
        leaves, treedef = found
        out = [x if isinstance(x, MaskedNode) else
               s if isinstance(x, torch.Tensor) and tuple(x.shape) == tuple(p.shape) else _replicated(x)
               for x, p, s in zip(leaves, flat_params, flat_specs)]
        return tree_unflatten(out, treedef)

    return tree_map(spec_for, tree, is_leaf=lambda node: masked_leaves(node) is not None)


def flatten_specs(specs: Any) -> List[Any]:
    """The leaves of a specs tree in the flatten order of the tree it describes (None kept for non-tensors)."""
    return tree_flatten(specs, is_leaf=lambda x: x is None or isinstance(x, PartitionSpec))[0]


def _place_tree(tree: Any, specs: Any, lowering: Lowering) -> Any:
    leaves, treedef = tree_flatten(tree)
    spec_leaves = flatten_specs(specs)
    if len(spec_leaves) != len(leaves):
        raise ValueError(f"internal: {len(spec_leaves)} specs for {len(leaves)} leaves")
    placed: Dict[int, torch.Tensor] = {}  # tied leaves (one tensor twice) stay one tensor
    out = []
    for x, spec in zip(leaves, spec_leaves):
        if isinstance(x, torch.Tensor):
            if id(x) not in placed:
                placed[id(x)] = lowering.place(x, spec)
            x = placed[id(x)]
        out.append(x)
    return tree_unflatten(out, treedef)


def shard(tree: Any, sharding: Sharding, *, axes: Any, params: Any = None) -> Any:
    """Place a TrainState / params / any tree holding the params: params by the layout's params rules,
    state that mirrors them by structure (see `specs_like_params`), everything else replicated.

    Args:
        tree: full (unsharded) tensors, equal on every process.
        sharding: the `Sharding`.
        axes: the model's `axes` tree (shaped like params).
        params: the params subtree of `tree`, when `tree` is not itself the params
            (default: `tree.params` if it has one, else `tree`).

    Raises:
        ShardingRuleError: a parameter the rules cannot place, naming it and the fix.
    """
    if params is None:
        params = getattr(tree, "params", tree)
    param_specs = sharding.param_specs(axes, params)
    specs = specs_like_params(tree, params, param_specs)
    return _place_tree(tree, specs, sharding.lowering)


BATCH_AXES = ("batch", "sequence")  # a batch tensor's leading dimensions, unless `shard_batch` is told others


def batch_axes(ndim: int, axes: Sequence[Optional[str]] = BATCH_AXES) -> Tuple[Optional[str], ...]:
    """The logical names of a batch tensor's `ndim` dimensions: `axes` first, the rest None (whole)."""
    return (tuple(axes) + (None,) * ndim)[:ndim]


def shard_batch(batch: Any, sharding: Sharding, *, axes: Sequence[Optional[str]] = BATCH_AXES) -> Any:
    """Place a batch: each tensor's leading dimensions called `axes` (default batch, sequence), the rest whole."""

    def spec(x: torch.Tensor) -> PartitionSpec:
        return sharding.compute_spec(batch_axes(x.dim(), axes))

    specs = tree_map(lambda x: spec(x) if isinstance(x, torch.Tensor) else None, batch)
    return _place_tree(batch, specs, sharding.lowering)
