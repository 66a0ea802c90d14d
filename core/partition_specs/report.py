"""What a sharding does to a state: each parameter's spec and shard shape, and memory per device.

Public names: `describe_sharding`, `sharding_table`, `ShardRow`, `MemoryPerDevice`,
`memory_per_device`, `local_shape_of`.

Everything is computed from the specs (the layout's rules resolved against the mesh), not read
from devices, so the same report comes out for the DTensor and the torch_xla lowerings, and for
a state of meta tensors before anything is allocated (`model.param_shapes()`). A dimension split
over mesh axes of total size `k` holds `ceil(n / k)` rows per device (the rules already refuse
sizes that do not divide).

Example:
    >>> import torch
    >>> from ember.core.mesh import Mesh
    >>> params = {"w": torch.empty(64, 32, device="meta"), "b": torch.empty(32, device="meta")}
    >>> axes = {"w": ("mlp", "embed"), "b": ("embed",)}
    >>> print(describe_sharding(params, Mesh.parse("fsdp=2,tp=2", backend="xla"), axes=axes))
    mesh fsdp=2,tp=2 (4 devices, xla), layout fsdp_tp
    parameter  shape     spec            local shape
    b          (32,)     ('fsdp',)       (16,)
    w          (64, 32)  ('tp', 'fsdp')  (32, 16)
    per device: params 2.06 KiB of 8.12 KiB, optimizer state 0 B of 0 B, other 0 B of 0 B; total 2.06 KiB of 8.12 KiB (25.4%)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from ..pytree import tree_flatten_with_path

from .. import pytree
from ..mesh import Mesh
from .layouts import Layout, for_mesh
from .pipeline import PipelineSchedule, bubble_fraction
from .rules import EXPERT_AXIS, resolve_tree
from .sharding import Sharding, specs_like_params
from .spec import PartitionSpec

__all__ = ["MemoryPerDevice", "ShardRow", "describe_sharding", "local_shape_of", "memory_per_device", "sharding_table"]

Kind = str  # "param" | "optimizer" | "other"


def local_shape_of(shape: Sequence[int], spec: PartitionSpec, mesh_sizes: Mapping[str, int]) -> Tuple[int, ...]:
    """The shape one device holds of a tensor of `shape` laid out as `spec`.

    Example:
        >>> local_shape_of((64, 32), PartitionSpec("tp", ("dp", "fsdp")), {"dp": 2, "fsdp": 2, "tp": 4})
        (16, 8)
    """
    out = []
    for d, n in enumerate(shape):
        parts = math.prod(mesh_sizes[a] for a in spec.mesh_axes_of(d)) if d < len(spec) else 1
        out.append(-(-int(n) // parts))
    return tuple(out)


class ShardRow(NamedTuple):
    """One tensor of the state: where it is, how it is laid out, and its bytes in full and per device."""

    path: str
    kind: Kind
    shape: Tuple[int, ...]
    dtype: torch.dtype
    spec: PartitionSpec
    local_shape: Tuple[int, ...]

    @property
    def bytes(self) -> int:
        """Bytes of the full tensor."""
        return math.prod(self.shape) * _itemsize(self.dtype)

    @property
    def local_bytes(self) -> int:
        """Bytes one device holds."""
        return math.prod(self.local_shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _mesh_and_layout(sharding: Union[Sharding, Mesh], layout: Optional[Layout]) -> Tuple[Mesh, Layout]:
    if isinstance(sharding, Sharding):
        return sharding.mesh, layout or sharding.layout
    if isinstance(sharding, Mesh):
        return sharding, layout or for_mesh(sharding.names)
    raise TypeError(
        f"describe_sharding expects a Sharding or a Mesh (with an optional layout=...), got "
        f"{type(sharding).__name__}; e.g. describe_sharding(state, Mesh.parse('dp=2,tp=2'), axes=model.axes)."
    )


def sharding_table(
    tree: Any,
    sharding: Union[Sharding, Mesh],
    *,
    axes: Any,
    params: Any = None,
    layout: Optional[Layout] = None,
) -> List[ShardRow]:
    """One `ShardRow` per tensor leaf of `tree`, in tree order (a tensor appearing twice once).

    Parameters take the layout's params rules; subtrees shaped like the params (Adam's moments)
    inherit them (`specs_like_params`), everything else is replicated, exactly as `shard` places
    them. Kinds: `"param"` (in `params`), `"optimizer"` (under `tree.opt_state`), `"other"`.

    Args:
        tree: a TrainState, a params tree, or any tree holding the params; tensors or meta tensors.
        sharding: a `Sharding`, or a `Mesh` (no devices needed) with `layout`.
        axes: the model's `axes` tree (shaped like params).
        params: the params subtree of `tree` (default `tree.params` if present, else `tree`).
        layout: the layout to report (default: the Sharding's, or `for_mesh(mesh.names)`).

    Raises:
        ShardingRuleError: a parameter the rules cannot place (naming it and the fix).
    """
    mesh, layout = _mesh_and_layout(sharding, layout)
    if params is None:
        params = getattr(tree, "params", tree)
    param_specs = resolve_tree(axes, layout.params, mesh_sizes=mesh.sizes(), shapes=params)
    spec_tree = specs_like_params(tree, params, param_specs)
    flat_specs, _ = tree_flatten_with_path(spec_tree, is_leaf=lambda s: isinstance(s, PartitionSpec))
    spec_of = {pytree.keystr(p): s for p, s in flat_specs}
    param_path: dict = {}
    for path, t in pytree.tree_leaves_with_path(params):
        param_path.setdefault(id(t), path)
    opt_ids = {id(t) for t in pytree.tree_leaves(getattr(tree, "opt_state", None))} if tree is not params else set()
    rows, seen = [], set()
    for path, leaf in pytree.tree_leaves_with_path(tree):
        if not isinstance(leaf, torch.Tensor) or id(leaf) in seen:
            continue
        spec = spec_of[path]
        seen.add(id(leaf))
        kind = "param" if id(leaf) in param_path else "optimizer" if id(leaf) in opt_ids else "other"
        shape = tuple(int(n) for n in leaf.shape)
        rows.append(ShardRow(param_path.get(id(leaf), path), kind, shape, leaf.dtype, spec, local_shape_of(shape, spec, mesh.sizes())))
    return rows


@dataclasses.dataclass(frozen=True)
class MemoryPerDevice:
    """Bytes per device by kind, and the same state's bytes unsharded (one full replica)."""

    params: int
    optimizer: int
    other: int
    full_params: int
    full_optimizer: int
    full_other: int

    @property
    def total(self) -> int:
        """Bytes one device holds: params + optimizer state + other."""
        return self.params + self.optimizer + self.other

    @property
    def full_total(self) -> int:
        """Bytes of the whole state on one device (no sharding)."""
        return self.full_params + self.full_optimizer + self.full_other

    def __str__(self) -> str:
        b = _fmt_bytes
        return (
            f"per device: params {b(self.params)} of {b(self.full_params)}, optimizer state {b(self.optimizer)} of "
            f"{b(self.full_optimizer)}, other {b(self.other)} of {b(self.full_other)}; total {b(self.total)} of "
            f"{b(self.full_total)} ({self.total / max(self.full_total, 1):.1%})"
        )


def memory_per_device(rows: Sequence[ShardRow]) -> MemoryPerDevice:
    """Sum a `sharding_table` into bytes per device and bytes of one full replica, by kind."""
    by = {k: [0, 0] for k in ("param", "optimizer", "other")}
    for r in rows:
        by[r.kind][0] += r.local_bytes
        by[r.kind][1] += r.bytes
    return MemoryPerDevice(by["param"][0], by["optimizer"][0], by["other"][0], by["param"][1], by["optimizer"][1],
                           by["other"][1])


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _columns(lines: Sequence[Sequence[str]]) -> List[str]:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]) - 1)]
    return ["  ".join([c.ljust(w) for c, w in zip(line, widths)] + [line[-1]]).rstrip() for line in lines]


