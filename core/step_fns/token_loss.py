"""`TokenLoss`: a loss given as a sum over valid tokens and their count.

Public names: `TokenLoss`.

A mean loss cannot be accumulated exactly: with masked targets, the mean of two microbatches' means
`(x1/n1 + x2/n2) / 2` is not the batch's mean `(x1 + x2) / (n1 + n2)`. A loss function that returns
`TokenLoss(total, count)` lets `train_step` add the totals and the counts over microbatches (and,
on a mesh, over data-parallel ranks: the sums are global) and divide once, so the gradient is the
same whatever the batch is split into.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["TokenLoss"]


class TokenLoss(NamedTuple):
    """A loss as `total` (0-d float: the summed per-token losses) and `count` (0-d: valid tokens).

    Example:
        >>> import torch
        >>> from ember.core.step_fns import TokenLoss
        >>> loss = TokenLoss(torch.tensor(6.0), torch.tensor(4))
        >>> float(loss.mean())
        1.5
    """

    total: Tensor
    count: Tensor

    def mean(self) -> Tensor:
        """`total / count` in float32 (0 when no token is valid, not NaN)."""
        return self.total.to(torch.float32) / self.count.to(torch.float32).clamp(min=1.0)

