"""`Mesh`: named device axes (`"dp=8,tp=4"`) and the backend that lowers shardings onto them.

Public names: `Mesh`, `MeshError`, `BACKENDS`.

A mesh is a value: an ordered tuple of `(axis name, size)` pairs and a backend, `"dtensor"`
(torch.distributed `DeviceMesh`: NCCL on GPUs, gloo on CPU, one process per device) or `"xla"`
(torch_xla SPMD: one process per host drives every local device). `Mesh.parse` reads the
command-line form, where one size may be `-1` ("the rest of the devices"); `validate` checks the
product against the device count and says which meshes would fit.

The lowerings live in `ember.core.partition_specs` (`dtensor.device_mesh`, `xla.xla_mesh`); this
module only describes the mesh, so it is cheap to build and to test without devices.

Example:
    >>> m = Mesh.parse("dp=2,tp=-1", devices=8, backend="xla")
    >>> m
    Mesh('dp=2,tp=4', backend='xla')
    >>> m.shape, m.size, m["tp"]
    ((2, 4), 8, 4)
    >>> Mesh.parse("dp=3", devices=8, backend="xla")
    Traceback (most recent call last):
    ...
    ember.core.mesh.MeshError: mesh 'dp=3' needs 3 devices but 8 are available; the product of the axis sizes must equal the device count, e.g. --mesh dp=8 (or dp=-1 to use them all).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Dict, Optional, Sequence, Tuple

__all__ = ["BACKENDS", "Mesh", "MeshError"]

BACKENDS = ("dtensor", "xla")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class MeshError(ValueError):
    """A mesh that does not parse or does not fit the devices; the message names the fix."""


def _format(axes: Sequence[Tuple[str, int]]) -> str:
    return ",".join(f"{n}={s}" for n, s in axes)


def _suggest(axes: Sequence[Tuple[str, int]], devices: int) -> str:
    """A mesh like `axes` that fits `devices`: keep the other sizes if they divide, else put all on one."""
    names = [n for n, _ in axes]
    others = 1
    for _, s in axes[1:]:
        others *= max(s, 1)
    if len(names) == 1:
        return f"--mesh {names[0]}={devices} (or {names[0]}=-1 to use them all)"
    if devices % others == 0:
        keep = ",".join([f"{names[0]}={devices // others}"] + [f"{n}={s}" for n, s in axes[1:]])
        return f"--mesh {keep} (or {names[0]}=-1 for the rest)"
    return "--mesh " + ",".join([f"{names[0]}={devices}"] + [f"{n}=1" for n in names[1:]])


def default_backend() -> str:
    """`"xla"` when torch_xla is selected by the environment (PJRT_DEVICE set), else `"dtensor"`."""
    return "xla" if os.environ.get("PJRT_DEVICE") else "dtensor"


@dataclasses.dataclass(frozen=True)
class Mesh:
    """Ordered named axes with sizes, and the backend that runs them.

    Attributes:
        axes: `((name, size), ...)`, major axis first (devices are laid out row-major).
        backend: `"dtensor"` or `"xla"`.
    """

    axes: Tuple[Tuple[str, int], ...]
    backend: str = "dtensor"

    def __post_init__(self) -> None:
        axes = tuple((str(n), int(s)) for n, s in self.axes)
        object.__setattr__(self, "axes", axes)
        if not axes:
            raise MeshError("a mesh needs at least one axis, e.g. --mesh dp=2")
        names = [n for n, _ in axes]
        for n, s in axes:
            if not _NAME.match(n):
                raise MeshError(f"mesh axis name {n!r} is not an identifier; use names like dp, fsdp, tp.")
            if s < 1:
                raise MeshError(f"mesh axis {n}={s}: sizes must be >= 1 (use -1 only in Mesh.parse).")
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise MeshError(f"mesh axis {dups[0]!r} appears twice in {_format(axes)!r}; give each axis once.")
        if self.backend not in BACKENDS:
            raise MeshError(f"mesh backend {self.backend!r} is not one of {BACKENDS}.")

    @classmethod
    def parse(cls, text: str, *, devices: Optional[int] = None, backend: Optional[str] = None) -> "Mesh":
        """Parse `"dp=8,tp=4"`; one size may be `-1` (the rest of `devices`).

        Args:
            text: comma-separated `name=size` pairs, major axis first.
            devices: the device count to fill `-1` and to validate against (None: no check,
                and `-1` is an error).
            backend: `"dtensor"` or `"xla"`; default from the environment (`PJRT_DEVICE` set -> xla).

        Raises:
            MeshError: malformed text, or a mesh that does not fit `devices` (says what would).
        """
        pairs = []
        for part in [p.strip() for p in str(text).split(",") if p.strip()]:
            name, eq, size = part.partition("=")
            try:
                if not eq:
                    raise ValueError
                pairs.append((name.strip(), int(size)))
            except ValueError:
                raise MeshError(f"cannot parse mesh axis {part!r} in {text!r}; expected name=size, "
                                f"e.g. --mesh dp=2,tp=4") from None
        if not pairs:
            raise MeshError(f"empty mesh {text!r}; expected e.g. --mesh dp=2,tp=4")
        rest = [n for n, s in pairs if s == -1]
        if len(rest) > 1:
            raise MeshError(f"only one mesh axis may be -1, got {rest} in {text!r}.")
        if rest:
            if devices is None:
                raise MeshError(f"mesh {text!r} uses -1 but the device count is unknown; give every size.")
            known = 1
            for _, s in pairs:
                known *= s if s != -1 else 1
            if known < 1 or devices % known:
                raise MeshError(f"mesh {text!r}: the other axes use {known} devices, which does not divide "
                                f"the {devices} available; {_suggest([(n, max(s, 1)) for n, s in pairs], devices)}.")
            pairs = [(n, devices // known if s == -1 else s) for n, s in pairs]
        mesh = cls(tuple(pairs), backend or default_backend())
        if devices is not None:
            mesh.validate(devices)
        return mesh

    # ---- views -------------------------------------------------------------------------------

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def size(self) -> int:
        out = 1
        for s in self.shape:
            out *= s
        return out

    def sizes(self) -> Dict[str, int]:
        return dict(self.axes)

    def __getitem__(self, name: str) -> int:
        """The size of axis `name` (KeyError naming the axes there are)."""
        for n, s in self.axes:
            if n == name:
                return s
        raise KeyError(f"mesh {self} has no axis {name!r}; its axes are {self.names}.")

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __str__(self) -> str:
        return _format(self.axes)

    def __repr__(self) -> str:
        return f"Mesh({str(self)!r}, backend={self.backend!r})"

    def in_order(self, order: Sequence[str]) -> "Mesh":
        """This mesh with the axes named in `order` laid out in that order (the others keep their places).

        A split over several axes is major-first in mesh order, so where a layout needs one axis
        inside another (expert parallelism: `ep` minor to the other batch axes, so its token
        exchange is an all-to-all over `ep` alone), the launchers put the mesh in the layout's order.
        """
        slots = [i for i, (n, _) in enumerate(self.axes) if n in order]
        ranked = sorted((self.axes[i] for i in slots), key=lambda a: list(order).index(a[0]))
        axes = list(self.axes)
        for i, a in zip(slots, ranked):
            axes[i] = a
        return Mesh(tuple(axes), self.backend)

    # ---- checks ------------------------------------------------------------------------------

    def validate(self, devices: int) -> "Mesh":
        """Check that the mesh uses exactly `devices` devices; return self.

        Raises:
            MeshError: naming the mesh size, the device count and a mesh that would fit.
        """
        if self.size != devices:
            raise MeshError(
                f"mesh {str(self)!r} needs {self.size} devices but {devices} are available; the product of "
                f"the axis sizes must equal the device count, e.g. {_suggest(self.axes, devices)}."
            )
        return self
