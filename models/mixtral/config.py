"""`MixtralConfig` and the named Mixtral architectures.

Public names: `MixtralConfig`, `build_mixtral`; architectures `mixtral/{tiny,8x7b,8x22b}` (registered
with `ember.models.arch` when this module is imported).

The fields are the generic MoE decoder's (`MoEDecoderConfig`); what Mixtral sets is Mistral's attention (no q/k norms), every
layer a mixture of 8 experts, and softmax top-2 routing renormalised over the two picked.

Example:
    >>> from ember.models import get_config
    >>> cfg = get_config("mixtral", "8x7b")
    >>> cfg.n_experts, cfg.experts_per_token, cfg.moe_ffn_dim, cfg.qk_norm
    (8, 2, 14336, False)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from ..moe_decoder.config import MoEDecoderConfig
from ..registry import arch, register_family

if TYPE_CHECKING:
    from .model import Mixtral

__all__ = ["MixtralConfig", "build_mixtral"]


@dataclasses.dataclass(frozen=True)
class MixtralConfig(MoEDecoderConfig):
    """Mixtral hyperparameters; defaults are Mixtral-8x7B (46.7B params, 12.9B active)."""

    vocab_size: int = 32000
    max_seq_len: int = 32768
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    d_model: int = 4096
    ffn_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    attn_head_dim: Optional[int] = None
    qk_norm: bool = False
    n_experts: int = 8
    experts_per_token: int = 2
    moe_ffn_dim: int = 14336
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.02


def build_mixtral(config: MixtralConfig) -> "Mixtral":
    """The Mixtral model for `config` (the family's build function in the registry)."""
    from .model import Mixtral

    return Mixtral(config)


register_family("mixtral", MixtralConfig, build_mixtral)


@arch("mixtral", "tiny")
def _tiny() -> MixtralConfig:
    """Byte-level toy model: 2 layers, d=128, 4 heads of 32, 8 experts of width 64, top-2, tied."""
    return MixtralConfig(vocab_size=256, max_seq_len=256, n_layers=2, n_heads=4, n_kv_heads=2, d_model=128,
                         ffn_dim=64, n_experts=8, experts_per_token=2, moe_ffn_dim=64, tie_embeddings=True)


@arch("mixtral", "8x7b")
def _8x7b() -> MixtralConfig:
    """Mixtral-8x7B (46.7B params, 12.9B active): d=4096, 32 layers, 32 heads, 8 experts of width 14336, top-2."""
    return MixtralConfig()


@arch("mixtral", "8x22b")
def _8x22b() -> MixtralConfig:
    """Mixtral-8x22B (141B params, 39B active): d=6144, 56 layers, 48 heads, 8 experts of width 16384, top-2."""
    return MixtralConfig(vocab_size=32768, max_seq_len=65536, n_layers=56, n_heads=48, d_model=6144, ffn_dim=16384,
                         moe_ffn_dim=16384, router_aux_loss_coef=0.001)
