"""`Qwen2Config` and the named Qwen2.5 architectures.

Public names: `Qwen2Config`, `build_qwen2`; architectures `qwen2/{tiny,0.5b,1.5b,3b,7b,14b,32b,72b}`
(registered with `ember.models.arch` when this module is imported; the sizes of the Qwen2.5 release).

Example:
    >>> from ember.models import get_config
    >>> cfg = get_config("qwen2", "0.5b")
    >>> cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.qkv_bias, cfg.tie_embeddings
    (896, 14, 2, 64, True, True)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..llama3.config import Llama3Config
from ..registry import arch, get_config, register_family

if TYPE_CHECKING:
    from .model import Qwen2

__all__ = ["Qwen2Config", "build_qwen2"]


@dataclasses.dataclass(frozen=True)
class Qwen2Config(Llama3Config):
    """Qwen2 hyperparameters (the fields are `Llama3Config`'s); defaults are Qwen2.5-7B."""

    vocab_size: int = 152064
    max_seq_len: int = 32768
    n_layers: int = 28
    n_heads: int = 28
    n_kv_heads: int = 4
    d_model: int = 3584
    ffn_dim: int = 18944
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    qkv_bias: bool = True


def build_qwen2(config: Qwen2Config) -> "Qwen2":
    """The Qwen2 model for `config` (the family's build function in the registry)."""
    from .model import Qwen2

    return Qwen2(config)


register_family("qwen2", Qwen2Config, build_qwen2)


@arch("qwen2", "tiny")
def _tiny() -> Qwen2Config:
    """Byte-level toy model: 2 layers, d=128, GQA 4:2, tied; runs fast on CPU."""
    return Qwen2Config(
        vocab_size=256, max_seq_len=256, n_layers=2, n_heads=4, n_kv_heads=2, d_model=128, ffn_dim=384,
        tie_embeddings=True,
    )


@arch("qwen2", "0.5b")
def _0_5b() -> Qwen2Config:
    """Qwen2.5-0.5B (0.49B params): d=896, 24 layers, GQA 14:2, tied."""
    return Qwen2Config(vocab_size=151936, n_layers=24, n_heads=14, n_kv_heads=2, d_model=896, ffn_dim=4864,
                       tie_embeddings=True)


@arch("qwen2", "1.5b")
def _1_5b() -> Qwen2Config:
    """Qwen2.5-1.5B (1.54B params): d=1536, 28 layers, GQA 12:2, tied."""
    return get_config("qwen2", "0.5b").replace(n_layers=28, n_heads=12, d_model=1536, ffn_dim=8960)


@arch("qwen2", "3b")
def _3b() -> Qwen2Config:
    """Qwen2.5-3B (3.09B params): d=2048, 36 layers, GQA 16:2, tied."""
    return get_config("qwen2", "0.5b").replace(n_layers=36, n_heads=16, d_model=2048, ffn_dim=11008)


@arch("qwen2", "7b")
def _7b() -> Qwen2Config:
    """Qwen2.5-7B (7.62B params): the class defaults, untied."""
    return Qwen2Config()


@arch("qwen2", "14b")
def _14b() -> Qwen2Config:
    """Qwen2.5-14B (14.8B params): d=5120, 48 layers, GQA 40:8."""
    return Qwen2Config(n_layers=48, n_heads=40, n_kv_heads=8, d_model=5120, ffn_dim=13824)


@arch("qwen2", "32b")
def _32b() -> Qwen2Config:
    """Qwen2.5-32B (32.8B params): d=5120, 64 layers, GQA 40:8."""
    return get_config("qwen2", "14b").replace(n_layers=64, ffn_dim=27648)


@arch("qwen2", "72b")
def _72b() -> Qwen2Config:
    """Qwen2.5-72B (72.7B params): d=8192, 80 layers, GQA 64:8."""
    return Qwen2Config(n_layers=80, n_heads=64, n_kv_heads=8, d_model=8192, ffn_dim=29568)
