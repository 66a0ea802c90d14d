"""Gemma (Google DeepMind, "Gemma: Open Models Based on Gemini Research and Technology", 2024).

Public names: `GemmaRMSNorm`, `GeGLU`, `Gemma`.

Llama's decoder (`ember.models.llama3.model`: pre-norm blocks, rotary positions, grouped-query
attention) with three changes, each below:
- the RMSNorm scales by `1 + weight` (weights start at zero), computed in float32;
- the feed-forward layer gates with GELU (tanh approximation) instead of SiLU (GeGLU);
- the token embeddings are multiplied by sqrt(d_model) before the first block; the output
  projection is always the embedding (tied).
The config (`config.py`) sets a head width of 256, independent of d_model / n_heads.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> model = build_model("gemma", "tiny")
    >>> params = model.init(random.key(0))
    >>> float(params["ln_f"]["weight"].abs().sum()), model.apply(params, torch.zeros(1, 4, dtype=torch.long)).shape
    (0.0, torch.Size([1, 4, 256]))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.remat_policies import checkpoint_name
from ...core.types import Key, Params
from ..layers import Module, Param, RMSNorm
from ..layers import initializers as inits
from ..llama3.model import Llama3, SwiGLU
from .config import GemmaConfig

__all__ = ["GeGLU", "Gemma", "GemmaRMSNorm"]


@dataclasses.dataclass(frozen=True)
class GemmaRMSNorm(RMSNorm):
    """`x / sqrt(mean(x**2) + eps) * (1 + weight)` in float32; `weight` starts at zero (HF `GemmaRMSNorm`)."""

    def declare(self):
        return {"weight": Param((self.features,), init=inits.zeros(), axes=(self.axis,), dtype=self.dtype)}

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * (1.0 + params["weight"].float())).to(x.dtype)


@dataclasses.dataclass(frozen=True)
class GeGLU(SwiGLU):
    """`down(gelu_tanh(gate(x)) * up(x))` (Shazeer 2020, GEGLU); parameters as `SwiGLU`'s."""

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        gate = F.gelu(self.call("gate", params, x, **kwargs), approximate="tanh")
        h = checkpoint_name(gate * self.call("up", params, x, **kwargs), "mlp_hidden")  # (..., hidden)
        return self.call("down", params, h, **kwargs)


@dataclasses.dataclass(frozen=True)
class Gemma(Llama3):
    """The Gemma language model: `apply(params, tokens) -> logits` (see `Llama3` for the arguments).

    Attributes:
        config: the hyperparameters.
    """

    config: GemmaConfig = GemmaConfig()

    def validate(self) -> None:
        if not isinstance(self.config, GemmaConfig):
            raise TypeError(f"Gemma needs a GemmaConfig, got {type(self.config).__name__}.")
        if not self.config.tie_embeddings:
            raise ValueError("Gemma's output projection is its embedding: set tie_embeddings=True.")

    def norm(self) -> Module:
        return GemmaRMSNorm(self.config.d_model, eps=self.config.norm_eps)

    def feed_forward(self, init: inits.Initializer) -> Module:
        return GeGLU(self.config.d_model, self.config.ffn_dim, gate_init=init, down_init=init)

    def embed(self, params: Params, tokens: Tensor, **kwargs: Any) -> Tensor:
        x = self.call("wte", params, tokens, **kwargs)  # (B, T, d)
        return x * torch.tensor(math.sqrt(self.config.d_model), dtype=x.dtype)  # the scale rounded to x's dtype, as HF
