"""`Dots1Config` and the named dots.llm1 architectures.

Public names: `Dots1Config`, `build_dots1`; architectures `dots1/{tiny,142b-a14b}` (registered with
`ember.models.arch` when this module is imported).

The fields are the generic MoE decoder's (`MoEDecoderConfig`); what dots.llm1 sets is Qwen3's attention
and the routing (DeepSeek-V3's: sigmoid
scores picked with a correction bias, renormalised, times `routed_scaling_factor`), shared experts
and a first dense layer. transformers' Dots1 has no auxiliary loss, so `router_aux_loss_coef` is 0:
the released model balanced its experts by moving the bias (`expert_bias_update_rate`, DeepSeek-V3:
0.001), which stays fixed here unless set.

Example:
    >>> from ember.models import get_config
    >>> cfg = get_config("dots1", "142b-a14b")
    >>> cfg.n_experts, cfg.experts_per_token, cfg.n_shared_experts, cfg.router, cfg.routed_scaling_factor
    (128, 6, 2, 'sigmoid', 2.5)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from ..moe_decoder.config import MoEDecoderConfig
from ..registry import arch, register_family

if TYPE_CHECKING:
    from .model import Dots1

__all__ = ["Dots1Config", "build_dots1"]


@dataclasses.dataclass(frozen=True)
class Dots1Config(MoEDecoderConfig):
    """dots.llm1 hyperparameters; defaults are dots.llm1 (142B params, 14B active)."""

    vocab_size: int = 152064
    max_seq_len: int = 32768
    n_layers: int = 62
    n_heads: int = 32
    n_kv_heads: int = 32
    d_model: int = 4096
    ffn_dim: int = 10944
    norm_eps: float = 1e-5
    rope_theta: float = 10000000.0
    attn_head_dim: Optional[int] = 128
    qk_norm: bool = True
    n_experts: int = 128
    experts_per_token: int = 6
    moe_ffn_dim: int = 1408
    norm_topk_prob: bool = True
    router: str = "sigmoid"
    routed_scaling_factor: float = 2.5
    expert_bias: bool = True
    n_shared_experts: int = 2
    first_dense_layers: int = 1
    router_aux_loss_coef: float = 0.0


def build_dots1(config: Dots1Config) -> "Dots1":
    """The dots1 model for `config` (the family's build function in the registry)."""
    from .model import Dots1

    return Dots1(config)


register_family("dots1", Dots1Config, build_dots1)


@arch("dots1", "tiny")
def _tiny() -> Dots1Config:
    """Byte-level toy model: 3 layers (the first dense), d=128, 4 heads of 32, 8 experts of width 64 in 4 groups
    (2 groups picked), top-2, one shared expert, tied."""
    return Dots1Config(vocab_size=256, max_seq_len=256, n_layers=3, n_heads=4, n_kv_heads=2, d_model=128, ffn_dim=384,
                       attn_head_dim=32, n_experts=8, experts_per_token=2, moe_ffn_dim=64, n_expert_groups=4,
                       topk_groups=2, n_shared_experts=1, tie_embeddings=True)


@arch("dots1", "142b-a14b")
def _142b_a14b() -> Dots1Config:
    """dots.llm1 (142B params, 14B active): d=4096, 62 layers (the first dense), 32 heads of 128, 128 experts of
    width 1408, top-6, 2 shared experts; the class defaults."""
    return Dots1Config()
