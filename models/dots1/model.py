"""dots.llm1 (rednote-hilab, "dots.llm1 Technical Report", 2025): Qwen3's attention, DeepSeek-V3's routing.

Public names: `Dots1`.

The model is the generic MoE decoder (`ember.models.moe_decoder.MoEDecoder`, read there); its config (`config.py`) picks the
sigmoid router: each expert scores `sigmoid(w_e . x)`, a token takes the k best of `score + bias`
(the correction bias, `router.expert_bias`, selects but does not weight), and its weights are the
picked scores renormalised to sum to one, times `routed_scaling_factor`. Every token also goes
through the shared experts, and the first `first_dense_layers` blocks are dense.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> model = build_model("dots1", "tiny")
    >>> params = model.init(random.key(0))
    >>> sorted(params["blocks"][1]["mlp"]), sorted(params["blocks"][0]["mlp"])  # a stack per run: dense, MoE
    (['down', 'gate', 'router', 'shared', 'up'], ['down', 'gate', 'up'])
    >>> tuple(params["blocks"][1]["mlp"]["router"]["expert_bias"].shape)  # (MoE layers, experts)
    (2, 8)
"""

from __future__ import annotations

import dataclasses

from ..moe_decoder.model import MoEDecoder
from .config import Dots1Config

__all__ = ["Dots1"]


@dataclasses.dataclass(frozen=True)
class Dots1(MoEDecoder):
    """The dots.llm1 language model: `apply(params, tokens) -> logits` (see `Llama3` for the arguments).

    Attributes:
        config: the hyperparameters.
    """

    config: Dots1Config = Dots1Config()

    def validate(self) -> None:
        if not isinstance(self.config, Dots1Config):
            raise TypeError(f"Dots1 needs a Dots1Config, got {type(self.config).__name__}.")
