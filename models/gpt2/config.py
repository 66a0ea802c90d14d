"""`GPT2Config`, its validation, and the named GPT-2 architectures.

Public names: `GPT2Config`, `build_gpt2`; architectures `gpt2/{tiny,small,medium,large,xl}`
(registered with `ember.models.arch` when this module is imported).

Example:
    >>> from ember.models import get_config
    >>> cfg = get_config("gpt2", "small")
    >>> cfg.d_model, cfg.n_heads, cfg.hidden_dim
    (768, 12, 3072)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal, Optional

from .. import _checks as checks
from ..registry import arch, get_config, register_family, replace_config

if TYPE_CHECKING:
    from .model import GPT2

__all__ = ["GPT2Config", "build_gpt2"]


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2 hyperparameters; defaults are GPT-2 small (124M)."""

    vocab_size: int = 50257
    """Vocabulary size (GPT-2's BPE has 50257; nanoGPT pads to 50304 for faster matmuls)."""
    max_seq_len: int = 1024
    """Longest input `apply` accepts; the number of learned positions (GPT-2: 1024)."""
    n_layers: int = 12
    """Number of transformer blocks."""
    n_heads: int = 12
    """Attention heads; must divide d_model."""
    d_model: int = 768
    """Residual stream width."""
    ffn_dim: Optional[int] = None
    """MLP inner width; None means 4 * d_model (GPT-2)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches (GPT-2 used 0.1;
    0 is nanoGPT's choice for pretraining). Active only when apply gets a key."""
    bias: bool = True
    """Biases in linear layers and LayerNorms (GPT-2: True; nanoGPT offers False)."""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon (GPT-2: 1e-5)."""
    activation: Literal["gelu", "gelu_tanh"] = "gelu_tanh"
    """MLP nonlinearity: GPT-2's tanh approximation (HF "gelu_new") or exact erf GELU (nanoGPT)."""
    init_std: float = 0.02
    """Standard deviation of weight init (GPT-2 / HF initializer_range)."""
    scan_layers: bool = True
    """Store the blocks stacked along a leading "layers" axis and run them as one rolled loop each way
    (`remat_scan`), as MaxText and Levanter do: compile time flat in depth on Inductor and torch_xla,
    the optimizer update one batched leaf per parameter kind, and a "layers" axis the rules can shard.
    False: a list of blocks (Hugging Face's layout, which `from_hf` and `to_hf` convert either way)."""
    remat: str = "none"
    """Activation checkpointing per block: "none", "full" (keep block inputs only), "dots_saveable"
    (keep matmul outputs), "dots_with_no_batch_dims_saveable", or "save:<tag>,..." (keep the
    tensors the block tags with `checkpoint_name`: qkv, attn_out, mlp_hidden)."""
    loss_chunk_size: int = 0
    """Tokens per chunk of the LM-head loss in `lm_loss`: 0 computes the whole (B, T, V) logits at
    once; N > 0 never holds more than N x V logits (or their gradient)."""

    def __post_init__(self) -> None:
        checks.check_positive(self, "vocab_size", "max_seq_len", "n_layers", "n_heads", "d_model")
        if self.ffn_dim is not None:
            checks.check_positive(self, "ffn_dim")
        checks.check_divides(self, "n_heads", "d_model", why="each head gets d_model / n_heads dims")
        checks.check_range(self, "dropout", 0.0, 1.0)
        checks.check_choice(self, "activation", ("gelu", "gelu_tanh"))
        if not self.layer_norm_eps > 0:
            raise ValueError(f"GPT2Config.layer_norm_eps must be > 0, got {self.layer_norm_eps}.")
        if not self.init_std >= 0:
            raise ValueError(f"GPT2Config.init_std must be >= 0, got {self.init_std}.")
        checks.check_non_negative(self, "loss_chunk_size")
        checks.check_remat(self, "remat")

    @property
    def hidden_dim(self) -> int:
        """The MLP inner width actually used."""
        return 4 * self.d_model if self.ffn_dim is None else self.ffn_dim

    def replace(self, **changes: Any) -> "GPT2Config":
        """A copy with `changes` applied (validated; misspelt fields name the closest one)."""
        return replace_config(self, **changes)


def build_gpt2(config: GPT2Config) -> "GPT2":
    """The GPT-2 model for `config` (the family's build function in the registry)."""
    from .model import GPT2  # model.py imports this module for GPT2Config; import it on first build

    return GPT2(config)


register_family("gpt2", GPT2Config, build_gpt2)


@arch("gpt2", "tiny")
def _tiny() -> GPT2Config:
    """Byte-level toy model (~0.23M params) for tests and CPU runs."""
    return GPT2Config(vocab_size=256, max_seq_len=128, n_layers=4, n_heads=4, d_model=64)


@arch("gpt2", "small")
def _small() -> GPT2Config:
    """GPT-2 small, 124M (HF `gpt2`)."""
    return GPT2Config()


@arch("gpt2", "medium")
def _medium() -> GPT2Config:
    """GPT-2 medium, 350M (HF `gpt2-medium`)."""
    return get_config("gpt2", "small").replace(n_layers=24, n_heads=16, d_model=1024)


@arch("gpt2", "large")
def _large() -> GPT2Config:
    """GPT-2 large, 774M (HF `gpt2-large`)."""
    return get_config("gpt2", "small").replace(n_layers=36, n_heads=20, d_model=1280)


@arch("gpt2", "xl")
def _xl() -> GPT2Config:
    """GPT-2 XL, 1.5B (HF `gpt2-xl`)."""
    return get_config("gpt2", "small").replace(n_layers=48, n_heads=25, d_model=1600)
