"""Mixtral (Mistral AI, "Mixtral of Experts", 2024): Mistral's attention, 8 experts in every layer.

Public names: `Mixtral`.

The model is the generic MoE decoder (`ember.models.moe_decoder.MoEDecoder`, read there); its config (`config.py`) drops the q/k
norms and makes every layer a mixture: each token takes the 2 best of 8 experts by softmax score, its
weights renormalised over the two.

Example:
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> params = build_model("mixtral", "tiny").init(random.key(0))
    >>> sorted(params["blocks"]["mlp"]), sorted(params["blocks"]["attn"])
    (['down', 'gate', 'router', 'up'], ['wk', 'wo', 'wq', 'wv'])
"""

from __future__ import annotations

import dataclasses

from ..moe_decoder.model import MoEDecoder
from .config import MixtralConfig

__all__ = ["Mixtral"]


@dataclasses.dataclass(frozen=True)
class Mixtral(MoEDecoder):
    """The Mixtral language model: `apply(params, tokens) -> logits` (see `Llama3` for the arguments).

    Attributes:
        config: the hyperparameters.
    """

    config: MixtralConfig = MixtralConfig()

    def validate(self) -> None:
        if not isinstance(self.config, MixtralConfig):
            raise TypeError(f"Mixtral needs a MixtralConfig, got {type(self.config).__name__}.")
