"""`GemmaConfig` and the named Gemma 1 architectures.

Public names: `GemmaConfig`, `build_gemma`; architectures `gemma/{tiny,2b,7b}` (registered with
`ember.models.arch` when this module is imported).

Example:
    >>> from ember.models import get_config
    >>> cfg = get_config("gemma", "2b")
    >>> cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    (2048, 8, 1, 256)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from ..llama3.config import Llama3Config
from ..registry import arch, register_family

if TYPE_CHECKING:
    from .model import Gemma

__all__ = ["GemmaConfig", "build_gemma"]


@dataclasses.dataclass(frozen=True)
class GemmaConfig(Llama3Config):
    """Gemma hyperparameters (the fields are `Llama3Config`'s); defaults are Gemma-7B."""

    vocab_size: int = 256000
    max_seq_len: int = 8192
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 16
    d_model: int = 3072
    ffn_dim: int = 24576
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attn_head_dim: Optional[int] = 256
    tie_embeddings: bool = True
    pad_token_id: Optional[int] = 0  # as in Gemma's released configs: the pad row gets no lookup gradient


def build_gemma(config: GemmaConfig) -> "Gemma":
    """The Gemma model for `config` (the family's build function in the registry)."""
    from .model import Gemma

    return Gemma(config)


register_family("gemma", GemmaConfig, build_gemma)


@arch("gemma", "tiny")
def _tiny() -> GemmaConfig:
    """Byte-level toy model: 2 layers, d=128, 4 heads of 64, one key/value head."""
    return GemmaConfig(vocab_size=256, max_seq_len=256, n_layers=2, n_heads=4, n_kv_heads=1, d_model=128, ffn_dim=384,
                       attn_head_dim=64)


@arch("gemma", "2b")
def _2b() -> GemmaConfig:
    """Gemma-2B (2.51B params): d=2048, 18 layers, 8 heads of 256, multi-query (one key/value head)."""
    return GemmaConfig(n_layers=18, n_heads=8, n_kv_heads=1, d_model=2048, ffn_dim=16384)


@arch("gemma", "7b")
def _7b() -> GemmaConfig:
    """Gemma-7B (8.54B params): the class defaults."""
    return GemmaConfig()
