"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"), nanoGPT-style.

Public names: `CausalSelfAttention`, `MLP`, `ACTIVATIONS`, `Block`, `GPT2`.

Learned absolute positions, pre-norm LayerNorm blocks, GELU MLP (4x), biases everywhere, token
embedding tied to the output projection, dropout on embeddings / attention probabilities /
residual branches (active only when `apply` gets a key). The config and the named sizes are in
`config.py`, the Hugging Face mapping in `hf.py`; the building blocks shared with other families
(Linear, LayerNorm, Embedding, the attention kernel) are in `ember.models.layers`.

Parameter tree (`L = n_layers`, `d = d_model`, `V = vocab_size`, `F = ffn_dim`; torch layout, the
weight of a linear map is `(out, in)`):

    wte.weight                 (V, d)                 axes ("vocab", "embed")
    wpe.weight                 (max_seq_len, d)       axes (None, "embed")
    blocks.{i}.ln_1.{weight,bias}          (d,)
    blocks.{i}.attn.wq.{weight,bias}       (d, d), (d,)        weight axes ("heads", "embed")
    blocks.{i}.attn.{wk,wv}.{weight,bias}  (d, d), (d,)        weight axes ("kv_heads", "embed")
    blocks.{i}.attn.wo.{weight,bias}       (d, d), (d,)        weight axes ("embed", "heads")
    blocks.{i}.ln_2.{weight,bias}          (d,)
    blocks.{i}.mlp.fc.{weight,bias}        (F, d), (F,)        weight axes ("mlp", "embed")
    blocks.{i}.mlp.proj.{weight,bias}      (d, F), (d,)        weight axes ("embed", "mlp")
    ln_f.{weight,bias}                     (d,)

By default (`scan_layers=True`) `blocks` is one tree whose leaves have a leading `(L,)` dim
(`blocks.attn.wq.weight: (L, d, d)`, axes prefixed with "layers"); with `scan_layers=False` it is the
list shown above. Hugging Face `GPT2LMHeadModel`
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
import functools
import math
from typing import Any, Callable, Dict, Literal, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.partition_specs import constrain
from ...core.remat_policies import checkpoint_name
from ...core.types import Key, Params
from .._checks import check_tokens
from ..layers import Dropout, Embedding, LayerNorm, Linear, Module, Sequential, Stacked, dot_product_attention
from ..layers import initializers as inits
from ..layers.axes import RESIDUAL_AXES
from .config import GPT2Config

__all__ = ["ACTIVATIONS", "Block", "CausalSelfAttention", "GPT2", "MLP"]


