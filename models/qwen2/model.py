"""Qwen2 / Qwen2.5 (Alibaba, "Qwen2 Technical Report", 2024): Llama's decoder with biased q, k, v.

Public names: `Qwen2`.

The block is Llama's (`ember.models.llama3.model`, read there top to bottom): RMSNorm pre-norm,
rotary positions, grouped-query attention, SwiGLU. What Qwen2 changes is in its config
(`config.py`): biases on the query, key and value projections (not on the output projection),
RoPE theta 1,000,000, a 151K vocabulary, and tied embeddings at the small sizes. The parameter tree
is Llama's plus `blocks.{i}.attn.{wq,wk,wv}.bias` (axes `("heads",)` / `("kv_heads",)`).

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> model = build_model("qwen2", "tiny")
    >>> params = model.init(random.key(0))
    >>> tuple(params["blocks"]["attn"]["wk"]["bias"].shape), "bias" in params["blocks"]["attn"]["wo"]  # (L, ...)
    ((2, 64), False)
"""

from __future__ import annotations

import dataclasses

from ..llama3.model import Llama3
from .config import Qwen2Config

__all__ = ["Qwen2"]


@dataclasses.dataclass(frozen=True)
class Qwen2(Llama3):
    """The Qwen2 language model: `apply(params, tokens) -> logits` (see `Llama3` for the arguments).

    Attributes:
        config: the hyperparameters.
    """

    config: Qwen2Config = Qwen2Config()

    def validate(self) -> None:
        if not isinstance(self.config, Qwen2Config):
            raise TypeError(f"Qwen2 needs a Qwen2Config, got {type(self.config).__name__}.")
