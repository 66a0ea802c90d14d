"""Qwen3 (Alibaba, "Qwen3 Technical Report", 2025), dense models: Llama's decoder with q/k norms.

Public names: `Qwen3`.

The block is Llama's (`ember.models.llama3.model`, read there top to bottom). What Qwen3 changes is
in its config (`config.py`): each query and key head is RMS-normalised before the rotary embedding
(`qk_norm`, parameters `blocks.{i}.attn.{q_norm,k_norm}.weight` of shape `(head_dim,)`), the q, k, v
biases of Qwen2 are gone, and the head width (128) is set on its own rather than d_model / n_heads.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> model = build_model("qwen3", "tiny")
    >>> params = model.init(random.key(0))
    >>> tuple(params["blocks"]["attn"]["q_norm"]["weight"].shape), tuple(params["blocks"]["attn"]["wq"]["weight"].shape)
    ((2, 64), (2, 256, 128))
"""

from __future__ import annotations

import dataclasses

from ..llama3.model import Llama3
from .config import Qwen3Config

__all__ = ["Qwen3"]


@dataclasses.dataclass(frozen=True)
class Qwen3(Llama3):
    """The Qwen3 language model: `apply(params, tokens) -> logits` (see `Llama3` for the arguments).

    Attributes:
        config: the hyperparameters.
    """

    config: Qwen3Config = Qwen3Config()

    def validate(self) -> None:
        if not isinstance(self.config, Qwen3Config):
            raise TypeError(f"Qwen3 needs a Qwen3Config, got {type(self.config).__name__}.")
