"""`MistralConfig` and the named Mistral architectures.

Public names: `MistralConfig`, `build_mistral`; architectures `mistral/{tiny,7b-v0.1,7b}` (registered
with `ember.models.arch` when this module is imported; `7b` is Mistral-7B-v0.3).

Example:
    >>> from ember.models import get_config
    >>> get_config("mistral", "7b-v0.1").sliding_window, get_config("mistral", "7b").sliding_window
    (4096, None)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..llama3.config import Llama3Config
from ..registry import arch, get_config, register_family

if TYPE_CHECKING:
    from .model import Mistral

__all__ = ["MistralConfig", "build_mistral"]


@dataclasses.dataclass(frozen=True)
class MistralConfig(Llama3Config):
    """Mistral hyperparameters (the fields are `Llama3Config`'s); defaults are Mistral-7B-v0.3."""

    vocab_size: int = 32768
    max_seq_len: int = 32768
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    d_model: int = 4096
    ffn_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 1000000.0


def build_mistral(config: MistralConfig) -> "Mistral":
    """The Mistral model for `config` (the family's build function in the registry)."""
    from .model import Mistral

    return Mistral(config)


register_family("mistral", MistralConfig, build_mistral)


@arch("mistral", "tiny")
def _tiny() -> MistralConfig:
    """Byte-level toy model: 2 layers, d=128, GQA 4:2, a 64-token window; runs fast on CPU."""
    return MistralConfig(
        vocab_size=256, max_seq_len=256, n_layers=2, n_heads=4, n_kv_heads=2, d_model=128, ffn_dim=384,
        rope_theta=10000.0, sliding_window=64,
    )


@arch("mistral", "7b")
def _7b() -> MistralConfig:
    """Mistral-7B-v0.3 (7.25B params): the class defaults, no sliding window."""
    return MistralConfig()


@arch("mistral", "7b-v0.1")
def _7b_v01() -> MistralConfig:
    """Mistral-7B-v0.1 (7.24B params): a 32,000-token vocabulary, RoPE theta 10,000, a 4,096-token window."""
    return get_config("mistral", "7b").replace(vocab_size=32000, rope_theta=10000.0, sliding_window=4096)
