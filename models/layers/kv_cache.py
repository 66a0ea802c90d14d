"""The key/value cache of autoregressive decoding: a pytree of fixed-size buffers, and the per-call
object through which each attention layer reads and writes its slice.

Public names: `init_kv_cache`, `init_cache_buffers`, `CachedCall`.

The cache is `{"k": (L, B, KV, S, D), "v": (L, B, KV, S, D)}` for `L` layers and `S` slots: plain
tensors, so it can be donated to a compiled decode step and sharded on its `kv_heads` axis. One
call of the model (a prefill of `T` tokens, or a decode step of one) gets a `CachedCall` in its
`kv_cache` keyword; each attention layer in turn writes its new keys and values (or, under
multi-head latent attention, its compressed latents: `write`) at slots
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

from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import repeat_kv

__all__ = ["CachedCall", "init_cache_buffers", "init_kv_cache"]


def init_kv_cache(*, n_layers: int, batch: int, n_kv_heads: int, slots: int, head_dim: int,
                  dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> Dict[str, Tensor]:
    """An empty (zero) cache: `{"k", "v"}`, each `(n_layers, batch, n_kv_heads, slots, head_dim)`."""
    return init_cache_buffers({"k": (n_kv_heads, head_dim), "v": (n_kv_heads, head_dim)}, n_layers=n_layers,
                              batch=batch, slots=slots, dtype=dtype, device=device)


def init_cache_buffers(widths: Mapping[str, Tuple[int, int]], *, n_layers: int, batch: int, slots: int,
                       dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> Dict[str, Tensor]:
    """An empty cache of any layout: for each `name: (heads, width)`, a zero `(n_layers, batch, heads, slots, width)`
    buffer (multi-head latent attention caches `{"latent": (1, kv_rank), "k_rope": (1, rope_dim)}`)."""
    return {name: torch.zeros((n_layers, batch, heads, slots, width), dtype=dtype, device=device)
            for name, (heads, width) in widths.items()}


class CachedCall:
    """One model call's view of the cache (see the module docstring); `cache()` is the updated cache.

    Args:
        cache: the cache before the call.
        position: 0-d integer tensor, the slot of the call's first token.
    """

    def __init__(self, cache: Dict[str, Tensor], position: Tensor) -> None:
        self.before = cache
        self.position = position
        self._written: Dict[str, List[Tensor]] = {name: [] for name in cache}

    @property
    def layers_seen(self) -> int:
        return len(next(iter(self._written.values())))

    @property
    def n_layers(self) -> int:
        return next(iter(self.before.values())).shape[0]

    def write(self, *, window: Optional[int] = None, **new: Tensor) -> Tuple[Dict[str, Tensor], Tensor]:
        """Write one layer's `name=(B, heads, T, width)` tensors at the call's slots.

        Returns `(every slot of each, visible)`: the buffers `(B, heads, S, width)` in the cache's dtype,
        and the `(T, S)` mask of the slots each query may see (written, not after it, within `window`).
        """
        layer = self.layers_seen
        if layer >= self.n_layers:
            raise ValueError(f"the cache holds {self.n_layers} layers, but the model called attention a "
                             f"{layer + 1}th time; build it with init_kv_cache(n_layers=<the model's layers>).")
        if sorted(new) != sorted(self.before):
            raise ValueError(f"the cache holds {sorted(self.before)}, but a layer wrote {sorted(new)}; build the cache "
                             f"with ember.models.generation.init_cache(model, ...), which asks the model its layout.")
        t = next(iter(new.values())).shape[2]
        device = next(iter(new.values())).device
        query_slots = self.position + torch.arange(t, device=device)  # (T,)
        full = {}
        for name, x in new.items():
            buffer = self.before[name]
            full[name] = buffer[layer].index_copy(2, query_slots, x.to(buffer.dtype))  # (B, heads, S, width)
            self._written[name].append(full[name])
        key_slots = torch.arange(self.before[next(iter(new))].shape[3], device=device)
        visible = key_slots[None, :] <= query_slots[:, None]  # (T, S): written, and not after the query
        if window is not None:
            visible = visible & (query_slots[:, None] - key_slots[None, :] < window)
        return full, visible

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, window: Optional[int] = None) -> Tensor:
        """Write this layer's `k`, `v` `(B, KV, T, D)` into the cache; attend `q` `(B, H, T, D)` over it."""
        full, visible = self.write(k=k, v=v, window=window)
        n_rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(full["k"].to(q.dtype), n_rep),
                                              repeat_kv(full["v"].to(q.dtype), n_rep), attn_mask=visible)  # (B, H, T, D)

    def cache(self) -> Dict[str, Tensor]:
        """The cache after the call (every layer's slice rewritten)."""
        if self.layers_seen != self.n_layers:
            raise ValueError(f"the model called attention {self.layers_seen} times, but the cache holds "
                             f"{self.n_layers} layers.")
        return {name: torch.stack(slices) for name, slices in self._written.items()}