def describe_sharding(
    tree: Any,
    sharding: Union[Sharding, Mesh],
    *,
    axes: Any,
    params: Any = None,
    layout: Optional[Layout] = None,
    show_optimizer: bool = False,
) -> str:
    """A text report: the mesh, each parameter's shape, spec and shard shape, and memory per device.

    Args:
        tree: a TrainState, a params tree, or any tree holding the params (tensors or meta tensors).
        sharding: a `Sharding`, or a `Mesh` with `layout` (no devices needed).
        axes: the model's `axes` tree.
        params: the params subtree of `tree` (default `tree.params` if present, else `tree`).
        layout: the layout to report (default: the Sharding's, or `for_mesh(mesh.names)`).
        show_optimizer: also list every optimizer-state tensor (by default only parameters are
            listed; optimizer state is in the memory line either way).

    Returns:
        Lines: `mesh ...`, a table `parameter / shape / spec / local shape` sorted by path
        (parameters by their path inside the params, optimizer state after them), and `per device: params ..., optimizer state ..., other ...; total ...`.
    """
    mesh, layout = _mesh_and_layout(sharding, layout)
    rows = sharding_table(tree, mesh, axes=axes, params=params, layout=layout)
    shown = sorted((r for r in rows if r.kind == "param" or (show_optimizer and r.kind == "optimizer")),
                   key=lambda r: (r.kind != "param", r.path))
    table = [("parameter" if not show_optimizer else "tensor", "shape", "spec", "local shape")] + [
        (r.path, str(r.shape), str(tuple(r.spec)), str(r.local_shape)) for r in shown
    ]
    head = f"mesh {mesh} ({mesh.size} devices, {mesh.backend}), layout {layout.name}"
    return "\n".join([head] + _columns(table) + _experts_line(rows, axes) + _stages_line(rows, axes, mesh, sharding)
                     + [str(memory_per_device(rows))])


