"""Multi-head latent attention (MLA; DeepSeek-AI, "DeepSeek-V2", 2024, section 2.1), as DeepSeek-V3 runs it.

Public names: `LatentAttention`.

Keys and values come from one compressed latent per token: `c = norm(x W_kv_a)` of width `kv_rank`
(512 in DeepSeek-V3) is expanded per head into a key part without positions and a value, and a
separate `rope_dim`-wide key part carries the rotary positions, shared by every head. Queries go
through their own low-rank bottleneck (`q_rank`; None: one projection). Each head's score is over
`nope_dim + rope_dim` dimensions; its value is `v_dim` wide. Decoding caches the latent and the
rotated shared key (`kv_rank + rope_dim` numbers a token and layer, against `2 * H * D` for
multi-head attention) and expands them each call, as transformers does.

Parameter tree (`H` heads, `Q = nope_dim + rope_dim`; torch layout, `(out, in)`):

    wq.weight         (H*Q, d)                   q_rank None
    wq_a.weight       (q_rank, d)                else, with q_norm.weight (q_rank,) and
    wq_b.weight       (H*Q, q_rank)              axes ("heads", None)
    wkv_a.weight      (kv_rank + rope_dim, d)    the latent, then the shared rotary key
    kv_norm.weight    (kv_rank,)
    wkv_b.weight      (H*(nope_dim + v_dim), kv_rank)   per head: its key part, then its value
    wo.weight         (d, H*v_dim)

The rotary dimensions use the rotate-half pairing (`ember.models.layers.rotary`); DeepSeek's files
interleave them, and `ember.models.deepseek_v3.hf` permutes those rows on the way in and out.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> attn = LatentAttention(d_model=32, n_heads=4, q_rank=16, kv_rank=8, nope_dim=8, rope_dim=4, v_dim=6)
    >>> attn.apply(attn.init(random.key(0)), torch.randn(2, 5, 32)).shape
    torch.Size([2, 5, 32])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import torch
from torch import Tensor

from ...core.remat_policies import checkpoint_name
from ...core.types import Key, Params
from . import initializers as inits
from .attention import dot_product_attention
from .linear import Linear
from .module import Module
from .norms import RMSNorm
from .rotary import RotaryEmbedding, YarnScaling

__all__ = ["LatentAttention"]


@dataclasses.dataclass(frozen=True)
class LatentAttention(Module):
    """Causal multi-head latent attention (HF `DeepseekV3Attention`).

    Reads `positions`, `segment_ids`, `attention_mask` and `kv_cache` from its keywords as
    `ember.models.llama3.Attention` does; with a `kv_cache` it writes the latent and the rotated
    shared key (`CachedCall.write`) and attends over every cached slot.

    Attributes:
        d_model: model width.
        n_heads: H.
        q_rank: width of the queries' bottleneck (None: queries are one projection of x).
        kv_rank: width of the key/value latent.
        nope_dim: each head's key/query dimensions without positions.
        rope_dim: the rotary dimensions (queries per head; keys shared by all heads).
        v_dim: each head's value width.
        norm_eps: epsilon of the latents' RMSNorms.
        rope_theta: RoPE base.
        rope_scaling: YaRN (DeepSeek-V3: factor 40 over 4,096 positions), whose `mscale_all_dim`
            also scales the softmax, as DeepSeek's attention does.
        weight_init: initializer of every projection.
        dtype: parameter dtype.
    """

    d_model: int
    n_heads: int
    kv_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    q_rank: Optional[int] = None
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[YarnScaling] = None
    weight_init: inits.Initializer = inits.normal(0.02)
    dtype: torch.dtype = torch.float32

    reads_key = False

    def validate(self) -> None:
        for name in ("d_model", "n_heads", "kv_rank", "nope_dim", "rope_dim", "v_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"LatentAttention.{name} must be a positive int, got {v!r}.")
        if self.q_rank is not None and not (isinstance(self.q_rank, int) and self.q_rank > 0):
            raise ValueError(f"LatentAttention.q_rank must be a positive int or None, got {self.q_rank!r}.")
        if self.rope_dim % 2:
            raise ValueError(f"LatentAttention.rope_dim must be even (rotary pairs), got {self.rope_dim}.")

    @property
    def qk_dim(self) -> int:
        """Each head's score width, `nope_dim + rope_dim`."""
        return self.nope_dim + self.rope_dim

    @property
    def softmax_scale(self) -> float:
        """`qk_dim ** -0.5`, times YaRN's `softmax_scale_factor`."""
        factor = self.rope_scaling.softmax_scale_factor if self.rope_scaling is not None else 1.0
        return self.qk_dim ** -0.5 * factor

    def cache_widths(self) -> Dict[str, tuple]:
        """What decoding caches per token: `{name: (heads, width)}` (`init_cache_buffers`)."""
        return {"latent": (1, self.kv_rank), "k_rope": (1, self.rope_dim)}

    def declare(self):
        def proj(i: int, o: int, ia: Optional[str], oa: Optional[str]) -> Linear:
            return Linear(i, o, bias=False, in_axis=ia, out_axis=oa, weight_init=self.weight_init, dtype=self.dtype)

        H, d = self.n_heads, self.d_model
        spec: Dict[str, Module] = {}
        if self.q_rank is None:
            spec["wq"] = proj(d, H * self.qk_dim, "embed", "heads")
        else:
            spec["wq_a"] = proj(d, self.q_rank, "embed", None)
            spec["q_norm"] = RMSNorm(self.q_rank, eps=self.norm_eps, axis=None, dtype=self.dtype)
            spec["wq_b"] = proj(self.q_rank, H * self.qk_dim, None, "heads")
        spec["wkv_a"] = proj(d, self.kv_rank + self.rope_dim, "embed", None)
        spec["kv_norm"] = RMSNorm(self.kv_rank, eps=self.norm_eps, axis=None, dtype=self.dtype)
        spec["wkv_b"] = proj(self.kv_rank, H * (self.nope_dim + self.v_dim), None, "heads")
        spec["wo"] = proj(H * self.v_dim, d, "heads", "embed")
        spec["rope"] = RotaryEmbedding(self.rope_dim, theta=self.rope_theta, scaling=self.rope_scaling)
        return spec

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (B, T, d_model). Returns: (B, T, d_model)."""
        B, T, _ = x.shape
        H, r = self.n_heads, self.rope_dim
        if self.q_rank is None:
            q = self.call("wq", params, x, **kwargs)
        else:
            q = self.call("wq_b", params, self.call("q_norm", params, self.call("wq_a", params, x, **kwargs)), **kwargs)
        q = checkpoint_name(q, "qkv").view(B, T, H, self.qk_dim)  # (B, T, H, Q)
        q = torch.cat((q[..., :self.nope_dim], self.call("rope", params, q[..., self.nope_dim:], **kwargs)), dim=-1)
        kv = checkpoint_name(self.call("wkv_a", params, x, **kwargs), "qkv")  # (B, T, kv_rank + r)
        latent = self.call("kv_norm", params, kv[..., :self.kv_rank])  # (B, T, kv_rank)
        k_rope = self.call("rope", params, kv[..., None, self.kv_rank:], **kwargs)  # (B, T, 1, r)
        latent, k_rope = latent[:, None], k_rope.transpose(1, 2)  # (B, 1, T, kv_rank), (B, 1, T, r)
        q = q.transpose(1, 2)  # (B, H, T, Q)
        cache = kwargs.get("kv_cache")
        visible = None
        if cache is not None:  # decoding: the latents go through the cache, and every cached slot is expanded
            full, visible = cache.write(latent=latent, k_rope=k_rope)
            latent, k_rope = full["latent"].to(q.dtype), full["k_rope"].to(q.dtype)  # (B, 1, S, ...)
        S = latent.shape[2]
        kv = self.call("wkv_b", params, latent[:, 0], **kwargs).view(B, S, H, self.nope_dim + self.v_dim)
        kv = kv.transpose(1, 2)  # (B, H, S, nope + v)
        k = torch.cat((kv[..., :self.nope_dim], k_rope.expand(B, H, S, r)), dim=-1)  # (B, H, S, Q)
        v = kv[..., self.nope_dim:]  # (B, H, S, v_dim)
        if visible is not None:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=self.softmax_scale)
        else:
            y = dot_product_attention(q, k, v, segment_ids=kwargs.get("segment_ids"),
                                      padding_mask=kwargs.get("attention_mask"), scale=self.softmax_scale,
                                      token_index=kwargs.get("token_index"))
        y = checkpoint_name(y, "attn_out").transpose(1, 2).reshape(B, T, H * self.v_dim)  # (B, T, H*v_dim)
        return self.call("wo", params, y, **kwargs)  # (B, T, d_model)
