"""Normalisation layers: `LayerNorm` (GPT-2) and `RMSNorm` (Llama).

Public names: `LayerNorm`, `RMSNorm`.

Both normalise over the last dimension. `RMSNorm` computes in float32 and casts the normalised
activations back to the input dtype before scaling, as Hugging Face's `LlamaRMSNorm` does, so bf16
models match reference implementations.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models.layers import RMSNorm
    >>> norm = RMSNorm(8)
    >>> norm.apply(norm.init(random.key(0)), torch.randn(2, 8)).shape
    torch.Size([2, 8])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.types import Key, Params
from . import initializers as inits
from .module import Module
from .param import Param

__all__ = ["LayerNorm", "RMSNorm"]


def _check_features(layer: str, features: Any, eps: Any) -> None:
    if not isinstance(features, int) or features <= 0:
        raise ValueError(f"{layer}.features must be a positive int, got {features!r}.")
    if not eps > 0:
        raise ValueError(f"{layer}.eps must be > 0, got {eps!r}.")


@dataclasses.dataclass(frozen=True)
class LayerNorm(Module):
    """`(x - mean) / sqrt(var + eps) * weight + bias` over the last dimension (Ba et al. 2016).

    Attributes:
        features: size of the last dimension.
        eps: variance epsilon (1e-5 in GPT-2 and `torch.nn.LayerNorm`).
        bias: whether to learn a shift.
        axis: logical name of the feature dimension.
        dtype: parameter dtype.
    """

    features: int
    eps: float = 1e-5
    bias: bool = True
    axis: Optional[str] = "embed"
    dtype: torch.dtype = torch.float32

    reads_key = False

    def validate(self) -> None:
        _check_features("LayerNorm", self.features, self.eps)

    def declare(self):
        spec = {"weight": Param((self.features,), init=inits.ones(), axes=(self.axis,), dtype=self.dtype)}
        if self.bias:
            spec["bias"] = Param((self.features,), init=inits.zeros(), axes=(self.axis,), dtype=self.dtype)
        return spec

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (..., features). Returns: same shape and dtype."""
        bias = params["bias"] if self.bias else None
        return F.layer_norm(x, (self.features,), params["weight"], bias, self.eps)


@dataclasses.dataclass(frozen=True)
class RMSNorm(Module):
    """`x / sqrt(mean(x**2) + eps) * weight` over the last dimension (Zhang & Sennrich 2019).

    Attributes:
        features: size of the last dimension.
        eps: epsilon inside the square root (Llama 3 uses 1e-5, `norm_eps` in Meta's params.json).
        axis: logical name of the feature dimension.
        dtype: parameter dtype.
    """

    features: int
    eps: float = 1e-5
    axis: Optional[str] = "embed"
    dtype: torch.dtype = torch.float32

    reads_key = False

    def validate(self) -> None:
        _check_features("RMSNorm", self.features, self.eps)

    def declare(self):
        return {"weight": Param((self.features,), init=inits.ones(), axes=(self.axis,), dtype=self.dtype)}

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (..., features). Returns: same shape, in the input dtype promoted with the weight's."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return params["weight"] * normed.to(x.dtype)