def _stages_line(rows: Sequence[ShardRow], axes: Any, mesh: Mesh, sharding: Any) -> List[str]:
    """`["pipeline: S stages of l layers (of L), M microbatches x R repeats, bubble b%"]` under `pp`, else `[]`."""
    stages = mesh.sizes().get("pp", 1)
    flat, _ = tree_flatten_with_path(axes, is_leaf=lambda a: isinstance(a, tuple))
    stacked = {pytree.keystr(p): a.index("layers") for p, a in flat if isinstance(a, tuple) and "layers" in a}
    row = next((r for r in rows if r.kind == "param" and r.path in stacked), None)
    if stages == 1 or row is None:
        return []
    schedule = getattr(sharding, "pipeline", None) or PipelineSchedule()
    microbatches, repeats = schedule.microbatches or stages, schedule.repeats
    layers = row.shape[stacked[row.path]]
    return [f"pipeline: {stages} stages of {layers // (stages * repeats)} layers (of {layers}), {microbatches} "
            f"microbatches x {repeats} repeat(s), bubble {bubble_fraction(stages, microbatches, repeats):.1%}"]


def _experts_line(rows: Sequence[ShardRow], axes: Any) -> List[str]:
    """`["experts: E per MoE layer, e per device"]` for a mixture of experts, else `[]`."""
    flat, _ = tree_flatten_with_path(axes, is_leaf=lambda a: isinstance(a, tuple))
    expert_dim = {pytree.keystr(p): a.index(EXPERT_AXIS) for p, a in flat if isinstance(a, tuple) and EXPERT_AXIS in a}
    for r in rows:
        if r.kind == "param" and r.path in expert_dim:
            d = expert_dim[r.path]
            return [f"experts: {r.shape[d]} per MoE layer, {r.local_shape[d]} per device"]
    return []
