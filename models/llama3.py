"""Llama 3 (Meta, "The Llama 3 Herd of Models", 2024), top to bottom.

Public names: `Llama3Config`, `Llama3`, `build_llama3`; architectures
`llama3/{tiny,125m,1b,3b,8b,3.1-8b,70b}`.

RMSNorm pre-norm blocks, rotary positions (theta 500,000; optional Llama-3.1 frequency scaling),
grouped-query attention without biases, SwiGLU feed-forward, untied (8B, 70B) or tied (1B, 3B)
output projection.

Parameter tree (`L = n_layers`, `d = d_model`, `V = vocab_size`, `H = n_heads`, `KV = n_kv_heads`,
`D = d // H`, `F = ffn_dim`; torch layout, the weight of a linear map is `(out, in)`):

    wte.weight                      (V, d)       axes ("vocab", "embed")
    blocks.{i}.ln_1.weight          (d,)         axes ("embed",)
    blocks.{i}.attn.wq.weight       (H*D, d)     axes ("heads", "embed")
    blocks.{i}.attn.wk.weight       (KV*D, d)    axes ("kv_heads", "embed")
    blocks.{i}.attn.wv.weight       (KV*D, d)    axes ("kv_heads", "embed")
    blocks.{i}.attn.wo.weight       (d, H*D)     axes ("embed", "heads")
    blocks.{i}.ln_2.weight          (d,)
    blocks.{i}.mlp.gate.weight      (F, d)       axes ("mlp", "embed")
    blocks.{i}.mlp.up.weight        (F, d)       axes ("mlp", "embed")
    blocks.{i}.mlp.down.weight      (d, F)       axes ("embed", "mlp")
    ln_f.weight                     (d,)
    lm_head.weight                  (V, d)       axes ("vocab", "embed")   absent when tie_embeddings

These are Hugging Face `LlamaForCausalLM`'s tensors in the same layout, with no transposes and no
q/k permutation (RoPE uses HF's rotate-half pairing): `model.embed_tokens`, `model.layers.{i}.
{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}`,
`model.norm`, `lm_head`. With `scan_layers=True`, `blocks` is one tree with a leading `(L,)` dim.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> model = build_model("llama3", "tiny")
    >>> model.apply(model.init(random.key(0)), torch.zeros(1, 16, dtype=torch.long)).shape
    torch.Size([1, 16, 256])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor

from ..core.partition_specs import constrain
from ..core.types import Key, Params
from . import _config_checks as checks
from ._checks import check_tokens
from .layers import (
    Attention,
    Block,
    Embedding,
    Linear,
    Module,
    RMSNorm,
    RopeScaling,
    RotaryEmbedding,
    Sequential,
    Stacked,
    SwiGLU,
)
from .layers import initializers as inits
from .layers.block import RESIDUAL_AXES
from .registry import arch, get_config, register_family, replace_config

__all__ = ["Llama3", "Llama3Config", "build_llama3"]


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
    """Query heads; must divide d_model (head_dim = d_model / n_heads)."""
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
    rope_scaling: Optional[RopeScaling] = None
    """Llama-3.1 RoPE frequency scaling; None for Llama 3.0 and toy models."""
    tie_embeddings: bool = False
    """Use the token embedding as the output projection (Llama 3.2 1B/3B) instead of `lm_head`."""
    init_std: float = 0.02
    """Standard deviation of weight init (HF `initializer_range`)."""
    scan_layers: bool = False
    """Stack the blocks' params along a leading "layers" axis and run them with scan."""
    remat: bool = False
    """Recompute each block's activations in the backward pass (activation checkpointing)."""

    def __post_init__(self) -> None:
        checks.check_positive(
            self, "vocab_size", "max_seq_len", "n_layers", "n_heads", "n_kv_heads", "d_model", "ffn_dim"
        )
        checks.check_divides(self, "n_heads", "d_model", why="each head gets d_model / n_heads dims")
        checks.check_divides(
            self, "n_kv_heads", "n_heads", why="each key/value head serves n_heads / n_kv_heads query heads"
        )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"Llama3Config: head_dim = d_model / n_heads = {self.d_model // self.n_heads} must be even "
                f"for rotary embeddings; change d_model={self.d_model} or n_heads={self.n_heads}."
            )
        if not self.norm_eps > 0:
            raise ValueError(f"Llama3Config.norm_eps must be > 0, got {self.norm_eps}.")
        if not self.rope_theta > 0:
            raise ValueError(f"Llama3Config.rope_theta must be > 0, got {self.rope_theta}.")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(
                f"Llama3Config.rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}."
            )
        if not self.init_std >= 0:
            raise ValueError(f"Llama3Config.init_std must be >= 0, got {self.init_std}.")

    @property
    def head_dim(self) -> int:
        """Per-head width, d_model / n_heads."""
        return self.d_model // self.n_heads

    def replace(self, **changes: Any) -> "Llama3Config":
        """A copy with `changes` applied (validated; misspelt fields name the closest one)."""
        return replace_config(self, **changes)


