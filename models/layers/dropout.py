"""`Dropout`: key-driven dropout; the identity without a key.

Public names: `Dropout`.

Randomness comes only from the `key` argument (`ember.core.random.dropout`), so a training step is
a pure function of its inputs; evaluation passes `key=None` and gets the identity.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models.layers import Dropout
    >>> drop = Dropout(0.5)
    >>> x = torch.ones(4)
    >>> torch.equal(drop.apply({}, x), x)
    True
    >>> sorted(set(drop.apply({}, torch.ones(1000), key=random.key(0)).tolist()))
    [0.0, 2.0]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from torch import Tensor

from ...core import random
from ...core.types import Key, Params
from .module import Module

__all__ = ["Dropout"]


@dataclasses.dataclass(frozen=True)
class Dropout(Module):
    """Zero each element with probability `rate` and scale the rest by 1 / (1 - rate).

    Attributes:
        rate: drop probability in [0, 1).
    """

    rate: float = 0.0

    @property
    def reads_key(self) -> bool:
        return self.rate > 0.0  # the dropout draws

    def validate(self) -> None:
        if not 0.0 <= self.rate < 1.0:
            raise ValueError(f"Dropout.rate must be in [0, 1), got {self.rate}.")

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: any shape; key: None (or rate 0) means identity. Returns: same shape."""
        if key is None or self.rate == 0.0:
            return x
        return random.dropout(key, x, self.rate)
