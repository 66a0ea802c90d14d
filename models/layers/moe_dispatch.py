"""Token dispatch for mixtures of experts, with static shapes: tokens -> (G, E, C, d) buffer -> tokens.

Public names: `Slots`, `expert_capacity`, `assign_slots`, `dispatch`, `combine`, `one_hot`.

Tokens are routed group by group (a group is one sequence of the batch). Each expert has `C`
slots per group; a (token, expert) pair takes the next free slot of its expert, first choices
of every token before second choices (GShard's priority), and a pair that finds its expert full
is dropped (it adds nothing; the residual carries the token on). With `C = S`, the tokens of a
group, nothing can be dropped: a token picks an expert at most once ("dropless").

Every shape depends on the config only, never on the routing: one compiled graph serves every
step, there is no host sync, and on a mesh the buffer is resharded from split-by-group to
split-by-expert, which is an all-to-all (`ember.models.layers.moe`).

Example:
    >>> import torch
    >>> idx = torch.tensor([[[0], [0], [1]]])          # (G=1, S=3, k=1): two tokens want expert 0
    >>> s = assign_slots(idx, n_experts=2, capacity=1)
    >>> s.slot.tolist(), int(s.dropped)               # the second token finds expert 0 full
    ([[0, 2, 1]], 1)
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["Slots", "assign_slots", "combine", "dispatch", "expert_capacity", "one_hot"]


def one_hot(indices: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """`F.one_hot(indices, n)` in `dtype`, without its range check (a value read, which a traced step cannot do)."""
    return (indices.unsqueeze(-1) == torch.arange(n, device=indices.device)).to(dtype)


def expert_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: Optional[float]) -> int:
    """Slots per expert and group: `ceil(factor * S * k / E)`, at most `S`; `S` (dropless) for None."""
    if capacity_factor is None:
        return tokens
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / n_experts)))


class Slots(NamedTuple):
    """Where each (token, expert) pair of a group went.

    Attributes:
        slot: (G, k*S) int64, pair `j*S + t` (token t's j-th choice) -> its slot `e*C + position`,
            or `E*C` (no slot: dropped).
        source: (G, E*C) int64, slot -> the token that fills it, or `S` (an empty slot).
        counts: (G, E) float32, pairs of real tokens routed to each expert (before dropping).
        dropped: 0-d float32, pairs of real tokens dropped in all groups.
    """

    slot: Tensor
    source: Tensor
    counts: Tensor
    dropped: Tensor


def assign_slots(indices: Tensor, n_experts: int, capacity: int, valid: Optional[Tensor] = None) -> Slots:
    """Slots for routed pairs.

    Args:
        indices: (G, S, k) chosen experts.
        valid: (G, S) bool, False for padding: its pairs take no slot and count neither as routed nor
            as dropped. None: every token is real.

    Returns:
        `Slots`.
    """
    G, S, k = indices.shape
    E, C = n_experts, capacity
    order = indices.transpose(1, 2).reshape(G, k * S)  # (G, k*S): first choices of all tokens first
    onehot = one_hot(order, E, torch.int32)  # (G, k*S, E)
    if valid is not None:
        real = valid.to(torch.bool).repeat(1, k)  # (G, k*S): pair j*S + t belongs to token t
        onehot = onehot * real.unsqueeze(-1).to(onehot.dtype)
    position = (onehot.cumsum(1) * onehot).sum(-1) - 1  # (G, k*S): the pair's rank among its expert's pairs
    kept = position < C if valid is None else real & (position < C)
    slot = torch.where(kept, order * C + position, torch.full_like(order, E * C))  # (G, k*S)
    token = torch.arange(S, device=indices.device).repeat(k).expand(G, k * S)  # (G, k*S): pair -> token
    source = torch.full((G, E * C + 1), S, dtype=torch.int64, device=indices.device)
    source = source.scatter(1, slot, token)[:, : E * C]  # (G, E*C); dropped pairs all land in the cut column
    counts = onehot.sum(1).to(torch.float32)  # (G, E)
    dropped = ((~kept) if valid is None else (real & ~kept)).sum().to(torch.float32)
    return Slots(slot, source, counts, dropped)


def dispatch(x: Tensor, slots: Slots, n_experts: int, capacity: int) -> Tensor:
    """Tokens into expert slots. Args: x: (G, S, d). Returns: (G, E, C, d), zeros in empty slots."""
    G, S, d = x.shape
    padded = torch.cat([x, x.new_zeros(G, 1, d)], dim=1)  # (G, S+1, d): row S is the empty slot's zeros
    buffer = padded.gather(1, slots.source.unsqueeze(-1).expand(G, n_experts * capacity, d))  # (G, E*C, d)
    return buffer.view(G, n_experts, capacity, d)


def combine(y: Tensor, slots: Slots, weights: Tensor) -> Tensor:
    """Expert outputs back to tokens, weighted and summed over each token's k choices.

    Args:
        y: (G, E, C, d) expert outputs per slot.
        slots: from `assign_slots`.
        weights: (G, S, k) routing weights.

    Returns:
        (G, S, d); a dropped pair adds nothing.
    """
    G, E, C, d = y.shape
    S, k = weights.shape[1], weights.shape[2]
    padded = torch.cat([y.reshape(G, E * C, d), y.new_zeros(G, 1, d)], dim=1)  # (G, E*C+1, d)
    pairs = padded.gather(1, slots.slot.unsqueeze(-1).expand(G, k * S, d)).view(G, k, S, d)  # (G, k, S, d)
    return (pairs * weights.transpose(1, 2).unsqueeze(-1).to(pairs.dtype)).sum(1)  # (G, S, d)
