"""`Qwen3Config` and the named Qwen3 (dense) architectures.

Public names: `Qwen3Config`, `build_qwen3`; architectures `qwen3/{tiny,0.6b,1.7b,4b,8b,14b,32b}`
(registered with `ember.models.arch` when this module is imported).

Example:
    >>> from ember.models import get_config
    >>> cfg = get_config("qwen3", "0.6b")
    >>> cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.qk_norm, cfg.qkv_bias
    (1024, 16, 128, True, False)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from ..llama3.config import Llama3Config
from ..registry import arch, get_config, register_family

if TYPE_CHECKING:
    from .model import Qwen3

__all__ = ["Qwen3Config", "build_qwen3"]


@dataclasses.dataclass(frozen=True)
class Qwen3Config(Llama3Config):
    """Qwen3 hyperparameters (the fields are `Llama3Config`'s); defaults are Qwen3-8B."""

    vocab_size: int = 151936
    max_seq_len: int = 40960
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    d_model: int = 4096
    ffn_dim: int = 12288
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    attn_head_dim: Optional[int] = 128
    qk_norm: bool = True


def build_qwen3(config: Qwen3Config) -> "Qwen3":
    """The Qwen3 model for `config` (the family's build function in the registry)."""
    from .model import Qwen3

    return Qwen3(config)


register_family("qwen3", Qwen3Config, build_qwen3)


@arch("qwen3", "tiny")
def _tiny() -> Qwen3Config:
    """Byte-level toy model: 2 layers, d=128, 4 heads of 64 (wider than d / heads, as in Qwen3), GQA 4:2, tied."""
    return Qwen3Config(vocab_size=256, max_seq_len=256, n_layers=2, n_heads=4, n_kv_heads=2, d_model=128, ffn_dim=384,
                       attn_head_dim=64, tie_embeddings=True)


@arch("qwen3", "0.6b")
def _0_6b() -> Qwen3Config:
    """Qwen3-0.6B (0.60B params): d=1024, 28 layers, 16 heads of 128, GQA 16:8, tied."""
    return Qwen3Config(n_layers=28, n_heads=16, d_model=1024, ffn_dim=3072, tie_embeddings=True)


@arch("qwen3", "1.7b")
def _1_7b() -> Qwen3Config:
    """Qwen3-1.7B (1.72B params): d=2048, 28 layers, 16 heads of 128, tied."""
    return get_config("qwen3", "0.6b").replace(d_model=2048, ffn_dim=6144)


@arch("qwen3", "4b")
def _4b() -> Qwen3Config:
    """Qwen3-4B (4.02B params): d=2560, 36 layers, 32 heads of 128, tied."""
    return get_config("qwen3", "0.6b").replace(n_layers=36, n_heads=32, d_model=2560, ffn_dim=9728)


@arch("qwen3", "8b")
def _8b() -> Qwen3Config:
    """Qwen3-8B (8.19B params): the class defaults, untied."""
    return Qwen3Config()


@arch("qwen3", "14b")
def _14b() -> Qwen3Config:
    """Qwen3-14B (14.8B params): d=5120, 40 layers, 40 heads of 128."""
    return Qwen3Config(n_layers=40, n_heads=40, d_model=5120, ffn_dim=17408)


@arch("qwen3", "32b")
def _32b() -> Qwen3Config:
    """Qwen3-32B (32.8B params): d=5120, 64 layers, 64 heads of 128."""
    return Qwen3Config(n_layers=64, n_heads=64, d_model=5120, ffn_dim=25600)
