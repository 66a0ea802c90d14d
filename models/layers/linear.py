"""`Linear`: an affine map with torch's weight layout.

Public names: `Linear`.

The weight is stored `(out_features, in_features)` exactly like `torch.nn.Linear` (and Hugging
Face Llama checkpoints), and applied with `torch.nn.functional.linear`; its logical axes are
therefore `(out_axis, in_axis)`.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models.layers import Linear
    >>> lin = Linear(8, 32, bias=False, in_axis="embed", out_axis="mlp")
    >>> lin.axes
    {'weight': ('mlp', 'embed')}
    >>> lin.apply(lin.init(random.key(0)), torch.ones(2, 5, 8)).shape
    torch.Size([2, 5, 32])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.partition_specs.context_parallel import split_rows
from ...core.types import Key, Params
from . import initializers as inits
from .module import Module
from .param import Param

__all__ = ["Linear"]


@dataclasses.dataclass(frozen=True)
class Linear(Module):
    """`y = x @ weight.T + bias`.

    Attributes:
        in_features: size of the last input dimension.
        out_features: size of the last output dimension.
        bias: whether to add a bias.
        in_axis: logical name of the input feature dimension (e.g. "embed").
        out_axis: logical name of the output feature dimension (e.g. "mlp").
        weight_init: initializer of the `(out, in)` weight (default LeCun normal, as Flax's Dense).
        bias_init: initializer of the bias (default zeros).
        dtype: parameter dtype.
    """

    in_features: int
    out_features: int
    bias: bool = True
    in_axis: Optional[str] = None
    out_axis: Optional[str] = None
    weight_init: inits.Initializer = inits.lecun_normal()
    bias_init: inits.Initializer = inits.zeros()
    dtype: torch.dtype = torch.float32

    reads_key = False

    def validate(self) -> None:
        for name in ("in_features", "out_features"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"Linear.{name} must be a positive int, got {v!r}.")

    def declare(self):
        spec = {
            "weight": Param(
                (self.out_features, self.in_features),
                init=self.weight_init,
                axes=(self.out_axis, self.in_axis),
                dtype=self.dtype,
            )
        }
        if self.bias:
            spec["bias"] = Param((self.out_features,), init=self.bias_init, axes=(self.out_axis,), dtype=self.dtype)
        return spec

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (..., in_features). Returns: (..., out_features)."""
        return split_rows(lambda rows: F.linear(rows, params["weight"], params["bias"] if self.bias else None), x)
