"""Mistral 7B (Mistral AI, "Mistral 7B", 2023): Llama's decoder with a sliding attention window.

Public names: `Mistral`.

The block is Llama's (`ember.models.llama3.model`, read there top to bottom): RMSNorm pre-norm,
rotary positions, grouped-query attention without biases, SwiGLU. What Mistral changes is in its
config (`config.py`): v0.1 lets each token attend to the 4,096 tokens before it and itself
(`sliding_window`; paper §2), later versions drop the window and raise RoPE theta to 1,000,000.
The parameter tree is Llama's.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> model = build_model("mistral", "tiny")
    >>> model.config.sliding_window, model.apply(model.init(random.key(0)), torch.zeros(1, 8, dtype=torch.long)).shape
    (64, torch.Size([1, 8, 256]))
"""

from __future__ import annotations

import dataclasses

from ..llama3.model import Llama3
from .config import MistralConfig

__all__ = ["Mistral"]


@dataclasses.dataclass(frozen=True)
class Mistral(Llama3):
    """The Mistral language model: `apply(params, tokens) -> logits` (see `Llama3` for the arguments).

    Attributes:
        config: the hyperparameters.
    """

    config: MistralConfig = MistralConfig()

    def validate(self) -> None:
        if not isinstance(self.config, MistralConfig):
            raise TypeError(f"Mistral needs a MistralConfig, got {type(self.config).__name__}.")
