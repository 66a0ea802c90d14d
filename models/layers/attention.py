"""`Attention`: causal multi-head / grouped-query self-attention over `scaled_dot_product_attention`.

Public names: `Attention`, `attention_mask`, `repeat_kv`.

Shapes: input and output `(B, T, d_model)`. Inside, queries are `(B, T, H, D)` while RoPE is
applied, then `(B, H, T, D)` for attention; keys and values have `KV = n_kv_heads` heads and are
repeated to `H` heads (`repeat_kv`, the Hugging Face `repeat_kv` order: query head `h` uses
key/value head `h // (H // KV)`), which traces on every backend (eager, Inductor, torch_xla, DTensor).

Keyword inputs read from `**kwargs` (and forwarded to sub-layers):
    positions: (T,) or (B, T) ints for RoPE (default `arange(T)`).
    segment_ids: (B, T) ints; tokens attend only within their own segment (packed documents).
    attention_mask: (B, T) bool/int, 1 for real tokens and 0 for padding keys.
With neither mask given, the causal path uses `is_causal=True` (flash / memory-efficient kernels).

Attention-probability dropout needs the probabilities, so when `dropout > 0` and a key is given the
layer computes attention explicitly (the fused kernel's dropout draws from the global RNG, which
ember never uses); without a key (evaluation) it always takes the fused path.

Under DTensor sharding (an active `use_sharding` with the dtensor backend) the fused kernel runs
on each shard (heads split under tensor parallelism, the batch under data parallelism; ember adds
the CPU kernel's sharding rule in `ember.core.partition_specs.dtensor`). DTensor cannot place a
mask given to the fused kernel, so a masked call (segment ids, padding) computes explicitly there
too; the explicit matmuls flatten (B, H) into one dimension, which DTensor allows only while the
heads are whole, so masks and attention dropout under a layout that splits heads raise.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models.layers import Attention
    >>> attn = Attention(d_model=16, n_heads=4, n_kv_heads=2)
    >>> attn.apply(attn.init(random.key(0)), torch.randn(2, 5, 16)).shape
    torch.Size([2, 5, 16])
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core import random
from ...core.partition_specs import current_sharding
from ...core.types import Key, Params
from . import initializers as inits
from .linear import Linear
from .module import Module
from .rotary import RotaryEmbedding

__all__ = ["Attention", "attention_mask", "repeat_kv"]


_MSG_SPLIT_HEADS = (
    "Attention: {what} under DTensor sharding needs the heads dimension whole, but the active layout "
    "splits 'heads' over mesh axes {axes}. The explicit attention this takes reshapes (B, H, T, T) to "
    "(B*H, T, T), which DTensor cannot do with H split. Train without {what} under tensor parallelism, or "
    "use a layout that keeps heads whole (e.g. --mesh fsdp=N or dp=N)."
)


def _dtensor_heads_split() -> Optional[tuple]:
    """Under an active DTensor sharding: the mesh axes the heads are split over (() if whole); else None.

    The active sharding is the signal, not `isinstance(q, DTensor)`: under `torch.func.grad` the
    queries are functorch wrappers around DTensors, which `isinstance` does not see through.
    """
    sharding = current_sharding()
    if sharding is None or sharding.mesh.backend != "dtensor":
        return None
    spec = sharding.compute_spec(("batch", "heads", "sequence", "head_dim"))
    return spec.mesh_axes_of(1)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Repeat each of KV heads `n_rep` times: (B, KV, T, D) -> (B, KV * n_rep, T, D)."""
    if n_rep == 1:
        return x
    b, kv, t, d = x.shape
    x = x[:, :, None, :, :].expand(b, kv, n_rep, t, d)  # (B, KV, n_rep, T, D)
    return x.reshape(b, kv * n_rep, t, d)  # (B, H, T, D)


def attention_mask(
    t: int,
    *,
    causal: bool = True,
    segment_ids: Optional[Tensor] = None,
    padding_mask: Optional[Tensor] = None,
    device: Optional[torch.device] = None,
) -> Optional[Tensor]:
    """Boolean mask (True = may attend) of shape (B, 1, T, T), or None when plain causal suffices.

    Args:
        t: sequence length T.
        causal: forbid attending to later positions.
        segment_ids: (B, T) ints; attend only within the same segment.
        padding_mask: (B, T) bool/int; 0 marks padding keys. Every query may still attend to
            itself, so no row is fully masked (which would make softmax NaN).
        device: where to build it.

    Returns:
        None if neither `segment_ids` nor `padding_mask` is given, else a (B or 1, 1, T, T) bool tensor.
    """
    if segment_ids is None and padding_mask is None:
        return None
    idx = torch.arange(t, device=device)
    if causal:
        mask = (idx[:, None] >= idx[None, :])[None]  # (1, T, T)
    else:
        mask = torch.ones(1, t, t, dtype=torch.bool, device=device)  # (1, T, T)
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])  # (B, T, T)
    if padding_mask is not None:
        keys = padding_mask.bool()[:, None, :]  # (B, 1, T): key is real
        diag = (idx[:, None] == idx[None, :])[None]  # (1, T, T)
        mask = mask & (keys | diag)  # (B, T, T)
    return mask[:, None]  # (B, 1, T, T): broadcast over heads


