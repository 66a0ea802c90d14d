"""`PartitionSpec`: how each dimension of one tensor is laid out over named mesh axes.

Public names: `PartitionSpec`.

One entry per tensor dimension: `None` (replicated along that dimension), a mesh axis name
(`"tp"`: split over that axis) or a tuple of names (`("dp", "fsdp")`: split over both, the first
name major), exactly as `jax.sharding.PartitionSpec`. Specs come out of the rules
(`resolve`), and both lowerings read the same spec: DTensor placements and torch_xla's
`mark_sharding` partition tuple.

Example:
    >>> spec = PartitionSpec("fsdp", None, ("dp", "tp"))
    >>> spec
    PartitionSpec('fsdp', None, ('dp', 'tp'))
    >>> spec.mesh_axes_of(2), spec.mesh_axes_of(1)
    (('dp', 'tp'), ())
    >>> spec.used_mesh_axes()
    ('fsdp', 'dp', 'tp')
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

__all__ = ["PartitionSpec", "MeshAxes"]

MeshAxes = Union[None, str, Tuple[str, ...]]


def _normalize(entry: MeshAxes) -> MeshAxes:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)):
        names = tuple(entry)
        if not all(isinstance(n, str) for n in names):
            raise TypeError(f"PartitionSpec entries are None, a mesh axis name or a tuple of names; got {entry!r}.")
        if len(names) == 0:
            return None
        return names[0] if len(names) == 1 else names
    raise TypeError(f"PartitionSpec entries are None, a mesh axis name or a tuple of names; got {entry!r}.")


class PartitionSpec(tuple):
    """A tuple with one entry per tensor dimension: None, a mesh axis name, or a tuple of names.

    Single-name tuples collapse to the name and empty tuples to None, so equal layouts compare equal.
    """

    def __new__(cls, *entries: MeshAxes) -> "PartitionSpec":
        return super().__new__(cls, tuple(_normalize(e) for e in entries))

    def __repr__(self) -> str:
        return f"PartitionSpec({', '.join(repr(e) for e in self)})"

    def __reduce__(self):
        return (PartitionSpec, tuple(self))

    def mesh_axes_of(self, dim: int) -> Tuple[str, ...]:
        """The mesh axes dimension `dim` is split over, major first (empty when replicated)."""
        entry: Optional[MeshAxes] = self[dim]
        if entry is None:
            return ()
        return (entry,) if isinstance(entry, str) else tuple(entry)

    def used_mesh_axes(self) -> Tuple[str, ...]:
        """Every mesh axis the spec splits some dimension over, in dimension order."""
        return tuple(a for d in range(len(self)) for a in self.mesh_axes_of(d))

    @property
    def is_replicated(self) -> bool:
        """True if no dimension is split (the tensor is whole on every device)."""
        return all(e is None for e in self)
