"""`Qwen3MoeConfig` and the named Qwen3-MoE architectures.

Public names: `Qwen3MoeConfig`, `build_qwen3_moe`; architectures `qwen3_moe/{tiny,30b-a3b,235b-a22b}`
(registered with `ember.models.arch` when this module is imported).

The fields are the generic MoE decoder's (`ember.models.moe_decoder.MoEDecoderConfig`); Qwen3-MoE
sets Qwen3's attention (q/k norms, heads of 128) and softmax top-k routing renormalised.

Example:
    >>> from ember.models import get_config
    >>> cfg = get_config("qwen3_moe", "30b-a3b")
    >>> cfg.n_experts, cfg.experts_per_token, cfg.moe_ffn_dim, cfg.norm_topk_prob
    (128, 8, 768, True)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from ..moe_decoder.config import MoEDecoderConfig
from ..registry import arch, register_family

if TYPE_CHECKING:
    from .model import Qwen3Moe

__all__ = ["Qwen3MoeConfig", "build_qwen3_moe"]


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(MoEDecoderConfig):
    """Qwen3-MoE hyperparameters (`MoEDecoderConfig`'s fields with Qwen3's attention); defaults are Qwen3-30B-A3B."""

    vocab_size: int = 151936
    max_seq_len: int = 40960
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int = 4
    d_model: int = 2048
    ffn_dim: int = 6144
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    attn_head_dim: Optional[int] = 128
    qk_norm: bool = True
    n_experts: int = 128
    experts_per_token: int = 8
    moe_ffn_dim: int = 768
    norm_topk_prob: bool = True


def build_qwen3_moe(config: Qwen3MoeConfig) -> "Qwen3Moe":
    """The Qwen3-MoE model for `config` (the family's build function in the registry)."""
    from .model import Qwen3Moe

    return Qwen3Moe(config)


register_family("qwen3_moe", Qwen3MoeConfig, build_qwen3_moe)


@arch("qwen3_moe", "tiny")
def _tiny() -> Qwen3MoeConfig:
    """Byte-level toy model: 2 layers, d=128, 4 heads of 32, 8 experts of width 64, top-2, tied."""
    return Qwen3MoeConfig(vocab_size=256, max_seq_len=256, n_layers=2, n_heads=4, n_kv_heads=2, d_model=128,
                          ffn_dim=384, attn_head_dim=32, n_experts=8, experts_per_token=2, moe_ffn_dim=64,
                          tie_embeddings=True)


@arch("qwen3_moe", "30b-a3b")
def _30b_a3b() -> Qwen3MoeConfig:
    """Qwen3-30B-A3B (30.5B params, 3.3B active): the class defaults."""
    return Qwen3MoeConfig()


@arch("qwen3_moe", "235b-a22b")
def _235b_a22b() -> Qwen3MoeConfig:
    """Qwen3-235B-A22B (235B params, 22B active): d=4096, 94 layers, 64 heads, experts of width 1536."""
    return Qwen3MoeConfig(n_layers=94, n_heads=64, d_model=4096, ffn_dim=12288, moe_ffn_dim=1536)