@dataclasses.dataclass(frozen=True)
class Attention(Module):
    """Self-attention with optional grouped-query heads, RoPE, biases and probability dropout.

    Parameters: `wq` (H*D, d_model), `wk`/`wv` (KV*D, d_model), `wo` (d_model, H*D), torch layout,
    each a `Linear` (with `.bias` when `bias=True`).

    Attributes:
        d_model: model width.
        n_heads: H, query heads.
        n_kv_heads: KV, key/value heads (None: = n_heads, plain multi-head). Must divide n_heads.
        head_dim: D (None: d_model // n_heads, which must then divide exactly).
        bias: biases on all four projections (GPT-2: True; Llama: False).
        causal: causal masking.
        dropout: attention-probability dropout rate (GPT-2's attn_pdrop).
        rope: rotary embedding applied to queries and keys (None: no RoPE).
        qkv_init: initializer of wq, wk, wv.
        out_init: initializer of wo (GPT-2 scales it by 1/sqrt(2 * n_layers)).
        dtype: parameter dtype.
    """

    d_model: int
    n_heads: int
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    bias: bool = False
    causal: bool = True
    dropout: float = 0.0
    rope: Optional[RotaryEmbedding] = None
    qkv_init: inits.Initializer = inits.normal(0.02)
    out_init: inits.Initializer = inits.normal(0.02)
    dtype: torch.dtype = torch.float32

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
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"Attention.dropout must be in [0, 1), got {self.dropout}.")
        if self.rope is not None and self.rope.head_dim != self.head_size:
            raise ValueError(
                f"Attention: rope.head_dim={self.rope.head_dim} differs from the head size {self.head_size}."
            )

    def declare(self):
        hd, kvd = self.n_heads * self.head_size, self.kv_heads * self.head_size

        def proj(i: int, o: int, ia: str, oa: str, init: inits.Initializer) -> Linear:
            return Linear(i, o, bias=self.bias, in_axis=ia, out_axis=oa, weight_init=init, dtype=self.dtype)

        spec = {
            "wq": proj(self.d_model, hd, "embed", "heads", self.qkv_init),
            "wk": proj(self.d_model, kvd, "embed", "kv_heads", self.qkv_init),
            "wv": proj(self.d_model, kvd, "embed", "kv_heads", self.qkv_init),
            "wo": proj(hd, self.d_model, "heads", "embed", self.out_init),
        }
        if self.rope is not None:
            spec["rope"] = self.rope
        return spec

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (B, T, d_model); key: drives probability dropout. Returns: (B, T, d_model)."""
        b, t, _ = x.shape
        h, kv, d = self.n_heads, self.kv_heads, self.head_size
        q = self.call("wq", params, x, **kwargs).view(b, t, h, d)  # (B, T, H, D)
        k = self.call("wk", params, x, **kwargs).view(b, t, kv, d)  # (B, T, KV, D)
        v = self.call("wv", params, x, **kwargs).view(b, t, kv, d)  # (B, T, KV, D)
        if self.rope is not None:
            q = self.call("rope", params, q, **kwargs)
            k = self.call("rope", params, k, **kwargs)
        q = q.transpose(1, 2)  # (B, H, T, D)
        k = repeat_kv(k.transpose(1, 2), h // kv)  # (B, KV, T, D) -> (B, H, T, D)
        v = repeat_kv(v.transpose(1, 2), h // kv)  # (B, KV, T, D) -> (B, H, T, D)
        mask = attention_mask(
            t,
            causal=self.causal,
            segment_ids=kwargs.get("segment_ids"),
            padding_mask=kwargs.get("attention_mask"),
            device=x.device,
        )
        split = _dtensor_heads_split()
        explicit = self.dropout > 0.0 and key is not None
        if split is not None and (explicit or mask is not None):
            if split:
                what = "attention dropout" if explicit else "an attention mask (segment_ids / attention_mask)"
                raise NotImplementedError(_MSG_SPLIT_HEADS.format(what=what, axes=split))
            explicit = True  # DTensor has no rule for the fused kernel with a mask
        if explicit:
            out = self._explicit(q, k, v, mask, key if self.dropout > 0.0 else None)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=self.causal and mask is None
            )  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(b, t, h * d)  # (B, T, H*D)
        return self.call("wo", params, out, **kwargs)

    def _explicit(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], key: Optional[Key]) -> Tensor:
        """softmax(q k^T / sqrt(D)), keyed dropout on the probabilities (if `key`), then @ v: (B, H, T, D)."""
        t = q.shape[2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, T, T)
        if mask is None and self.causal:
            idx = torch.arange(t, device=q.device)
            mask = idx[:, None] >= idx[None, :]  # (T, T)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # (B, H, T, T)
        if key is not None:
            probs = random.dropout(key, probs, self.dropout)
        return probs @ v  # (B, H, T, D)
