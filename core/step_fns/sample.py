"""Autoregressive sampling as pure functions of (params, tokens, key).

Public names: `sample_token`, `generate`.

`sample_token` picks the next token from logits (greedy, temperature, top-k, top-p) with an ember key:
traceable, no host sync. `generate` runs the model on a growing window and is deterministic for a
given key: the same key gives the same text on every run.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.core.step_fns.sample import sample_token
    >>> logits = torch.tensor([[0.0, 5.0, 1.0]])
    >>> sample_token(logits, key=random.key(0), temperature=0.0).tolist()
    [1]
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .. import random
from ..types import Key, Params

__all__ = ["generate", "sample_token"]


def sample_token(
    logits: Tensor,
    *,
    key: Optional[Key] = None,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    vocab_size: Optional[int] = None,
) -> Tensor:
    """Sample one token per row from `logits`.

    Args:
        logits: (B, V) float, unnormalised scores for the next token.
        key: RNG key; required unless `temperature == 0` (greedy).
        temperature: 0 means greedy (argmax); higher flattens the distribution.
        top_k: keep only the `top_k` highest-scoring tokens before sampling.
        top_p: nucleus sampling: keep the fewest highest-probability tokens whose probabilities
            sum to at least `top_p` (in (0, 1]), after `top_k`.
        vocab_size: the tokenizer's vocabulary: ids at or past it (an embedding padded to a
            multiple of 64) are never drawn. NaN logits still give ids below it.

    Returns:
        (B,) int64 token ids.

    Raises:
        ValueError: a negative temperature, `top_k < 1`, `top_p` outside (0, 1], or sampling without a key.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
    if vocab_size is not None:  # drop the padded rows: every id left is below vocab_size
        logits = logits[..., :vocab_size]
    if temperature == 0:
        return logits.argmax(dim=-1)
    if key is None:
        raise ValueError("sampling with temperature > 0 needs `key=`; pass temperature=0 for greedy decoding.")
    logits = logits.float() / temperature
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}.")
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]  # (B, 1)
        logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if top_p is not None and top_p < 1.0:  # 1.0 keeps every token (no rounding in the cumulative sum)
        ranked, order = logits.sort(dim=-1, descending=True)  # (B, V)
        probs = ranked.softmax(dim=-1)
        beyond = probs.cumsum(dim=-1) - probs >= top_p  # the mass before this token already reaches top_p
        ranked = ranked.masked_fill(beyond, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ranked)
    # Gumbel-max: argmax(logits + Gumbel noise) is a sample from softmax(logits). The noise is made on the
    # logits' device whatever device the key is on (a key from `random.key(seed)` is on the CPU).
    u = random.uniform(key.to(logits.device), logits.shape, minval=1e-7, maxval=1.0)
    return (logits - torch.log(-torch.log(u))).argmax(dim=-1)


def generate(
    apply_fn: Callable[..., Tensor],
    params: Params,
    prompt: Tensor,
    *,
    max_new_tokens: int,
    key: Optional[Key] = None,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    vocab_size: Optional[int] = None,
    **apply_kwargs: Any,
) -> Tensor:
    """Extend `prompt` by `max_new_tokens` tokens sampled from `apply_fn(params, tokens)`.

    Args:
        apply_fn: `(params, tokens (B, T), **kw) -> logits (B, T, V)`, e.g. `model.apply`.
        params: the model parameters.
        prompt: (B, T0) int64 token ids, T0 >= 1.
        max_new_tokens: how many tokens to append.
        key: RNG key (token i uses `fold_in(key, i)`); not needed for greedy decoding.
        temperature, top_k: see `sample_token`.
        max_seq_len: crop the context to its last `max_seq_len` tokens (the model's maximum).
        vocab_size: the tokenizer's vocabulary; padded ids past it are never drawn (`sample_token`).

    Returns:
        (B, T0 + max_new_tokens) int64 token ids.
    """
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be (batch, length>=1) token ids, got shape {tuple(prompt.shape)}.")
    tokens = prompt
    for i in range(max_new_tokens):
        context = tokens if max_seq_len is None else tokens[:, -max_seq_len:]
        logits = apply_fn(params, context, **apply_kwargs)[:, -1, :]  # (B, V)
        step_key = None if key is None else random.fold_in(key, i)
        nxt = sample_token(logits, key=step_key, temperature=temperature, top_k=top_k, vocab_size=vocab_size)
        tokens = torch.cat([tokens, nxt[:, None].to(tokens.dtype)], dim=1)  # (B, T + 1)
    return tokens
