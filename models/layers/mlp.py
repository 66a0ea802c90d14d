"""Feed-forward layers: `MLP` (two matrices, GELU: GPT-2) and `SwiGLU` (three matrices: Llama).

Public names: `MLP`, `SwiGLU`, `ACTIVATIONS`.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models.layers import SwiGLU
    >>> ffn = SwiGLU(d_model=8, hidden=24)
    >>> sorted(ffn.init(random.key(0)))
    ['down', 'gate', 'up']
    >>> ffn.apply(ffn.init(random.key(0)), torch.randn(2, 3, 8)).shape
    torch.Size([2, 3, 8])
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.types import Key, Params
from . import initializers as inits
from .linear import Linear
from .module import Module

__all__ = ["ACTIVATIONS", "MLP", "SwiGLU"]

Activation = Literal["gelu", "gelu_tanh", "relu", "silu"]

ACTIVATIONS: Dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,  # exact erf form (Hendrycks & Gimpel 2016); nanoGPT's nn.GELU()
    # tanh approximation, used by the original GPT-2 code and HF's "gelu_new"
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


@dataclasses.dataclass(frozen=True)
class MLP(Module):
    """`proj(act(fc(x)))`: parameters `fc` (hidden, d_model) and `proj` (d_model, hidden).

    Attributes:
        d_model: input and output width.
        hidden: inner width (GPT-2: 4 * d_model).
        bias: biases on both matrices.
        activation: one of "gelu", "gelu_tanh", "relu", "silu".
        fc_init: initializer of `fc.weight`.
        proj_init: initializer of `proj.weight` (GPT-2 scales it by 1/sqrt(2 * n_layers)).
        dtype: parameter dtype.
    """

    d_model: int
    hidden: int
    bias: bool = True
    activation: Activation = "gelu"
    fc_init: inits.Initializer = inits.normal(0.02)
    proj_init: inits.Initializer = inits.normal(0.02)
    dtype: torch.dtype = torch.float32

    def validate(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"MLP.activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}."
            )

    def declare(self):
        return {
            "fc": Linear(self.d_model, self.hidden, bias=self.bias, in_axis="embed", out_axis="mlp",
                         weight_init=self.fc_init, dtype=self.dtype),
            "proj": Linear(self.hidden, self.d_model, bias=self.bias, in_axis="mlp", out_axis="embed",
                           weight_init=self.proj_init, dtype=self.dtype),
        }

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (..., d_model). Returns: (..., d_model)."""
        h = ACTIVATIONS[self.activation](self.call("fc", params, x, **kwargs))  # (..., hidden)
        return self.call("proj", params, h, **kwargs)


@dataclasses.dataclass(frozen=True)
class SwiGLU(Module):
    """`down(silu(gate(x)) * up(x))` (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6).

    Parameters `gate`, `up` (hidden, d_model) and `down` (d_model, hidden), no biases; these are
    HF Llama's `gate_proj`, `up_proj`, `down_proj` (Meta's w1, w3, w2).

    Attributes:
        d_model: input and output width.
        hidden: inner width (Llama-3 8B: 14336).
        gate_init: initializer of `gate` and `up`.
        down_init: initializer of `down`.
        dtype: parameter dtype.
    """

    d_model: int
    hidden: int
    gate_init: inits.Initializer = inits.normal(0.02)
    down_init: inits.Initializer = inits.normal(0.02)
    dtype: torch.dtype = torch.float32

    def declare(self):
        def lin(i: int, o: int, ia: str, oa: str, init: inits.Initializer) -> Linear:
            return Linear(i, o, bias=False, in_axis=ia, out_axis=oa, weight_init=init, dtype=self.dtype)

        return {
            "gate": lin(self.d_model, self.hidden, "embed", "mlp", self.gate_init),
            "up": lin(self.d_model, self.hidden, "embed", "mlp", self.gate_init),
            "down": lin(self.hidden, self.d_model, "mlp", "embed", self.down_init),
        }

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (..., d_model). Returns: (..., d_model)."""
        h = F.silu(self.call("gate", params, x, **kwargs)) * self.call("up", params, x, **kwargs)  # (..., hidden)
        return self.call("down", params, h, **kwargs)
