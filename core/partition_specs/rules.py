"""Logical-axis rules: ordered `(logical_axis, mesh_axes)` pairs that turn axes into a `PartitionSpec`.

Public names: `Rules`, `ShardingRuleError`, `resolve`, `resolve_tree`.

Semantics are Flax's / MaxText's (`flax.linen.logical_to_mesh_axes`), checked against Flax in the
tests: rules are tried in order of precedence; a rule `(name, mesh_axes)` assigns `mesh_axes` to
the tensor dimension called `name` when that dimension is still unassigned and none of
`mesh_axes` is used by another dimension of the same tensor (so the first mesh axis still unused
wins, and a logical axis may list fallbacks: `("batch", "dp"), ("batch", None)`). `mesh_axes` is
one mesh axis, a tuple of them (the dimension is split over their product) or None (replicate).
Mesh axes of size 1 are dropped from the result.

Where Flax quietly replicates, ember stops and names the fix:

* a dimension whose logical name no rule mentions (Flax: replicated) -> error, so a new layer
  cannot silently end up whole on every device. Replication is one explicit rule away: `(name, None)`.
* a dimension whose every rule was blocked because its mesh axes were already taken by another
  dimension of the same tensor (Flax: replicated) -> error naming both dimensions and the rule;
  add a fallback rule for it (`(name, None)` or another mesh axis) to say what you meant.
* a rule naming a mesh axis the mesh does not have, a logical name used twice in one tensor,
  a dimension whose size is not divisible by its mesh axes -> errors with the parameter's name.

Example:
    >>> rules = Rules([("batch", ("dp", "fsdp")), ("embed", "fsdp"), ("mlp", "tp"), ("embed", None)])
    >>> resolve(("mlp", "embed"), rules)
    PartitionSpec('tp', 'fsdp')
    >>> resolve(("batch", "embed"), rules)     # fsdp is taken by batch: embed falls back to None
    PartitionSpec(('dp', 'fsdp'), None)
    >>> resolve(("mlp", "embed"), rules, mesh_sizes={"dp": 2, "fsdp": 1, "tp": 4})   # size-1 axes dropped
    PartitionSpec('tp', None)
    >>> resolve(("heads",), rules, name="attn.wq.weight")
    Traceback (most recent call last):
    ...
    ember.core.partition_specs.rules.ShardingRuleError: attn.wq.weight: no rule mentions logical axis 'heads' (dimension 0 of axes ('heads',)); add a rule for it, e.g. ('heads', 'tp') to shard it or ('heads', None) to replicate it.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple

from ..pytree import tree_flatten_with_path, tree_unflatten

from .. import pytree
from .spec import MeshAxes, PartitionSpec

__all__ = ["Rules", "ShardingRuleError", "resolve", "resolve_tree"]

Rule = Tuple[str, MeshAxes]
LogicalAxes = Tuple[Optional[str], ...]

# The resolver's "not assigned yet" marker. Module-level, not `object()` per call: `constrain`
# resolves specs while torch.compile traces the step, and Dynamo cannot trace `object()`.
_UNASSIGNED = object()


class ShardingRuleError(ValueError):
    """A rule set that cannot place a tensor; the message names the tensor, the rule and the fix."""


def _mesh_tuple(mesh_axes: MeshAxes) -> Tuple[str, ...]:
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


class Rules(tuple):
    """An ordered, validated tuple of `(logical_axis, mesh_axes)` pairs (highest precedence first)."""

    def __new__(cls, rules: Iterable[Sequence[Any]] = ()) -> "Rules":
        if isinstance(rules, Rules):
            return rules
        if isinstance(rules, (str, bytes, Mapping)):
            raise ShardingRuleError(
                f"rules must be an ordered list of (logical_axis, mesh_axes) pairs, got {type(rules).__name__}; "
                f"e.g. [('batch', 'dp'), ('mlp', 'tp'), ('embed', None)]."
            )
        out = []
        for i, rule in enumerate(rules):
            if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
                raise ShardingRuleError(
                    f"rule {i} is {rule!r}; each rule is a (logical_axis: str, mesh_axes) pair where mesh_axes "
                    f"is a mesh axis name, a tuple of names or None, e.g. ('mlp', 'tp')."
                )
            name, mesh_axes = rule
            try:
                mesh_axes = PartitionSpec(mesh_axes)[0]
            except TypeError:
                raise ShardingRuleError(
                    f"rule {i} ({name!r}, {mesh_axes!r}): mesh_axes must be a mesh axis name, a tuple of names "
                    f"or None."
                ) from None
            repeated = [a for a in _mesh_tuple(mesh_axes) if _mesh_tuple(mesh_axes).count(a) > 1]
            if repeated:
                raise ShardingRuleError(f"rule {i} ({name!r}, {mesh_axes!r}) names mesh axis {repeated[0]!r} twice.")
            out.append((name, mesh_axes))
        return super().__new__(cls, out)

    def __add__(self, other: Iterable[Sequence[Any]]) -> "Rules":
        return Rules(tuple(self) + tuple(Rules(other)))

    def __repr__(self) -> str:
        return f"Rules({list(self)!r})"

    def mesh_axes(self) -> Tuple[str, ...]:
        """Every mesh axis named by some rule, in first-use order."""
        seen: Dict[str, None] = {}
        for _, mesh_axes in self:
            for a in _mesh_tuple(mesh_axes):
                seen.setdefault(a)
        return tuple(seen)

    def logical_axes(self) -> Tuple[str, ...]:
        """Every logical axis some rule mentions, in first-use order."""
        return tuple(dict.fromkeys(n for n, _ in self))

    def check_mesh(self, mesh_names: Sequence[str]) -> "Rules":
        """Raise if a rule names a mesh axis that `mesh_names` lacks (a typo, or a missing `axis=1`)."""
        for i, (name, mesh_axes) in enumerate(self):
            for a in _mesh_tuple(mesh_axes):
                if a not in mesh_names:
                    raise ShardingRuleError(
                        f"rule {i} ({name!r}, {mesh_axes!r}) names mesh axis {a!r}, but the mesh has axes "
                        f"{tuple(mesh_names)}; fix the name, add {a}=1 to the mesh, or drop the rule "
                        f"(`rules.restrict_to(mesh.names)` does that for a ready-made rule set)."
                    )
        return self

    def restrict_to(self, mesh_names: Sequence[str]) -> "Rules":
        """These rules with mesh axes missing from `mesh_names` removed (an emptied rule replicates)."""
        keep = []
        for name, mesh_axes in self:
            axes = tuple(a for a in _mesh_tuple(mesh_axes) if a in mesh_names)
            keep.append((name, axes or None))
        return Rules(keep)


EXPERT_AXIS = "expert"
"""The logical axis of stacked experts: its mesh axis carries the all-to-all of expert parallelism."""


def _check_expert_axis(axes: Tuple[Optional[str], ...], result: list, pos: int, rule: Rule, i: int,
                       mesh_sizes: Optional[Mapping[str, int]], name: str) -> None:
    """Refuse a rule that would put the expert dimension's mesh axis on a second dimension of one tensor.

    Flax semantics would quietly fall back to the next rule; for experts that hides a layout GSPMD
    turns from an all-to-all into an all-gather plus a reduce-scatter (maxtext#4179).
    """
    for d, r in enumerate(result):
        if r is _UNASSIGNED or r is None:
            continue
        shared = set(_mesh_tuple(r)) & set(_mesh_tuple(rule[1]))
        if mesh_sizes is not None:
            shared = {a for a in shared if mesh_sizes.get(a, 1) > 1}
        if shared and EXPERT_AXIS in (axes[d], axes[pos]):
            other = axes[pos] if axes[d] == EXPERT_AXIS else axes[d]
            raise ShardingRuleError(
                f"{name}: rule {i} {rule} maps '{axes[pos]}' to mesh axis {sorted(shared)[0]!r}, which dimension "
                f"'{axes[d]}' of the same tensor (axes {axes}) already uses; one tensor may put '{EXPERT_AXIS}' on a "
                f"mesh axis and nothing else there (else the token exchange is no longer an all-to-all). Map "
                f"'{other}' to another mesh axis or to None before that rule.")


def resolve(
    axes: Sequence[Optional[str]],
    rules: Rules,
    *,
    mesh_sizes: Optional[Mapping[str, int]] = None,
    shape: Optional[Sequence[int]] = None,
    name: str = "tensor",
) -> PartitionSpec:
    """The `PartitionSpec` the rules give a tensor whose dimensions are called `axes`.

    Args:
        axes: one logical name (or None: never sharded) per dimension.
        rules: a `Rules` (or a list of pairs).
        mesh_sizes: axis name -> size; when given, rules must only name these axes, size-1 axes are
            dropped and, with `shape`, each dimension must divide by its mesh axes' product.
        shape: the tensor's shape, to check divisibility.
        name: the tensor's dotted name, for error messages.

    Raises:
        ShardingRuleError: see the module docstring.
    """
    rules = Rules(rules)
    axes = tuple(axes)
    named = [a for a in axes if a is not None]
    if not all(isinstance(a, str) for a in named):
        raise ShardingRuleError(f"{name}: logical axes must be names or None, got {axes!r}.")
    dups = sorted({a for a in named if named.count(a) > 1})
    if dups:
        raise ShardingRuleError(
            f"{name}: logical axis {dups[0]!r} names two dimensions of axes {axes}; give each dimension its own "
            f"name (for example 'embed' and 'embed_out')."
        )
    if shape is not None and len(shape) != len(axes):
        raise ShardingRuleError(f"{name}: axes {axes} name {len(axes)} dimensions but its shape is {tuple(shape)}.")
    if mesh_sizes is not None:
        rules.check_mesh(tuple(mesh_sizes))

    unassigned = _UNASSIGNED
    result: list = [unassigned if a is not None else None for a in axes]
    blocked: Dict[int, Tuple[int, Rule]] = {}
    for i, (logical, mesh_axes) in enumerate(rules):
        if logical not in axes:
            continue
        pos = axes.index(logical)
        if result[pos] is not unassigned:
            continue
        taken = {a for r in result if r is not unassigned for a in _mesh_tuple(r)}
        if taken.intersection(_mesh_tuple(mesh_axes)):
            _check_expert_axis(axes, result, pos, (logical, mesh_axes), i, mesh_sizes, name)
            blocked.setdefault(pos, (i, (logical, mesh_axes)))
            continue
        result[pos] = mesh_axes
    for pos, r in enumerate(result):
        if r is not unassigned:
            continue
        logical = axes[pos]
        if pos in blocked:
            i, rule = blocked[pos]
            other = next(axes[d] for d, rr in enumerate(result)
                         if rr is not unassigned and set(_mesh_tuple(rr)) & set(_mesh_tuple(rule[1])))
            raise ShardingRuleError(
                f"{name}: rule {i} {rule} would use mesh axis {rule[1]!r} twice in one tensor (dimension "
                f"'{other}' already has it, axes {axes}), and '{logical}' has no other rule; add a fallback after "
                f"it, e.g. ('{logical}', None) to replicate that dimension or ('{logical}', '<other mesh axis>')."
            )
        raise ShardingRuleError(
            f"{name}: no rule mentions logical axis {logical!r} (dimension {pos} of axes {axes}); add a rule for "
            f"it, e.g. ('{logical}', 'tp') to shard it or ('{logical}', None) to replicate it."
        )
    spec = PartitionSpec(*result)
    if mesh_sizes is not None:
        spec = PartitionSpec(*(tuple(a for a in spec.mesh_axes_of(d) if mesh_sizes[a] > 1) for d in range(len(spec))))
        if shape is not None:
            for d, size in enumerate(shape):
                split = spec.mesh_axes_of(d)
                parts = 1
                for a in split:
                    parts *= mesh_sizes[a]
                if size % parts and axes[d] == EXPERT_AXIS:
                    fits = [n for n in range(1, size + 1) if size % n == 0]
                    raise ShardingRuleError(
                        f"{name}: {size} experts do not split evenly over "
                        f"{_degree(split, mesh_sizes)} devices; expert parallelism "
                        f"gives each device the same number of experts: use a degree among {fits}, or change the "
                        f"expert count.")
                if size % parts:
                    raise ShardingRuleError(
                        f"{name}: dimension {d} ('{axes[d]}') has size {size}, which does not divide by "
                        f"{_degree(split, mesh_sizes)}; change the model size or the "
                        f"mesh, or replicate that dimension with a rule ('{axes[d]}', None) placed before the others."
                    )
    return spec


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def resolve_tree(
    axes_tree: Any,
    rules: Rules,
    *,
    mesh_sizes: Optional[Mapping[str, int]] = None,
    shapes: Any = None,
) -> Any:
    """`resolve` for every leaf of a model's `axes` tree; returns the same tree of `PartitionSpec`s.

    `shapes`, when given, is the params tree (tensors or meta tensors), used for the shape and
    divisibility checks. Error messages name each parameter by its dotted path.
    """
    rules = Rules(rules)
    flat, treedef = tree_flatten_with_path(axes_tree, is_leaf=_is_axes)
    shape_of: Dict[str, Sequence[int]] = {}
    if shapes is not None:
        shape_of = {path: tuple(t.shape) for path, t in pytree.tree_leaves_with_path(shapes)}
    specs = []
    for path, ax in flat:
        dotted = pytree.keystr(path)
        if ax is None:  # a leaf without axes (e.g. a bridged buffer): replicated
            specs.append(PartitionSpec(*([None] * len(shape_of.get(dotted, ())))))
            continue
        specs.append(resolve(ax, rules, mesh_sizes=mesh_sizes, shape=shape_of.get(dotted), name=dotted))
    return tree_unflatten(specs, treedef)


def _degree(split: Sequence[str], mesh_sizes: Dict[str, int]) -> str:
    """`tp=2` for one axis, `fsdp=2 x tp=2 = 4` for several."""
    named = " x ".join(f"{a}={mesh_sizes[a]}" for a in split)
    if len(split) < 2:
        return named
    parts = 1
    for a in split:
        parts *= mesh_sizes[a]
    return f"{named} = {parts}"
