"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"), nanoGPT-style.

Public names: `GPT2Config`, `GPT2`, `build_gpt2`; architectures `gpt2/{tiny,small,medium,large,xl}`.

Learned absolute positions, pre-norm LayerNorm blocks, GELU MLP (4x), biases everywhere, token
embedding tied to the output projection, dropout on embeddings / attention probabilities /
residual branches (active only when `apply` gets a key).

Parameter tree (`L = n_layers`, `d = d_model`, `V = vocab_size`, `F = ffn_dim`; torch layout, the
weight of a linear map is `(out, in)`):

    wte.weight                 (V, d)                 axes ("vocab", "embed")
    wpe.weight                 (max_seq_len, d)       axes (None, "embed")
    blocks.{i}.ln_1.{weight,bias}          (d,)
    blocks.{i}.attn.{wq,wk,wv}.{weight,bias}   (d, d), (d,)    weight axes ("heads", "embed")
    blocks.{i}.attn.wo.{weight,bias}       (d, d), (d,)        weight axes ("embed", "heads")
    blocks.{i}.ln_2.{weight,bias}          (d,)
    blocks.{i}.mlp.fc.{weight,bias}        (F, d), (F,)        weight axes ("mlp", "embed")
    blocks.{i}.mlp.proj.{weight,bias}      (d, F), (d,)        weight axes ("embed", "mlp")
    ln_f.{weight,bias}                     (d,)

`blocks` is a list; with `scan_layers=True` it is one tree whose leaves have a leading `(L,)` dim
(`blocks.attn.wq.weight: (L, d, d)`, axes prefixed with "layers"). Hugging Face `GPT2LMHeadModel`
stores `Conv1D` weights as `(in, out)`, fuses q/k/v into `c_attn`, and calls these `h.{i}.attn.c_attn`,
`c_proj`, `mlp.c_fc`, `mlp.c_proj`: a transpose and a split away.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> model = build_model("gpt2", "tiny")
    >>> params = model.init(random.key(0))
    >>> model.apply(params, torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 256])
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from ..core.partition_specs import constrain
from ..core.types import Key, Params
from . import _config_checks as checks
from ._checks import check_tokens
from .layers import MLP, Attention, Block, Dropout, Embedding, LayerNorm, Module, Sequential, Stacked
from .layers.block import RESIDUAL_AXES
from .layers import initializers as inits
from .registry import arch, get_config, register_family, replace_config

__all__ = ["GPT2", "GPT2Config", "build_gpt2"]


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
    scan_layers: bool = False
    """Stack the blocks' params along a leading "layers" axis and run them with scan."""
    remat: bool = False
    """Recompute each block's activations in the backward pass (activation checkpointing)."""

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

    @property
    def hidden_dim(self) -> int:
        """The MLP inner width actually used."""
        return 4 * self.d_model if self.ffn_dim is None else self.ffn_dim

    def replace(self, **changes: Any) -> "GPT2Config":
        """A copy with `changes` applied (validated; misspelt fields name the closest one)."""
        return replace_config(self, **changes)


@dataclasses.dataclass(frozen=True)
class GPT2(Module):
    """The GPT-2 language model: `apply(params, tokens) -> logits`.

    Attributes:
        config: the hyperparameters.
    """

    config: GPT2Config = GPT2Config()

    def validate(self) -> None:
        if not isinstance(self.config, GPT2Config):
            raise TypeError(f"GPT2 needs a GPT2Config, got {type(self.config).__name__}.")

    def declare(self):
        c = self.config
        std = inits.normal(c.init_std)
        # GPT-2 §2.3: "scale the weights of residual layers at initialization by 1/sqrt(N)", N the
        # number of residual layers (2 per block); nanoGPT: std 0.02 / sqrt(2 * n_layer).
        resid = inits.normal(c.init_std / math.sqrt(2 * c.n_layers))
        block = Block(
            attn=Attention(c.d_model, c.n_heads, bias=c.bias, dropout=c.dropout, qkv_init=std, out_init=resid),
            mlp=MLP(c.d_model, c.hidden_dim, bias=c.bias, activation=c.activation, fc_init=std, proj_init=resid),
            ln_1=LayerNorm(c.d_model, eps=c.layer_norm_eps, bias=c.bias),
            ln_2=LayerNorm(c.d_model, eps=c.layer_norm_eps, bias=c.bias),
            dropout=c.dropout,
        )
        if c.scan_layers:
            blocks = Stacked(block, c.n_layers, remat=c.remat)
        else:
            blocks = Sequential.repeat(block, c.n_layers, remat=c.remat)
        return {
            "wte": Embedding(c.vocab_size, c.d_model, weight_init=std),
            "wpe": Embedding(c.max_seq_len, c.d_model, vocab_axis=None, weight_init=std),
            "drop": Dropout(c.dropout),
            "blocks": blocks,
            "ln_f": LayerNorm(c.d_model, eps=c.layer_norm_eps, bias=c.bias),
        }

    def apply(self, params: Params, tokens: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Next-token logits.

        Args:
            params: the tree from `init`.
            tokens: (B, T) integer token ids, T <= config.max_seq_len.
            key: enables dropout when given (training); None is deterministic.
            **kwargs: passed to every layer; `positions` (T,) or (B, T) overrides arange(T),
                `segment_ids` / `attention_mask` (B, T) restrict attention (see `Attention`).

        Returns:
            (B, T, vocab_size) float32 logits.
        """
        check_tokens(tokens, max_seq_len=self.config.max_seq_len, field="GPT2Config.max_seq_len")
        if kwargs.get("positions") is None:
            kwargs["positions"] = torch.arange(tokens.shape[1], device=tokens.device)  # (T,)
        x = constrain(self.call("wte", params, tokens, **kwargs), RESIDUAL_AXES)  # (B, T, d)
        x = x + self.call("wpe", params, kwargs["positions"], **kwargs)  # (B, T, d) + (T or B, T, d)
        x = self.call("drop", params, x, key=key, **kwargs)
        x = self.call("blocks", params, x, key=key, **kwargs)  # (B, T, d)
        x = self.call("ln_f", params, x, **kwargs)
        return self.children["wte"].attend(params["wte"], x).float()  # (B, T, V), tied to wte


def build_gpt2(config: GPT2Config) -> GPT2:
    """The GPT-2 model for `config`."""
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
