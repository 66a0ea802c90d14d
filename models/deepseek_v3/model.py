"""DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024): multi-head latent attention and
DeepSeek's mixture of experts.

Public names: `DeepseekV3`.

The decoder is the generic MoE decoder (`ember.models.moe_decoder.MoEDecoder`: pre-norm blocks whose
feed-forward layer is `ember.models.layers.MoE` after the first `first_dense_layers`, the router
stats carried through the blocks); the routing is dots1's (sigmoid scores picked with a correction
bias in groups, renormalised, times `routed_scaling_factor`, plus shared experts). What differs is
each block's attention: `ember.models.layers.LatentAttention`, with YaRN positions, and the decoding
cache it asks for (`cache_widths`: the latents, not per-head keys and values).

Parameter tree: the MoE decoder's, with each block's `attn` (see `LatentAttention`):

    blocks.{i}.attn.{wq_a,q_norm,wq_b}        (q_lora_rank, d), (q_lora_rank,), (H*(nope+rope), q_lora_rank)
    blocks.{i}.attn.{wkv_a,kv_norm,wkv_b}     (kv_lora_rank + rope, d), (kv_lora_rank,), (H*(nope+v), kv_lora_rank)
    blocks.{i}.attn.wo                        (d, H*v)

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> model = build_model("deepseek_v3", "tiny")
    >>> params = model.init(random.key(0))
    >>> sorted(params["blocks"][0]["attn"])
    ['kv_norm', 'q_norm', 'wkv_a', 'wkv_b', 'wo', 'wq_a', 'wq_b']
    >>> model.apply(params, torch.zeros(1, 8, dtype=torch.long)).shape
    torch.Size([1, 8, 256])
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

from ..layers import LatentAttention, Module
from ..layers import initializers as inits
from ..moe_decoder.model import MoEDecoder
from .config import DeepseekV3Config

__all__ = ["DeepseekV3"]


@dataclasses.dataclass(frozen=True)
class DeepseekV3(MoEDecoder):
    """The DeepSeek-V3 language model: `apply(params, tokens) -> logits` (see `Llama3` for the arguments).

    Attributes:
        config: the hyperparameters.
    """

    config: DeepseekV3Config = DeepseekV3Config()

    def validate(self) -> None:
        if not isinstance(self.config, DeepseekV3Config):
            raise TypeError(f"DeepseekV3 needs a DeepseekV3Config, got {type(self.config).__name__}.")

    def attention(self, init: inits.Initializer) -> Module:
        c = self.config
        return LatentAttention(c.d_model, c.n_heads, kv_rank=c.kv_lora_rank, nope_dim=c.qk_nope_head_dim,
                               rope_dim=c.qk_rope_head_dim, v_dim=c.v_head_dim, q_rank=c.q_lora_rank,
                               norm_eps=c.norm_eps, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, weight_init=init)

    def cache_widths(self) -> Dict[str, Tuple[int, int]]:
        """What decoding caches per token and layer: the latent and the rotated shared key."""
        return self.attention(inits.zeros()).cache_widths()
