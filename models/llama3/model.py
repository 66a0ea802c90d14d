"""Llama 3 (Meta, "The Llama 3 Herd of Models", 2024), top to bottom: attention, MLP, block, model.

Public names: `Attention`, `SwiGLU`, `Block`, `Llama3`.

RMSNorm pre-norm blocks, rotary positions (theta 500,000; optional Llama-3.1 frequency scaling),
grouped-query attention without biases, SwiGLU feed-forward, untied (8B, 70B) or tied (1B, 3B)
output projection. The config and the named sizes are in `config.py`, the Hugging Face mapping in
`hf.py`; the building blocks shared with other families (Linear, RMSNorm, RoPE, the attention
kernel) are in `ember.models.layers`.

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

With `pad_token_id` set, that row of `wte.weight` gets no gradient from the lookup (HF's `padding_idx`).
These are Hugging Face `LlamaForCausalLM`'s tensors in the same layout, with no transposes and no
q/k permutation (RoPE uses HF's rotate-half pairing). By default (`scan_layers=True`) `blocks` is one
tree with a leading `(L,)` dim (`blocks.attn.wq.weight: (L, H*D, d)`), or, where kinds of blocks follow
one another (dense, then mixture of experts), a list with one such tree per run (`Stacks`); with
`scan_layers=False` it is the list shown above.

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
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.partition_specs import constrain
from ...core.remat_policies import checkpoint_name
from ...core.types import Key, Params
from .._checks import check_tokens
from ..layers import Embedding, Linear, Module, RMSNorm, RotaryEmbedding, Sequential, Stacks
from ..layers import dot_product_attention
from ..layers import initializers as inits
from ..layers.axes import RESIDUAL_AXES
from .config import Llama3Config

__all__ = ["Attention", "Block", "Llama3", "SwiGLU"]


@dataclasses.dataclass(frozen=True)
class Attention(Module):
    """Causal self-attention with grouped-query heads and rotary positions (HF `LlamaAttention`).

    Parameters: `wq` (H*D, d_model), `wk`/`wv` (KV*D, d_model), `wo` (d_model, H*D), torch layout,
    each a `Linear` (with `.bias` when `bias=True`; only q, k, v have one when `out_bias=False`).

    Keyword inputs read from `**kwargs` (and forwarded to sub-layers): `positions` (T,) or (B, T)
    for RoPE (default `arange(T)`); `segment_ids` (B, T), tokens attend only within their segment;
    `attention_mask` (B, T), 0 for padding keys; `token_index` (B, T), the order causal masking
    follows in a reordered sequence (`ember.data.ContextOrder`). See `dot_product_attention` for how it is computed.
    `kv_cache` (a `CachedCall`): decoding; this layer's keys and values go into the cache, and the
    queries attend over every cached position (`ember.models.generation`).

    Attributes:
        d_model: model width.
        n_heads: H, query heads.
        n_kv_heads: KV, key/value heads (None: = n_heads, plain multi-head). Must divide n_heads.
        head_dim: D (None: d_model // n_heads, which must then divide exactly).
        bias: biases on the q, k, v projections (HF `attention_bias`; Llama 3: False; Qwen2: True).
        out_bias: a bias on the output projection too (None: as `bias`; Qwen2: False).
        causal: causal masking.
        window: each query sees at most this many keys, itself included (Mistral's sliding window;
            None: all earlier keys).
        qk_norm: RMSNorm each query and key head (parameters `q_norm`, `k_norm`, `(D,)`) before RoPE (Qwen3).
        norm_eps: that RMSNorm's epsilon.
        dropout: attention-probability dropout rate (HF `attention_dropout`; Llama 3: 0).
        rope: rotary embedding applied to queries and keys (None: no positions).
        qkv_init: initializer of wq, wk, wv.
        out_init: initializer of wo.
        dtype: parameter dtype.

    Example:
        >>> import torch
        >>> from ember.core import random
        >>> attn = Attention(d_model=16, n_heads=4, n_kv_heads=2, rope=RotaryEmbedding(4))
        >>> attn.apply(attn.init(random.key(0)), torch.randn(2, 5, 16)).shape
        torch.Size([2, 5, 16])
    """

    d_model: int
    n_heads: int
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    bias: bool = False
    out_bias: Optional[bool] = None
    causal: bool = True
    window: Optional[int] = None
    qk_norm: bool = False
    norm_eps: float = 1e-6
    dropout: float = 0.0
    rope: Optional[RotaryEmbedding] = None
    qkv_init: inits.Initializer = inits.normal(0.02)
    out_init: inits.Initializer = inits.normal(0.02)
    dtype: torch.dtype = torch.float32

    @property
    def reads_key(self) -> bool:
        return self.dropout > 0.0  # the dropout draws

    @property
    def kv_heads(self) -> int:
        """KV, the number of key/value heads."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_size(self) -> int:
        """D, the per-head width."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    def validate(self) -> None:
        for name in ("d_model", "n_heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"Attention.{name} must be a positive int, got {v!r}.")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"Attention: n_heads={self.n_heads} does not divide d_model={self.d_model} "
                f"({self.d_model} / {self.n_heads} = {self.d_model / self.n_heads:.3g}). Pick n_heads "
                f"among the divisors of d_model or set head_dim explicitly."
            )
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads:
            raise ValueError(
                f"Attention: n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                f"(each key/value head serves n_heads / n_kv_heads query heads)."
            )
        if self.window is not None and not (isinstance(self.window, int) and self.window > 0):
            raise ValueError(f"Attention.window must be a positive int or None, got {self.window!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"Attention.dropout must be in [0, 1), got {self.dropout}.")
        if self.rope is not None and self.rope.head_dim != self.head_size:
            raise ValueError(
                f"Attention: rope.head_dim={self.rope.head_dim} differs from the head size {self.head_size}."
            )

    def declare(self):
        hd, kvd = self.n_heads * self.head_size, self.kv_heads * self.head_size

        out_bias = self.bias if self.out_bias is None else self.out_bias

        def proj(i: int, o: int, ia: str, oa: str, init: inits.Initializer, bias: bool) -> Linear:
            return Linear(i, o, bias=bias, in_axis=ia, out_axis=oa, weight_init=init, dtype=self.dtype)

        spec = {
            "wq": proj(self.d_model, hd, "embed", "heads", self.qkv_init, self.bias),
            "wk": proj(self.d_model, kvd, "embed", "kv_heads", self.qkv_init, self.bias),
            "wv": proj(self.d_model, kvd, "embed", "kv_heads", self.qkv_init, self.bias),
            "wo": proj(hd, self.d_model, "heads", "embed", self.out_init, out_bias),
        }
        if self.rope is not None:
            spec["rope"] = self.rope
        if self.qk_norm:
            spec["q_norm"] = RMSNorm(self.head_size, eps=self.norm_eps, axis=None, dtype=self.dtype)
            spec["k_norm"] = RMSNorm(self.head_size, eps=self.norm_eps, axis=None, dtype=self.dtype)
        return spec

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (B, T, d_model); key: drives probability dropout. Returns: (B, T, d_model)."""
        B, T, _ = x.shape
        H, KV, D = self.n_heads, self.kv_heads, self.head_size
        # checkpoint_name tags what a "save:<tags>" remat policy may keep (ember.core.remat_policies).
        q = checkpoint_name(self.call("wq", params, x, **kwargs), "qkv").view(B, T, H, D)  # (B, T, H, D)
        k = checkpoint_name(self.call("wk", params, x, **kwargs), "qkv").view(B, T, KV, D)  # (B, T, KV, D)
        v = checkpoint_name(self.call("wv", params, x, **kwargs), "qkv").view(B, T, KV, D)  # (B, T, KV, D)
        if self.qk_norm:  # each head normalised over its D dims
            q, k = self.call("q_norm", params, q, **kwargs), self.call("k_norm", params, k, **kwargs)
        if self.rope is not None:  # rotate q and k by their positions
            q = self.call("rope", params, q, **kwargs)
            k = self.call("rope", params, k, **kwargs)
        q = q.transpose(1, 2)  # (B, H, T, D)
        if kwargs.get("kv_cache") is not None:  # decoding: keys and values go through the cache (layers/kv_cache.py)
            y = kwargs["kv_cache"].attend(q, k.transpose(1, 2), v.transpose(1, 2), window=self.window)  # (B, H, T, D)
            return self.call("wo", params, y.transpose(1, 2).reshape(B, T, H * D), **kwargs)  # (B, T, d_model)
        y = dot_product_attention(  # grouped-query: head h reads kv head h // (H/KV)
            q, k.transpose(1, 2), v.transpose(1, 2), causal=self.causal, segment_ids=kwargs.get("segment_ids"),
            padding_mask=kwargs.get("attention_mask"), window=self.window, dropout=self.dropout, key=key,
            token_index=kwargs.get("token_index"),
        )  # (B, H, T, D)
        y = checkpoint_name(y, "attn_out").transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        return self.call("wo", params, y, **kwargs)  # (B, T, d_model)


@dataclasses.dataclass(frozen=True)
class SwiGLU(Module):
    """`down(silu(gate(x)) * up(x))` (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6).

    Parameters `gate`, `up` (hidden, d_model) and `down` (d_model, hidden), no biases; these are
    HF Llama's `gate_proj`, `up_proj`, `down_proj` (Meta's w1, w3, w2).

    Attributes:
        d_model: input and output width.
        hidden: inner width (Llama-3 8B: 14336).
        gate_init: initializer of `gate` and `up`.
        down_init: initializer of `down`.
        dtype: parameter dtype.
    """

    d_model: int
    hidden: int
    gate_init: inits.Initializer = inits.normal(0.02)
    down_init: inits.Initializer = inits.normal(0.02)
    dtype: torch.dtype = torch.float32

    reads_key = False

    def declare(self):
        def lin(i: int, o: int, ia: str, oa: str, init: inits.Initializer) -> Linear:
            return Linear(i, o, bias=False, in_axis=ia, out_axis=oa, weight_init=init, dtype=self.dtype)

        return {
            "gate": lin(self.d_model, self.hidden, "embed", "mlp", self.gate_init),
            "up": lin(self.d_model, self.hidden, "embed", "mlp", self.gate_init),
            "down": lin(self.hidden, self.d_model, "mlp", "embed", self.down_init),
        }

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (..., d_model). Returns: (..., d_model)."""
        h = F.silu(self.call("gate", params, x, **kwargs)) * self.call("up", params, x, **kwargs)  # (..., hidden)
        h = checkpoint_name(h, "mlp_hidden")
        return self.call("down", params, h, **kwargs)


@dataclasses.dataclass(frozen=True)
class Block(Module):
    """Pre-norm residual block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.

    The residual stream is constrained to `RESIDUAL_AXES` after each branch (whole under tensor
    parallelism).

    Attributes:
        attn: the token mixer, `(B, T, d) -> (B, T, d)` (Llama: `Attention`).
        mlp: the feed-forward layer, `(B, T, d) -> (B, T, d)` (Llama: `SwiGLU`).
        ln_1: norm before `attn` (Llama: `RMSNorm`).
        ln_2: norm before `mlp`.
    """

    attn: Module
    mlp: Module
    ln_1: Module
    ln_2: Module

    reads_key = False

    def declare(self):
        return {"ln_1": self.ln_1, "attn": self.attn, "ln_2": self.ln_2, "mlp": self.mlp}

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (B, T, d). Returns: (B, T, d)."""
        h = self.call("ln_1", params, x, key=key, **kwargs)
        x = constrain(x + self.call("attn", params, h, key=key, **kwargs), RESIDUAL_AXES)  # (B, T, d)
        h = self.call("ln_2", params, x, key=key, **kwargs)
        return constrain(x + self.call("mlp", params, h, key=key, **kwargs), RESIDUAL_AXES)  # (B, T, d)


@dataclasses.dataclass(frozen=True)
class Llama3(Module):
    """The Llama-3 language model: `apply(params, tokens) -> logits`.

    Attributes:
        config: the hyperparameters.
    """

    config: Llama3Config = Llama3Config()

    reads_key = False

    def validate(self) -> None:
        if not isinstance(self.config, Llama3Config):
            raise TypeError(f"Llama3 needs a Llama3Config, got {type(self.config).__name__}.")

    def declare(self):
        c = self.config
        std = inits.normal(c.init_std)  # HF LlamaPreTrainedModel._init_weights: N(0, initializer_range)
        layers = [self.block(i, std) for i in range(c.n_layers)]
        alike = all(layer == layers[0] for layer in layers)
        if c.scan_layers:  # one stack per run of equal blocks (dense first, then mixture-of-experts)
            blocks = Stacks.of(layers, remat=c.remat)
        else:
            blocks = Sequential.repeat(layers[0], c.n_layers, remat=c.remat) if alike else Sequential(
                tuple(layers), remat=c.remat)
        spec = {
            "wte": Embedding(c.vocab_size, c.d_model, weight_init=std, padding_idx=c.pad_token_id),
            "blocks": blocks,
            "ln_f": self.norm(),
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
        return self.apply_and_extras(params, tokens, key=key, **kwargs)[0]  # (B, T, V)

    def apply_and_extras(self, params: Params, tokens: Tensor, *, key: Optional[Key] = None,
                         **kwargs: Any) -> Tuple[Tensor, Any]:
        """`(logits, extras)`: `apply`'s logits and what the blocks carried besides (`features_and_extras`)."""
        hidden, extras = self.features_and_extras(params, tokens, key=key, **kwargs)
        name, head = self.head()
        return head(params[name], hidden, **kwargs).float(), extras  # (B, T, V)

    def features(self, params: Params, tokens: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """The final hidden states `(B, T, d)` (after `ln_f`), before the output projection; as `apply`."""
        return self.features_and_extras(params, tokens, key=key, **kwargs)[0]

    def features_and_extras(self, params: Params, tokens: Tensor, *, key: Optional[Key] = None,
                            **kwargs: Any) -> Tuple[Tensor, Any]:
        """`(features, extras)`: what `features` returns, and what the blocks carry besides the residual
        stream (None here; a mixture of experts' router stats)."""
        check_tokens(tokens, max_seq_len=self.config.max_seq_len, field="Llama3Config.max_seq_len")
        if kwargs.get("positions") is None:
            kwargs["positions"] = torch.arange(tokens.shape[1], device=tokens.device)  # (T,)
        x = constrain(self.embed(params, tokens, **kwargs), RESIDUAL_AXES)  # (B, T, d)
        x, extras = self.uncarry(self.call("blocks", params, self.carry(x), key=key, **kwargs))  # (B, T, d)
        return self.call("ln_f", params, x, **kwargs), extras

    def carry(self, x: Tensor) -> Any:
        """What the first block receives, given the embeddings `(B, T, d)`: the embeddings themselves."""
        return x

    def uncarry(self, carry: Any) -> Tuple[Tensor, Any]:
        """`(residual stream, extras)` from what the last block returns."""
        return carry, None

    # What a Llama-layout family may change (Gemma does): the norm, the feed-forward layer, the embedding;
    # a mixture of experts changes the block and what the blocks carry (`ember.models.qwen3_moe`).

    def block(self, layer: int, init: inits.Initializer) -> Module:
        """Block number `layer`: attention and feed-forward, each pre-normed, each residual."""
        return Block(attn=self.attention(init), mlp=self.feed_forward(init), ln_1=self.norm(), ln_2=self.norm())

    def attention(self, init: inits.Initializer) -> Module:
        """The self-attention of each block."""
        c = self.config
        rope = RotaryEmbedding(c.head_dim, theta=c.rope_theta, scaling=c.rope_scaling)
        return Attention(c.d_model, c.n_heads, c.n_kv_heads, head_dim=c.head_dim, bias=c.qkv_bias, out_bias=False,
                         window=c.sliding_window, qk_norm=c.qk_norm, norm_eps=c.norm_eps, rope=rope,
                         qkv_init=init, out_init=init)

    def cache_widths(self) -> Dict[str, Tuple[int, int]]:
        """What decoding caches per token and layer, `{name: (heads, width)}`: each key/value head's key and value."""
        c = self.config
        return {"k": (c.n_kv_heads, c.head_dim), "v": (c.n_kv_heads, c.head_dim)}

    def norm(self) -> Module:
        """The RMSNorm before each branch and at the end."""
        return RMSNorm(self.config.d_model, eps=self.config.norm_eps)

    def feed_forward(self, init: inits.Initializer) -> Module:
        """The feed-forward layer of each block."""
        return SwiGLU(self.config.d_model, self.config.ffn_dim, gate_init=init, down_init=init)

    def embed(self, params: Params, tokens: Tensor, **kwargs: Any) -> Tensor:
        """The token embeddings `(B, T, d)` the blocks start from."""
        return self.call("wte", params, tokens, **kwargs)

    def head(self) -> Tuple[str, Callable[..., Tensor]]:
        """The output projection as `(name, fn)`: `fn(params[name], h, **kwargs) -> logits`, `(..., d) -> (..., V)`."""
        if self.config.tie_embeddings:
            return "wte", lambda p, h, **kwargs: self.children["wte"].attend(p, h)
        return "lm_head", lambda p, h, **kwargs: self.call("lm_head", {"lm_head": p}, h, **kwargs)
