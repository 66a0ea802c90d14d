"""`Block`: a pre-norm residual transformer block.

Public names: `Block`.

    x = x + drop_1(attn(ln_1(x)))
    x = x + drop_2(mlp(ln_2(x)))

(Pre-norm as in GPT-2, Radford et al. 2019, §2.3, and Llama.) The four sub-layers are any
`Module`s, so the same block serves GPT-2 (LayerNorm, GELU MLP) and Llama (RMSNorm, SwiGLU).

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models.layers import Attention, Block, RMSNorm, SwiGLU
    >>> blk = Block(attn=Attention(16, 4), mlp=SwiGLU(16, 32), ln_1=RMSNorm(16), ln_2=RMSNorm(16))
    >>> list(blk.init(random.key(0)))
    ['ln_1', 'attn', 'ln_2', 'mlp']
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from torch import Tensor

from ...core.partition_specs import constrain
from ...core.types import Key, Params
from .dropout import Dropout
from .module import Module

__all__ = ["Block", "RESIDUAL_AXES"]

RESIDUAL_AXES = ("batch", "sequence", "embed")
"""Logical axes of the residual stream, constrained after each branch (whole under tensor parallelism)."""


@dataclasses.dataclass(frozen=True)
class Block(Module):
    """Pre-norm residual block with residual dropout.

    Attributes:
        attn: the token mixer, `(B, T, d) -> (B, T, d)`.
        mlp: the feed-forward layer, `(B, T, d) -> (B, T, d)`.
        ln_1: norm before `attn`.
        ln_2: norm before `mlp`.
        dropout: residual dropout rate (GPT-2's resid_pdrop), applied to each branch's output.
    """

    attn: Module
    mlp: Module
    ln_1: Module
    ln_2: Module
    dropout: float = 0.0

    def declare(self):
        return {
            "ln_1": self.ln_1,
            "attn": self.attn,
            "ln_2": self.ln_2,
            "mlp": self.mlp,
            "drop_1": Dropout(self.dropout),
            "drop_2": Dropout(self.dropout),
        }

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (B, T, d). Returns: (B, T, d)."""
        h = self.call("ln_1", params, x, key=key, **kwargs)
        h = self.call("attn", params, h, key=key, **kwargs)
        x = constrain(x + self.call("drop_1", params, h, key=key, **kwargs), RESIDUAL_AXES)
        h = self.call("ln_2", params, x, key=key, **kwargs)
        h = self.call("mlp", params, h, key=key, **kwargs)
        return constrain(x + self.call("drop_2", params, h, key=key, **kwargs), RESIDUAL_AXES)
