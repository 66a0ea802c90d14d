"""`Param`: the declaration of one parameter (shape, initializer, logical axes, dtype).

Public names: `Param`.

A layer declares its parameters as `Param`s and never allocates them itself: `Module.init(key)`
turns every declaration into a tensor, `Module.param_shapes()` into a meta tensor, and
`Module.axes` reads the logical axis names (one per dimension, e.g. `("embed", "mlp")`; `None`
means "never sharded") that the partition-spec rules map onto mesh axes.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models.layers import Param, initializers as inits
    >>> p = Param((16, 4), init=inits.normal(0.02), axes=("mlp", "embed"))
    >>> p.create(random.key(0)).shape
    torch.Size([16, 4])
    >>> p.abstract().device
    device(type='meta')
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

import torch
from torch import Tensor

from ...core.types import Key, LogicalAxes
from .initializers import Initializer

__all__ = ["Param"]


@dataclasses.dataclass(frozen=True, init=False)
class Param:
    """One declared parameter.

    Attributes:
        shape: the tensor's shape (a tuple of non-negative ints).
        init: `init(key, shape, dtype) -> Tensor`, see `ember.models.layers.initializers`.
        axes: one logical axis name (or `None`) per dimension, `len(axes) == len(shape)`.
        dtype: storage dtype of the parameter (float32 by default).
    """

    shape: Tuple[int, ...]
    init: Initializer
    axes: LogicalAxes
    dtype: torch.dtype

    def __init__(
        self,
        shape: Sequence[int],
        *,
        init: Initializer,
        axes: Sequence[str | None],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = tuple(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"Param shape must be a tuple of non-negative ints, got {shape!r}.")
        axes = tuple(axes)
        if len(axes) != len(shape):
            raise ValueError(
                f"Param axes must name every dimension: shape {shape} has {len(shape)} dims but "
                f"axes {axes!r} has {len(axes)}. Use None for a dimension that is never sharded."
            )
        if not all(a is None or isinstance(a, str) for a in axes):
            raise TypeError(f"Param axes must be strings or None, got {axes!r}.")
        if not callable(init):
            raise TypeError(
                f"Param init must be a callable init(key, shape, dtype), got {type(init).__name__}. "
                f"Use one from ember.models.layers.initializers, e.g. normal(0.02)."
            )
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"Param dtype must be a torch.dtype, got {type(dtype).__name__}.")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "init", init)
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "dtype", dtype)

    def create(self, key: Key, *, path: str = "") -> Tensor:
        """Run the initializer; `path` only names the parameter in errors.

        Raises:
            ValueError: if the initializer returned a tensor of the wrong shape or dtype.
        """
        t = self.init(key, self.shape, self.dtype)
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise ValueError(
                f"initializer {self.init!r} for parameter {path or '<param>'} returned "
                f"{tuple(t.shape)} {t.dtype}, expected {self.shape} {self.dtype}."
            )
        return t

    def abstract(self) -> Tensor:
        """A meta tensor with this parameter's shape and dtype (allocates nothing)."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")

    def stacked(self, n: int, axis_name: str = "layers") -> "Param":
        """The declaration of `n` copies stacked along a new leading dimension named `axis_name`."""
        return Param((n, *self.shape), init=self.init, axes=(axis_name, *self.axes), dtype=self.dtype)
