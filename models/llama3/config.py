"""`Llama3Config`, its validation, and the named Llama-3 architectures.

Public names: `Llama3Config`, `build_llama3`; architectures `llama3/{tiny,125m,1b,3b,8b,3.1-8b,70b}`
(registered with `ember.models.arch` when this module is imported).

Example:
    >>> from ember.models import get_config
    >>> cfg = get_config("llama3", "8b")
    >>> cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    (4096, 32, 8, 128)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Union

from .. import _checks as checks
from ..layers import RopeScaling, YarnScaling
from ..registry import arch, get_config, register_family, replace_config

if TYPE_CHECKING:
    from .model import Llama3

__all__ = ["Llama3Config", "build_llama3"]


@dataclasses.dataclass(frozen=True)
class Llama3Config:
    """Llama-3 hyperparameters; defaults are Meta-Llama-3-8B."""

    vocab_size: int = 128256
    """Vocabulary size (Llama 3's tiktoken BPE: 128,000 + 256 special tokens)."""
    max_seq_len: int = 8192
    """Longest input `apply` accepts (Llama 3: 8192; 3.1 and 3.2: 131072)."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Query heads; must divide d_model (head_dim = d_model / n_heads) unless `attn_head_dim` is set."""
    n_kv_heads: int = 8
    """Key/value heads for grouped-query attention (Ainslie et al. 2023); must divide n_heads.
    Equal to n_heads for plain multi-head attention."""
    d_model: int = 4096
    """Residual stream width (Meta's `dim`)."""
    ffn_dim: int = 14336
    """SwiGLU inner width (HF `intermediate_size`)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (Meta's `norm_eps`)."""
    rope_theta: float = 500000.0
    """RoPE base; Llama 3 raised it from 10,000 to 500,000 for long contexts (paper §3.1.1)."""
    rope_scaling: Optional[Union[RopeScaling, YarnScaling]] = None
    """Llama-3.1 RoPE frequency scaling (or YaRN); None for Llama 3.0 and toy models."""
    attn_head_dim: Optional[int] = None
    """Per-head width when it is not d_model / n_heads (Qwen3: 128 at d_model 1024 and 16 heads);
    None derives it. `head_dim` is the width in use."""
    qk_norm: bool = False
    """RMSNorm each query and key head before the rotary embedding (Qwen3's q_norm / k_norm)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (HF `attention_bias`; Llama 3: none; Qwen2: yes)."""
    sliding_window: Optional[int] = None
    """Each token attends to at most this many tokens, itself included (Mistral-7B-v0.1: 4096); None:
    all earlier tokens. A window shorter than the sequence puts attention on the masked path."""
    tie_embeddings: bool = False
    """Use the token embedding as the output projection (Llama 3.2 1B/3B) instead of `lm_head`."""
    pad_token_id: Optional[int] = None
    """HF `pad_token_id`, which transformers makes the embedding's `padding_idx`: that row starts at zero and
    gets no gradient from the lookup (a tied output projection still trains it). None: every row trains
    alike (Llama 3, Qwen, Mistral); Gemma's config.json sets 0."""
    init_std: float = 0.02
    """Standard deviation of weight init (HF `initializer_range`)."""
    scan_layers: bool = True
    """Store the blocks stacked along a leading "layers" axis and run them as one rolled loop each way
    (`remat_scan`), as MaxText and Levanter do: compile time flat in depth on Inductor and torch_xla,
    the optimizer update one batched leaf per parameter kind, and a "layers" axis the rules can shard.
    Blocks of different kinds (dense, then mixture of experts) become one stack per run of equal
    blocks (`Stacks`). False: a list of blocks (Hugging Face's layout, which `from_hf` and `to_hf`
    convert either way; checkpoints of either layout load with the matching setting)."""
    remat: str = "none"
    """Activation checkpointing per block: "none", "full" (keep block inputs only), "dots_saveable"
    (keep matmul outputs), "dots_with_no_batch_dims_saveable", or "save:<tag>,..." (keep the
    tensors the block tags with `checkpoint_name`: qkv, attn_out, mlp_hidden)."""
    loss_chunk_size: int = 0
    """Tokens per chunk of the LM-head loss in `lm_loss`: 0 computes the whole (B, T, V) logits at
    once; N > 0 never holds more than N x V logits (or their gradient)."""

    def __post_init__(self) -> None:
        checks.check_positive(
            self, "vocab_size", "max_seq_len", "n_layers", "n_heads", "n_kv_heads", "d_model", "ffn_dim"
        )
        if self.attn_head_dim is None:
            checks.check_divides(self, "n_heads", "d_model", why="each head gets d_model / n_heads dims")
        checks.check_divides(
            self, "n_kv_heads", "n_heads", why="each key/value head serves n_heads / n_kv_heads query heads"
        )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(
                f"{type(self).__name__}: head_dim = {self.head_dim} must be a positive even number for rotary "
                f"embeddings; change d_model={self.d_model}, n_heads={self.n_heads} or attn_head_dim."
            )
        if not self.norm_eps > 0:
            raise ValueError(f"Llama3Config.norm_eps must be > 0, got {self.norm_eps}.")
        if not self.rope_theta > 0:
            raise ValueError(f"Llama3Config.rope_theta must be > 0, got {self.rope_theta}.")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, (RopeScaling, YarnScaling)):
            raise TypeError(f"Llama3Config.rope_scaling must be a RopeScaling, a YarnScaling or None, got "
                            f"{type(self.rope_scaling).__name__}.")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"{type(self).__name__}.sliding_window must be > 0 or None, got {self.sliding_window}.")
        p, v = self.pad_token_id, self.vocab_size
        if p is not None and not (isinstance(p, int) and not isinstance(p, bool) and -v <= p < v):
            raise ValueError(f"{type(self).__name__}.pad_token_id must be None or a token id in [-{v}, {v}) (the "
                             f"vocabulary), got {p!r}; fix pad_token_id or vocab_size.")
        if not self.init_std >= 0:
            raise ValueError(f"Llama3Config.init_std must be >= 0, got {self.init_std}.")
        checks.check_non_negative(self, "loss_chunk_size")
        checks.check_remat(self, "remat")

    @property
    def head_dim(self) -> int:
        """Per-head width: `attn_head_dim`, or d_model / n_heads."""
        return self.d_model // self.n_heads if self.attn_head_dim is None else self.attn_head_dim

    def replace(self, **changes: Any) -> "Llama3Config":
        """A copy with `changes` applied (validated; misspelt fields name the closest one)."""
        return replace_config(self, **changes)


