"""Log-probabilities of responses: per token, then summed per sequence (per packed segment).

Public names: `token_logps`, `chunked_token_logps`, `sequence_logps`, `SequenceLogps`.

The targets are the next tokens, already shifted (`targets[t]` is the token after `inputs[t]`, as
SFT windows carry them) with `ignore_index` on the prompt and the padding: the shift happens once, in
the data. `chunked_token_logps` runs the LM head `chunk_size` tokens at a time, each chunk under
`remat`, so neither the forward nor the backward pass ever holds more than one chunk's `(n, V)`
logits; its log-probabilities are ordinary autograd values, so any loss of them (DPO's is not a sum
over tokens) gets exact gradients, at the cost of a second head forward in the backward pass.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from ..remat import remat
from ..types import PyTree

__all__ = ["SequenceLogps", "chunked_token_logps", "sequence_logps", "token_logps"]

Head = Callable[[PyTree, Tensor], Tensor]
"""`head(head_params, hidden) -> logits`: `(n, d) -> (n, V)`."""


def token_logps(logits: Tensor, targets: Tensor, *, ignore_index: int = -100) -> Tensor:
    """`log softmax(logits)[target]` per position in float32, 0 where the target is `ignore_index`.

    Args:
        logits: `(..., V)` floating scores.
        targets: `(...)` integer next tokens, `ignore_index` where nothing is scored.

    Returns:
        `(...)` float32 (float64 for float64 logits) log-probabilities.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
        >>> token_logps(logits, torch.tensor([1, -100])).tolist()
        [-0.6931471824645996, 0.0]
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"token_logps: logits must be targets.shape + (V,); got logits {tuple(logits.shape)} "
                         f"and targets {tuple(targets.shape)}.")
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long().unsqueeze(-1)
    picked = x.gather(-1, safe).squeeze(-1) - torch.logsumexp(x, dim=-1)
    return torch.where(valid, picked, torch.zeros_like(picked))


def chunked_token_logps(head: Head, head_params: PyTree, hidden: Tensor, targets: Tensor, *,
                        chunk_size: int = 1024, ignore_index: int = -100) -> Tensor:
    """`token_logps(head(head_params, hidden), targets)`, `chunk_size` tokens at a time.

    Equal to the unchunked values and their gradients (with respect to `hidden` and `head_params`);
    each chunk is rematerialised, so at most `chunk_size x V` logits are alive in either pass.

    Args:
        head: `head(head_params, h) -> logits`, pure; `h` is `(n, d)`.
        head_params: the head's parameters.
        hidden: `(..., d)` final hidden states.
        targets: `(...)` next tokens, `ignore_index` where nothing is scored.
        chunk_size: tokens per chunk.
        ignore_index: target value to skip.

    Returns:
        `(...)` float32 log-probabilities, 0 at ignored positions.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunked_token_logps: chunk_size must be an int >= 1, got {chunk_size!r}.")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"chunked_token_logps: hidden must be targets.shape + (d,); got hidden "
                         f"{tuple(hidden.shape)} and targets {tuple(targets.shape)}.")

    def chunk(params: PyTree, h: Tensor, y: Tensor) -> Tensor:
        return token_logps(head(params, h), y, ignore_index=ignore_index)

    run = remat(chunk)
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    n = h.shape[0]
    parts = [run(head_params, h.narrow(0, s, min(chunk_size, n - s)), y.narrow(0, s, min(chunk_size, n - s)))
             for s in range(0, n, chunk_size)]
    return torch.cat(parts).reshape(targets.shape)


class SequenceLogps(NamedTuple):
    """Summed log-probabilities and scored-token counts: `(B,)` per row, or `(B, S)` per packed segment."""

    total: Tensor
    count: Tensor

    def mean(self) -> Tensor:
        """Per-token average (0 where nothing is scored, not NaN)."""
        return self.total / self.count.to(self.total.dtype).clamp(min=1.0)


def sequence_logps(per_token: Tensor, targets: Tensor, *, segment_ids: Optional[Tensor] = None,
                   num_segments: Optional[int] = None, ignore_index: int = -100) -> SequenceLogps:
    """Sum `(B, T)` per-token log-probabilities over each sequence's scored tokens.

    Without `segment_ids`, one sequence per row: `(B,)` sums and counts. With packed rows
    (`segment_ids` `(B, T)`: 1, 2, ... per sequence, 0 for padding), `(B, num_segments)`: entry
    `[b, k]` is segment `k + 1` of row `b` (zeros where a row has fewer segments).

    Example:
        >>> import torch
        >>> lp = torch.tensor([[-1.0, -2.0, -3.0, 0.0]])
        >>> y = torch.tensor([[5, 6, 7, -100]])
        >>> sequence_logps(lp, y).total.tolist(), sequence_logps(lp, y).count.tolist()
        ([-6.0], [3])
        >>> seg = torch.tensor([[1, 1, 2, 0]])
        >>> sequence_logps(lp, y, segment_ids=seg, num_segments=2).total.tolist()
        [[-3.0, -3.0]]
    """
    if per_token.shape != targets.shape or per_token.dim() != 2:
        raise ValueError(f"sequence_logps: per_token and targets must both be (B, T); got {tuple(per_token.shape)} "
                         f"and {tuple(targets.shape)}.")
    valid = targets != ignore_index
    if segment_ids is None:
        return SequenceLogps(per_token.sum(-1), valid.sum(-1))
    if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 1:
        raise ValueError(f"sequence_logps: packed rows need num_segments, the most sequences a row holds "
                         f"(an int >= 1, fixed so the shape is static), got {num_segments!r}.")
    # (B, T, S) one-hot of each position's segment; padding (0) matches no column.
    ids = torch.arange(1, num_segments + 1, device=segment_ids.device)
    member = (segment_ids.unsqueeze(-1) == ids) & valid.unsqueeze(-1)
    total = (per_token.unsqueeze(-1) * member.to(per_token.dtype)).sum(1)
    return SequenceLogps(total, member.sum(1))
