"""The attention kernel the model families share: masks, grouped-query repeat, and one SDPA dispatch.

Public names: `dot_product_attention`, `attention_mask`, `repeat_kv`.

Each family's attention layer (`ember.models.llama3.Attention`, `ember.models.gpt2.CausalSelfAttention`)
projects q, k, v and reshapes them to `(B, heads, T, D)` (keys and values may have fewer heads: grouped-query
attention), then calls `dot_product_attention`, which picks how to compute `softmax(q k^T / sqrt(D)) v`:
    - `torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels), with
      `is_causal=True` when no mask is given, else the boolean mask from `attention_mask`: causal and
      masked (packed documents, a sliding window), in chunks of queries that each read the keys up
      to their last query only, so the masked kernel skips the upper triangle as `is_causal` does;
    - explicitly (scores, softmax in float32, keyed dropout, @ v) when attention-probability dropout
      is on: the fused kernel's dropout draws from the global RNG, which ember never uses;
    - on each process's shard when DTensor queries are split by batch or heads: the same kernel on the
      local tensors, a mask laid out to match (DTensor places no mask given to the fused kernel);
    - explicitly when the active sharding needs it and the DTensors are not seen (inside a `torch.func`
      transform: `explicit_attention_required`; it raises when a mask or dropout meets split heads);
    - across processes when the active layout splits the sequence (context parallelism, the rule
      `("sequence", "cp")`): each process's queries against every key (`ember.core.context_attention`),
      the fused kernel on local tensors with the mask built there.
A batch reordered for context parallelism (`ember.data.ContextOrder`) carries `token_index`, each
token's index before the reordering: causal masks and windows then compare those, on every device.
`repeat_kv` follows Hugging Face's order (query head `h` uses key/value head `h // (H // KV)`) and
traces on every backend (eager, Inductor, torch_xla, DTensor); it runs inside, after keys and values
are gathered over `cp`, so only the `KV` heads cross processes.

Example:
    >>> import torch
    >>> q = k = v = torch.randn(2, 4, 5, 8)                       # (B, H, T, D)
    >>> dot_product_attention(q, k, v).shape
    torch.Size([2, 4, 5, 8])
    >>> attention_mask(5, segment_ids=torch.tensor([[0, 0, 1, 1, 1]])).shape
    torch.Size([1, 1, 5, 5])
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core import random
from ...core.partition_specs.context_parallel import context_attention, sequence_split
from ...core.partition_specs import explicit_attention_required
from ...core.remat import remat
from ...core.types import Key

__all__ = ["attention_mask", "dot_product_attention", "repeat_kv"]


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
    window: Optional[int] = None,
    device: Optional[torch.device] = None,
) -> Optional[Tensor]:
    """Boolean mask (True = may attend) of shape (B, 1, T, T), or None when plain causal suffices.

    Args:
        t: sequence length T.
        causal: forbid attending to later positions.
        segment_ids: (B, T) ints; attend only within the same segment.
        padding_mask: (B, T) bool/int; 0 marks padding keys. Every query may still attend to
            itself, so no row is fully masked (which would make softmax NaN).
        window: a query sees only keys less than `window` positions before it (a sliding window);
            ignored when `window >= t`.
        device: where to build it.

    Returns:
        None if neither `segment_ids`, `padding_mask` nor a window shorter than `t` is given, else a
        (B or 1, 1, T, T) bool tensor.
    """
    window = window if window is not None and window < t else None
    if segment_ids is None and padding_mask is None and window is None:
        return None
    idx = torch.arange(t, device=device)
    if causal:
        mask = (idx[:, None] >= idx[None, :])[None]  # (1, T, T)
    else:
        mask = torch.ones(1, t, t, dtype=torch.bool, device=device)  # (1, T, T)
    if window is not None:
        mask = mask & ((idx[:, None] - idx[None, :]).abs() < window)[None]  # (1, T, T)
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])  # (B, T, T)
    if padding_mask is not None:
        keys = padding_mask.bool()[:, None, :]  # (B, 1, T): key is real
        diag = (idx[:, None] == idx[None, :])[None]  # (1, T, T)
        mask = mask & (keys | diag)  # (B, T, T)
    return mask[:, None]  # (B, 1, T, T): broadcast over heads


def dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    segment_ids: Optional[Tensor] = None,
    padding_mask: Optional[Tensor] = None,
    window: Optional[int] = None,
    dropout: float = 0.0,
    key: Optional[Key] = None,
    scale: Optional[float] = None,
    token_index: Optional[Tensor] = None,
) -> Tensor:
    """`softmax(q k^T / sqrt(D)) v` with causal / segment / padding masking and keyed probability dropout.

    Args:
        q: (B, H, T, D). k, v: (B, KV, T, D) (v's D may differ), `KV` dividing `H`: grouped-query attention,
            query head `h` reading key/value head `h // (H / KV)` (repeated here, after any gather over `cp`).
        causal: forbid attending to later positions.
        segment_ids: (B, T) ints; tokens attend only within their own segment (packed documents).
        padding_mask: (B, T) bool/int, 1 for real tokens and 0 for padding keys.
        window: sliding-window length (see `attention_mask`); None: no window.
        dropout: attention-probability dropout rate; applied only when `key` is given.
        key: drives the dropout (None: evaluation, no dropout).
        scale: the scores' multiplier (None: `1 / sqrt(D)`).
        token_index: (B, T) each token's index in its sequence before the data was reordered
            (`ember.data.ContextOrder`); the causal mask and the window compare these (None: `arange(T)`).

    Returns:
        (B, H, T, v's D).
    """
    T, n_rep = q.shape[2], _query_heads_per_kv_head(q, k, v)
    if token_index is not None or sequence_split():
        if dropout > 0.0 and key is not None:
            raise NotImplementedError("attention dropout with a reordered or split sequence (context parallelism) is "
                                      "not supported: set the model's attention dropout to 0 or drop cp from the mesh.")
        return _attention_by_index(q, k, v, causal=causal, token_index=token_index, segment_ids=segment_ids,
                                   padding_mask=padding_mask, window=window if window is not None and window < T
                                   else None, scale=scale, n_rep=n_rep)
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, T, D)
    mask = attention_mask(T, causal=causal, segment_ids=segment_ids, padding_mask=padding_mask, window=window,
                          device=q.device)
    explicit = dropout > 0.0 and key is not None
    if not explicit:
        on_shards = _fused_on_shards(q, k, v, mask, causal=causal, scale=scale)
        if on_shards is not None:
            return on_shards
    if explicit_attention_required(dropout=explicit, masked=mask is not None):
        explicit = True
    if explicit:
        return _explicit_attention(q, k, v, mask, causal=causal, dropout=dropout, key=key if dropout > 0.0 else None,
                                   scale=scale)
    return _fused(q, k, v, mask, causal=causal, scale=scale)


def _fused(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], *, causal: bool,
           scale: Optional[float]) -> Tensor:
    """The fused kernel, `is_causal` without a mask, in query chunks with a mask over a causal sequence."""
    if mask is not None and causal and q.shape[2] >= 2 * QUERY_CHUNK:
        return _causal_query_chunks(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          scale=scale)  # (B, H, T, D)


def _fused_on_shards(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], *, causal: bool,
                     scale: Optional[float]) -> Optional[Tensor]:
    """The fused kernel on each process's shard of DTensor queries, keys and values split by batch or heads:
    DTensor places no mask given to the kernel, and before torch 2.12 its rules refused the math kernel's
    fold of batch and heads split together (latent attention's unequal head sizes on a CPU). A mask is laid
    out as the shard reads it (by batch where it has one, else whole). None where they are not DTensors seen
    here (inside a `torch.func` transform) or are split otherwise."""
    if type(q) is Tensor:
        return None
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not all(isinstance(t, DTensor) for t in (q, k, v)) or not q.placements == k.placements == v.placements:
        return None
    if any(p not in (Replicate(), Shard(0), Shard(1)) for p in q.placements):
        return None
    if isinstance(mask, DTensor):
        by_batch = [Shard(0) if p == Shard(0) and mask.shape[0] > 1 else Replicate() for p in q.placements]
        mask = mask.redistribute(q.device_mesh, by_batch).to_local()
    elif mask is not None and mask.shape[0] > 1 and Shard(0) in q.placements:
        return None
    out = _fused(q.to_local(), k.to_local(), v.to_local(), mask, causal=causal, scale=scale)  # (B', H', T, Dv)
    return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)


def _query_heads_per_kv_head(q: Tensor, k: Tensor, v: Tensor) -> int:
    h, kv = q.shape[1], k.shape[1]
    if kv == 0 or h % kv or v.shape[1] != kv:
        raise ValueError(f"dot_product_attention: {h} query heads against {kv} key and {v.shape[1]} value heads; keys "
                         f"and values need the same number of heads, one that divides the queries' (grouped-query "
                         f"attention): check the model's n_heads and n_kv_heads.")
    return h // kv


QUERY_CHUNK = 256
"""Queries per kernel call when a mask meets causal attention (`_causal_query_chunks`)."""


def _causal_query_chunks(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: Optional[float]) -> Tensor:
    """Masked causal SDPA, `QUERY_CHUNK` queries at a time against the keys up to the chunk's last query.

    One masked call computes every (query, key) pair, later keys included, where `is_causal` skips
    them; the chunks skip most of them (the same result: those keys are masked).
    """
    t = q.shape[2]
    out = []
    for start in range(0, t, QUERY_CHUNK):
        end = min(start + QUERY_CHUNK, t)
        out.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                                                  attn_mask=mask[..., start:end, :end], scale=scale))  # (B, H, chunk, D)
    return torch.cat(out, dim=2)  # (B, H, T, D)


def _attention_by_index(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, token_index: Optional[Tensor],
                        segment_ids: Optional[Tensor], padding_mask: Optional[Tensor], window: Optional[int],
                        scale: Optional[float], n_rep: int) -> Tensor:
    """Each process's queries against every key (`context_attention`), the mask from each token's own index;
    grouped-query keys and values are repeated after they are gathered (`n_rep` times fewer bytes cross).
    The attention is rematerialised: its `(Tq, T)` mask, which a fused kernel keeps for the backward (on the
    CPU as float), is built again there instead of kept per layer (BENCHMARKS.md, "Context parallelism: the
    attention rematerialised")."""
    tokens = {"index": torch.arange(q.shape[2], device=q.device) if token_index is None else token_index}
    if segment_ids is not None:
        tokens["segment_ids"] = segment_ids
    if padding_mask is not None:
        tokens["padding"] = padding_mask

    attend = functools.partial(_attend_by_index, causal=causal, window=window, scale=scale, n_rep=n_rep)
    return context_attention(remat(attend), q, k, v, tokens=tokens)


def _attend_by_index(q: Tensor, k: Tensor, v: Tensor, queries: dict, keys: dict, *, causal: bool,
                     window: Optional[int], scale: Optional[float], n_rep: int) -> Tensor:
    """Some queries `(B, H, Tq, D)` against keys and values `(B, KV, T, D)`, masked by their token tensors."""
    mask = _mask_by_index(queries, keys, causal=causal, window=window)  # (B or 1, 1, Tq, T)
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, KV, T, D) -> (B, H, T, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (B, H, Tq, D)


def _mask_by_index(queries: dict, keys: dict, *, causal: bool, window: Optional[int]) -> Tensor:
    """`attention_mask`'s rules with the queries' and keys' own token tensors: (B or 1, 1, Tq, Tk) bool."""
    def pair(name: str) -> Tuple[Tensor, Tensor]:  # (B or 1, Tq, 1), (B or 1, 1, Tk)
        qt, kt = queries[name], keys[name]
        return (qt if qt.dim() == 2 else qt[None])[:, :, None], (kt if kt.dim() == 2 else kt[None])[:, None, :]

    qi, ki = pair("index")
    mask = qi >= ki if causal else torch.ones_like(qi >= ki)
    if window is not None:
        mask = mask & ((qi - ki).abs() < window)
    if "segment_ids" in queries:
        qs, ks = pair("segment_ids")
        mask = mask & (qs == ks)
    if "padding" in queries:
        mask = mask & (pair("padding")[1].bool() | (qi == ki))
    return mask[:, None]


def _explicit_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], *, causal: bool, dropout: float, key: Optional[Key],
    scale: Optional[float] = None,
) -> Tensor:
    """softmax(q k^T * scale), keyed dropout on the probabilities (if `key`), then @ v: (B, H, T, D)."""
    t = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T)
    if mask is None and causal:
        idx = torch.arange(t, device=q.device)
        mask = idx[:, None] >= idx[None, :]  # (T, T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # (B, H, T, T)
    if key is not None:
        probs = random.dropout(key, probs, dropout)
    return probs @ v  # (B, H, T, D)
