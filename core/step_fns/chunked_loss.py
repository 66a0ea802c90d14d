"""`chunked_cross_entropy`: the LM-head cross-entropy without ever holding the whole `(N, V)` logits.

Public names: `chunked_cross_entropy`.

The tokens are cut into chunks of `chunk_size`. Each chunk's logits are computed, reduced to its
loss and, when gradients are being taken, differentiated at once (the head with `detached_vjp`,
the cross-entropy in closed form) on detached inputs, so only one chunk's logits and their gradient
are alive at a time. The gradients reach the caller's transform through a surrogate whose value is
the loss and whose gradient is the one computed chunk by chunk: `loss + sum(x * g) - stop_gradient(sum(x * g))`. That is plain autograd,
so it works under `torch.func.grad`, `torch.compile(fullgraph=True)`, torch_xla and DTensor; it
gives exact first-order gradients only (no gradient of the gradient through it).
"""

from __future__ import annotations

from typing import Any, Callable, List

import torch
from torch import Tensor

from ..autograd_grad import detached_vjp
from ..pytree import tree_flatten, tree_map
from ..types import PyTree
from .losses import cross_entropy
from .token_loss import TokenLoss

__all__ = ["chunked_cross_entropy"]

Head = Callable[[PyTree, Tensor], Tensor]
"""`head(head_params, hidden) -> logits`: `(n, d) -> (n, V)`, e.g. `lambda p, h: h @ p["weight"].T`."""


def chunked_cross_entropy(
    head: Head,
    head_params: PyTree,
    hidden: Tensor,
    labels: Tensor,
    *,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    z_loss: float = 0.0,
) -> TokenLoss:
    """Cross-entropy of `head(head_params, hidden)` against `labels`, `chunk_size` tokens at a time.

    Equals `cross_entropy(head(head_params, hidden), labels, reduction="sum_and_count")` (same
    ignore index and z-loss, logits in float32) and its gradients with respect to `hidden` and
    `head_params`, while holding at most `chunk_size x V` logits.

    Args:
        head: `head(head_params, h) -> logits`, pure; `h` is `(n, d)`, logits `(n, V)`.
        head_params: the head's parameters (a pytree: the only parameters differentiated here).
        hidden: `(..., d)` final hidden states.
        labels: `(...)` integer targets, `ignore_index` where no loss is taken.
        chunk_size: tokens per chunk (the last chunk may be shorter).
        ignore_index: label value to skip.
        z_loss: weight of `logsumexp(logits)**2` per valid token.

    Returns:
        `TokenLoss(total, count)`: the summed loss (float32) and the number of valid tokens.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunked_cross_entropy: chunk_size must be an int >= 1, got {chunk_size!r}.")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"chunked_cross_entropy: hidden must be labels.shape + (d,); got hidden {tuple(hidden.shape)} "
            f"and labels {tuple(labels.shape)}."
        )
    h = hidden.reshape(-1, hidden.shape[-1])  # (N, d)
    y = labels.reshape(-1)  # (N,)
    count = (y != ignore_index).sum()
    if not torch.is_grad_enabled():  # evaluation: no gradient to prepare
        totals = [
            cross_entropy(head(head_params, hc).float(), yc, ignore_index=ignore_index, z_loss=z_loss,
                          reduction="sum_and_count").total
            for hc, yc in _chunks(h, y, chunk_size)
        ]
        return TokenLoss(torch.stack(totals).sum(), count)

    # Each chunk is differentiated now, on inputs detached from the caller's transform, so nothing
    # of it is kept for the caller's backward pass: the head through its vjp (a linear head saves only
    # its inputs), the cross-entropy by its closed form, which needs one (n, V) buffer beside the logits.
    totals: List[Tensor] = []
    d_hidden: List[Tensor] = []
    d_params: Any = None
    for h_chunk, y_chunk in _chunks(h.detach(), y, chunk_size):
        logits, head_vjp = detached_vjp(head, head_params, h_chunk)  # (n, V)
        total, d_logits = _cross_entropy_and_grad(logits, y_chunk, ignore_index, z_loss)
        g_params, g_hidden = head_vjp(d_logits)
        totals.append(total)
        d_hidden.append(g_hidden)
        d_params = g_params if d_params is None else tree_map(torch.add, d_params, g_params)
    total = torch.stack(totals).sum()
    inject = (h * torch.cat(d_hidden).to(h.dtype)).sum(dtype=torch.float32)
    for p, g in zip(tree_flatten(head_params)[0], tree_flatten(d_params)[0]):
        if isinstance(p, Tensor) and p.is_floating_point():
            inject = inject + (p * g.to(p.dtype)).sum(dtype=torch.float32)
    # Value: `total` (x - stop_gradient(x) is exactly 0); gradient: the chunks' gradients.
    return TokenLoss(total + (inject - inject.detach()), count)


def _cross_entropy_and_grad(logits: Tensor, labels: Tensor, ignore_index: int, z_loss: Any):
    """`(sum of the per-token losses, their gradient w.r.t. logits)` for one chunk, as `cross_entropy`.

    d/dlogits of `lse - logit[y] + z * lse**2` is `softmax * (1 + 2 z lse) - onehot(y)` on valid rows.
    """
    x = logits.float()  # (n, V)
    lse = torch.logsumexp(x, dim=-1)  # (n,)
    valid = labels != ignore_index  # (n,)
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long().unsqueeze(-1)  # (n, 1)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    per_token = torch.where(valid, lse - x.gather(-1, safe).squeeze(-1) + z_loss * lse.square(), zero)  # (n,)
    scale = torch.where(valid, 1.0 + 2.0 * z_loss * lse, zero)  # (n,)
    grad = (x - lse.unsqueeze(-1)).exp_().mul_(scale.unsqueeze(-1))  # (n, V): softmax * scale
    # Out of place: an in-place scatter cannot keep a vocab-sharded DTensor's placement.
    grad = grad.scatter_add(-1, safe, -valid.to(x.dtype).unsqueeze(-1))  # - onehot(y) on valid rows
    return per_token.sum(), grad.to(logits.dtype)


def _chunks(h: Tensor, y: Tensor, size: int):
    n = h.shape[0]
    for start in range(0, n, size):
        length = min(size, n - start)
        yield h.narrow(0, start, length), y.narrow(0, start, length)
