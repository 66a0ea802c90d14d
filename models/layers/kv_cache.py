"""The key/value cache of autoregressive decoding: a pytree of fixed-size buffers, and the per-call
object through which each attention layer reads and writes its slice.

Public names: `init_kv_cache`, `CachedCall`.

The cache is `{"k": (L, B, KV, S, D), "v": (L, B, KV, S, D)}` for `L` layers and `S` slots: plain
tensors, so it can be donated to a compiled decode step and sharded on its `kv_heads` axis. One
call of the model (a prefill of `T` tokens, or a decode step of one) gets a `CachedCall` in its
`kv_cache` keyword; each attention layer in turn writes its new keys and values at slots
`position .. position + T - 1` and attends over all `S` slots with a mask: a slot is visible when
it is not after the query (and within the sliding window, if any). `position` is a 0-d tensor, so
one compiled decode step serves every position.

Example:
    >>> import torch
    >>> cache = init_kv_cache(n_layers=2, batch=1, n_kv_heads=2, slots=8, head_dim=4)
    >>> call = CachedCall(cache, position=torch.tensor(0))
    >>> q, k = torch.randn(1, 4, 3, 4), torch.randn(1, 2, 3, 4)
    >>> call.attend(q, k, k).shape, call.layers_seen
    (torch.Size([1, 4, 3, 4]), 1)
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import repeat_kv

__all__ = ["CachedCall", "init_kv_cache"]


def init_kv_cache(*, n_layers: int, batch: int, n_kv_heads: int, slots: int, head_dim: int,
                  dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> Dict[str, Tensor]:
    """An empty (zero) cache: `{"k", "v"}`, each `(n_layers, batch, n_kv_heads, slots, head_dim)`."""
    shape = (n_layers, batch, n_kv_heads, slots, head_dim)
    return {"k": torch.zeros(shape, dtype=dtype, device=device), "v": torch.zeros(shape, dtype=dtype, device=device)}


class CachedCall:
    """One model call's view of the cache (see the module docstring); `cache()` is the updated cache.

    Args:
        cache: the cache before the call.
        position: 0-d integer tensor, the slot of the call's first token.
    """

    def __init__(self, cache: Dict[str, Tensor], position: Tensor) -> None:
        self.before = cache
        self.position = position
        self._k: List[Tensor] = []
        self._v: List[Tensor] = []

    @property
    def layers_seen(self) -> int:
        return len(self._k)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, window: Optional[int] = None) -> Tensor:
        """Write this layer's `k`, `v` `(B, KV, T, D)` into the cache; attend `q` `(B, H, T, D)` over it."""
        layer = len(self._k)
        if layer >= self.before["k"].shape[0]:
            raise ValueError(f"the cache holds {self.before['k'].shape[0]} layers, but the model called attention a "
                             f"{layer + 1}th time; build it with init_kv_cache(n_layers=<the model's layers>).")
        t, slots = q.shape[2], self.before["k"].shape[3]
        query_slots = self.position + torch.arange(t, device=q.device)  # (T,)
        k_all = self.before["k"][layer].index_copy(2, query_slots, k.to(self.before["k"].dtype))  # (B, KV, S, D)
        v_all = self.before["v"][layer].index_copy(2, query_slots, v.to(self.before["v"].dtype))
        self._k.append(k_all)
        self._v.append(v_all)
        key_slots = torch.arange(slots, device=q.device)
        visible = key_slots[None, :] <= query_slots[:, None]  # (T, S): written, and not after the query
        if window is not None:
            visible = visible & (query_slots[:, None] - key_slots[None, :] < window)
        n_rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(k_all.to(q.dtype), n_rep), repeat_kv(v_all.to(q.dtype), n_rep),
                                              attn_mask=visible)  # (B, H, T, D)

    def cache(self) -> Dict[str, Tensor]:
        """The cache after the call (every layer's slice rewritten)."""
        if len(self._k) != self.before["k"].shape[0]:
            raise ValueError(f"the model called attention {len(self._k)} times, but the cache holds "
                             f"{self.before['k'].shape[0]} layers.")
        return {"k": torch.stack(self._k), "v": torch.stack(self._v)}
