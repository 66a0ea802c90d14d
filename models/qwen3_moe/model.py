"""Qwen3-MoE (Alibaba, "Qwen3 Technical Report", 2025): Qwen3's decoder with mixture-of-experts layers.

Public names: `Qwen3Moe`.

The model is the generic MoE decoder (`ember.models.moe_decoder.MoEDecoder`, read there: its blocks,
the router stats they carry, the parameter tree); the config (`config.py`) gives it Qwen3's attention
(q/k norms, heads of 128) and softmax top-k routing over 128 experts.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> model = build_model("qwen3_moe", "tiny")
    >>> params = model.init(random.key(0))
    >>> tuple(params["blocks"]["mlp"]["gate"].shape)  # (layers, experts, hidden, embed)
    (2, 8, 64, 128)
    >>> hidden, stats = model.features_and_extras(params, torch.zeros(2, 16, dtype=torch.long))
    >>> hidden.shape, float(stats["rows"])     # 2 MoE layers x 32 tokens
    (torch.Size([2, 16, 128]), 64.0)
"""

from __future__ import annotations

import dataclasses

from ..moe_decoder.model import MoEDecoder
from .config import Qwen3MoeConfig

__all__ = ["Qwen3Moe"]


@dataclasses.dataclass(frozen=True)
class Qwen3Moe(MoEDecoder):
    """The Qwen3-MoE language model: `apply(params, tokens) -> logits` (see `Llama3` for the arguments).

    Attributes:
        config: the hyperparameters.
    """

    config: Qwen3MoeConfig = Qwen3MoeConfig()

    def validate(self) -> None:
        if not isinstance(self.config, Qwen3MoeConfig):
            raise TypeError(f"Qwen3Moe needs a Qwen3MoeConfig, got {type(self.config).__name__}.")