def build_llama3(config: Llama3Config) -> "Llama3":
    """The Llama-3 model for `config` (the family's build function in the registry)."""
    from .model import Llama3  # model.py imports this module for Llama3Config; import it on first build

    return Llama3(config)


register_family("llama3", Llama3Config, build_llama3)


@arch("llama3", "tiny")
def _tiny() -> Llama3Config:
    """Byte-level toy model (~0.43M params): 2 layers, d=128, GQA 4:2; runs fast on CPU."""
    return Llama3Config(
        vocab_size=256, max_seq_len=256, n_layers=2, n_heads=4, n_kv_heads=2, d_model=128, ffn_dim=384,
        rope_theta=10000.0, tie_embeddings=True,
    )


@arch("llama3", "125m")
def _125m() -> Llama3Config:
    """A ~125M-parameter Llama (129.0M) for benchmarks: 12 layers, d=768, GQA 12:4, 32K vocab, tied."""
    return Llama3Config(
        vocab_size=32768, max_seq_len=2048, n_layers=12, n_heads=12, n_kv_heads=4, d_model=768, ffn_dim=3072,
        tie_embeddings=True,
    )


@arch("llama3", "8b")
def _8b() -> Llama3Config:
    """Meta-Llama-3-8B (8.03B params): the class defaults."""
    return Llama3Config()


@arch("llama3", "3.1-8b")
def _31_8b() -> Llama3Config:
    """Llama-3.1-8B: Llama-3-8B shapes with RoPE scaling (factor 8) and a 128K context."""
    return get_config("llama3", "8b").replace(rope_scaling=RopeScaling(factor=8.0), max_seq_len=131072)


@arch("llama3", "1b")
def _1b() -> Llama3Config:
    """Llama-3.2-1B (1.24B params): d=2048, 16 layers, tied embeddings, RoPE scaling factor 32."""
    return get_config("llama3", "3.1-8b").replace(
        n_layers=16, d_model=2048, ffn_dim=8192, tie_embeddings=True, rope_scaling=RopeScaling(factor=32.0)
    )


@arch("llama3", "3b")
def _3b() -> Llama3Config:
    """Llama-3.2-3B (3.21B params): d=3072, 28 layers, 24 heads, tied embeddings."""
    return get_config("llama3", "1b").replace(n_layers=28, d_model=3072, n_heads=24)


@arch("llama3", "70b")
def _70b() -> Llama3Config:
    """Meta-Llama-3-70B (70.6B params): d=8192, 80 layers, 64 heads, 8 KV heads."""
    return get_config("llama3", "8b").replace(n_layers=80, d_model=8192, n_heads=64, ffn_dim=28672)