@dataclasses.dataclass(frozen=True)
class CausalSelfAttention(Module):
    """Multi-head causal self-attention with biases and probability dropout.

    Parameters: `wq`, `wk`, `wv` (d_model, d_model) and `wo` (d_model, d_model), torch layout, each a
    `Linear` (with `.bias` when `bias=True`); HF fuses the first three into `c_attn`. Keys and values
    carry the logical axis "kv_heads" (as in grouped-query models), so one rule set shards both.

    Keyword inputs read from `**kwargs`: `segment_ids` (B, T), tokens attend only within their
    segment; `attention_mask` (B, T), 0 for padding keys (see `dot_product_attention`).

    Attributes:
        d_model: model width.
        n_heads: H; must divide d_model (D = d_model / H).
        bias: biases on all four projections.
        dropout: attention-probability dropout rate (GPT-2's attn_pdrop).
        qkv_init: initializer of wq, wk, wv.
        out_init: initializer of wo (GPT-2 scales it by 1/sqrt(2 * n_layers)).
        dtype: parameter dtype.
    """

    d_model: int
    n_heads: int
    bias: bool = True
    dropout: float = 0.0
    qkv_init: inits.Initializer = inits.normal(0.02)
    out_init: inits.Initializer = inits.normal(0.02)
    dtype: torch.dtype = torch.float32

    @property
    def reads_key(self) -> bool:
        return self.dropout > 0.0  # the dropout draws

    def validate(self) -> None:
        for name in ("d_model", "n_heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"CausalSelfAttention.{name} must be a positive int, got {v!r}.")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"CausalSelfAttention: n_heads={self.n_heads} does not divide d_model={self.d_model}."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"CausalSelfAttention.dropout must be in [0, 1), got {self.dropout}.")

    def declare(self):
        def proj(ia: str, oa: str, init: inits.Initializer) -> Linear:
            d = self.d_model
            return Linear(d, d, bias=self.bias, in_axis=ia, out_axis=oa, weight_init=init, dtype=self.dtype)

        return {
            "wq": proj("embed", "heads", self.qkv_init),
            "wk": proj("embed", "kv_heads", self.qkv_init),
            "wv": proj("embed", "kv_heads", self.qkv_init),
            "wo": proj("heads", "embed", self.out_init),
        }

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (B, T, d_model); key: drives probability dropout. Returns: (B, T, d_model)."""
        B, T, C = x.shape
        H, D = self.n_heads, C // self.n_heads
        # checkpoint_name tags what a "save:<tags>" remat policy may keep (ember.core.remat_policies).
        q = checkpoint_name(self.call("wq", params, x, **kwargs), "qkv").view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = checkpoint_name(self.call("wk", params, x, **kwargs), "qkv").view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        v = checkpoint_name(self.call("wv", params, x, **kwargs), "qkv").view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        y = dot_product_attention(
            q, k, v, segment_ids=kwargs.get("segment_ids"), padding_mask=kwargs.get("attention_mask"),
            dropout=self.dropout, key=key, token_index=kwargs.get("token_index"),
        )  # (B, H, T, D)
        y = checkpoint_name(y, "attn_out").transpose(1, 2).reshape(B, T, C)  # (B, T, C): the heads side by side again
        return self.call("wo", params, y, **kwargs)  # (B, T, C)


ACTIVATIONS: Dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,  # exact erf form (Hendrycks & Gimpel 2016); nanoGPT's nn.GELU()
    # tanh approximation, used by the original GPT-2 code and HF's "gelu_new"
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
"""Nonlinearities `MLP` accepts, by name."""


@dataclasses.dataclass(frozen=True)
class MLP(Module):
    """`proj(act(fc(x)))`: parameters `fc` (hidden, d_model) and `proj` (d_model, hidden).

    Attributes:
        d_model: input and output width.
        hidden: inner width (GPT-2: 4 * d_model).
        bias: biases on both matrices.
        activation: a key of `ACTIVATIONS` ("gelu", "gelu_tanh", "relu", "silu").
        fc_init: initializer of `fc.weight`.
        proj_init: initializer of `proj.weight` (GPT-2 scales it by 1/sqrt(2 * n_layers)).
        dtype: parameter dtype.
    """

    d_model: int
    hidden: int
    bias: bool = True
    activation: Literal["gelu", "gelu_tanh", "relu", "silu"] = "gelu"
    fc_init: inits.Initializer = inits.normal(0.02)
    proj_init: inits.Initializer = inits.normal(0.02)
    dtype: torch.dtype = torch.float32

    reads_key = False

    def validate(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"MLP.activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}."
            )

    def declare(self):
        return {
            "fc": Linear(self.d_model, self.hidden, bias=self.bias, in_axis="embed", out_axis="mlp",
                         weight_init=self.fc_init, dtype=self.dtype),
            "proj": Linear(self.hidden, self.d_model, bias=self.bias, in_axis="mlp", out_axis="embed",
                           weight_init=self.proj_init, dtype=self.dtype),
        }

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (..., d_model). Returns: (..., d_model)."""
        h = checkpoint_name(ACTIVATIONS[self.activation](self.call("fc", params, x, **kwargs)), "mlp_hidden")  # (..., hidden)
        return self.call("proj", params, h, **kwargs)


@dataclasses.dataclass(frozen=True)
class Block(Module):
    """Pre-norm residual block with residual dropout (GPT-2 §2.3 moved LayerNorm to each branch's input):

        x = x + drop_1(attn(ln_1(x)))
        x = x + drop_2(mlp(ln_2(x)))

    The residual stream is constrained to `RESIDUAL_AXES` after each branch (whole under tensor
    parallelism). The sub-layers are any `Module`s of that shape.

    Attributes:
        attn: the token mixer, `(B, T, d) -> (B, T, d)` (GPT-2: `CausalSelfAttention`).
        mlp: the feed-forward layer, `(B, T, d) -> (B, T, d)` (GPT-2: `MLP`).
        ln_1: norm before `attn` (GPT-2: `LayerNorm`).
        ln_2: norm before `mlp`.
        dropout: residual dropout rate (GPT-2's resid_pdrop), applied to each branch's output.
    """

    attn: Module
    mlp: Module
    ln_1: Module
    ln_2: Module
    dropout: float = 0.0

    reads_key = False

    def declare(self):
        return {
            "ln_1": self.ln_1,
            "attn": self.attn,
            "ln_2": self.ln_2,
            "mlp": self.mlp,
            "drop_1": Dropout(self.dropout),
            "drop_2": Dropout(self.dropout),
        }

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (B, T, d). Returns: (B, T, d)."""
        h = self.call("ln_1", params, x, key=key, **kwargs)
        h = self.call("attn", params, h, key=key, **kwargs)
        x = constrain(x + self.call("drop_1", params, h, key=key, **kwargs), RESIDUAL_AXES)  # (B, T, d)
        h = self.call("ln_2", params, x, key=key, **kwargs)
        h = self.call("mlp", params, h, key=key, **kwargs)
        return constrain(x + self.call("drop_2", params, h, key=key, **kwargs), RESIDUAL_AXES)  # (B, T, d)


@dataclasses.dataclass(frozen=True)
class GPT2(Module):
    """The GPT-2 language model: `apply(params, tokens) -> logits`.

    Attributes:
        config: the hyperparameters.
    """

    config: GPT2Config = GPT2Config()

    reads_key = False

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
            attn=CausalSelfAttention(
                c.d_model, c.n_heads, bias=c.bias, dropout=c.dropout, qkv_init=std, out_init=resid
            ),
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
                `segment_ids` / `attention_mask` (B, T) restrict attention (see `CausalSelfAttention`).

        Returns:
            (B, T, vocab_size) float32 logits.
        """
        name, head = self.head()
        return head(params[name], self.features(params, tokens, key=key, **kwargs), **kwargs).float()  # (B, T, V)

    def features(self, params: Params, tokens: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """The final hidden states `(B, T, d)` (after `ln_f`), before the output projection; as `apply`."""
        check_tokens(tokens, max_seq_len=self.config.max_seq_len, field="GPT2Config.max_seq_len")
        if kwargs.get("positions") is None:
            kwargs["positions"] = torch.arange(tokens.shape[1], device=tokens.device)  # (T,)
        x = constrain(self.call("wte", params, tokens, **kwargs), RESIDUAL_AXES)  # (B, T, d)
        x = x + self.call("wpe", params, kwargs["positions"], **kwargs)  # (B, T, d) + (T or B, T, d)
        x = self.call("drop", params, x, key=key, **kwargs)
        x = self.call("blocks", params, x, key=key, **kwargs)  # (B, T, d)
        return self.call("ln_f", params, x, **kwargs)

    def head(self) -> Tuple[str, Callable[..., Tensor]]:
        """The output projection as `(name, fn)`: `fn(params[name], h, **kwargs) -> logits`; tied to `wte`."""
        return "wte", lambda p, h, **kwargs: self.children["wte"].attend(p, h)