@dataclasses.dataclass(frozen=True)
class Llama3(Module):
    """The Llama-3 language model: `apply(params, tokens) -> logits`.

    Attributes:
        config: the hyperparameters.
    """

    config: Llama3Config = Llama3Config()

    def validate(self) -> None:
        if not isinstance(self.config, Llama3Config):
            raise TypeError(f"Llama3 needs a Llama3Config, got {type(self.config).__name__}.")

    def declare(self):
        c = self.config
        std = inits.normal(c.init_std)  # HF LlamaPreTrainedModel._init_weights: N(0, initializer_range)
        rope = RotaryEmbedding(c.head_dim, theta=c.rope_theta, scaling=c.rope_scaling)
        block = Block(
            attn=Attention(c.d_model, c.n_heads, c.n_kv_heads, bias=False, rope=rope, qkv_init=std, out_init=std),
            mlp=SwiGLU(c.d_model, c.ffn_dim, gate_init=std, down_init=std),
            ln_1=RMSNorm(c.d_model, eps=c.norm_eps),
            ln_2=RMSNorm(c.d_model, eps=c.norm_eps),
        )
        if c.scan_layers:
            blocks = Stacked(block, c.n_layers, remat=c.remat)
        else:
            blocks = Sequential.repeat(block, c.n_layers, remat=c.remat)
        spec = {
            "wte": Embedding(c.vocab_size, c.d_model, weight_init=std),
            "blocks": blocks,
            "ln_f": RMSNorm(c.d_model, eps=c.norm_eps),
        }
        if not c.tie_embeddings:
            spec["lm_head"] = Linear(
                c.d_model, c.vocab_size, bias=False, in_axis="embed", out_axis="vocab", weight_init=std
            )
        return spec

    def apply(self, params: Params, tokens: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Next-token logits.

        Args:
            params: the tree from `init`.
            tokens: (B, T) integer token ids, T <= config.max_seq_len.
            key: passed down for layers that use randomness (the built-in Llama has no dropout).
            **kwargs: passed to every layer; `positions` (T,) or (B, T) overrides arange(T) for RoPE,
                `segment_ids` / `attention_mask` (B, T) restrict attention (see `Attention`).

        Returns:
            (B, T, vocab_size) float32 logits.
        """
        check_tokens(tokens, max_seq_len=self.config.max_seq_len, field="Llama3Config.max_seq_len")
        if kwargs.get("positions") is None:
            kwargs["positions"] = torch.arange(tokens.shape[1], device=tokens.device)  # (T,)
        x = constrain(self.call("wte", params, tokens, **kwargs), RESIDUAL_AXES)  # (B, T, d)
        x = self.call("blocks", params, x, key=key, **kwargs)  # (B, T, d)
        x = self.call("ln_f", params, x, **kwargs)
        if self.config.tie_embeddings:
            return self.children["wte"].attend(params["wte"], x).float()  # (B, T, V)
        return self.call("lm_head", params, x, **kwargs).float()  # (B, T, V)


def build_llama3(config: Llama3Config) -> Llama3:
    """The Llama-3 model for `config`."""
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
