"""Gradient clipping: by the global norm of all updates, or by each update's RMS.

Public names: `clip` (each element to [-max_delta, max_delta]), `clip_by_global_norm`, `clip_by_block_rms`,
`global_norm` (optax.global_norm: the norm
`clip_by_global_norm` compares, from `ember.core.tree_math`).

Both are stateless (`EmptyState`) and take their threshold as a Python number or a 0-d tensor,
so `inject_hyperparams` can make the threshold a tunable tensor.

Example:
    >>> import torch
    >>> from ember import optim
    >>> tx = optim.clip_by_global_norm(1.0)
    >>> updates, _ = tx.update({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, tx.init(None))
    >>> [round(updates[k].item(), 4) for k in ("a", "b")]
    [0.6, 0.8]
"""

from __future__ import annotations

from typing import Callable, List, Optional, Union

import torch
from torch import Tensor

from ..core.pytree import tree_flatten, tree_unflatten
from ..core.tree_math import global_norm as global_norm
from ..core.types import Params, Updates
from . import _foreach
from .base import GradientTransformation, stateless

__all__ = ["clip", "clip_by_block_rms", "clip_by_global_norm", "global_norm"]


def _check_positive(fn: str, name: str, value: Union[float, Tensor]) -> None:
    if _foreach.is_number(value) and not value > 0:
        raise ValueError(f"{fn}({name}=...) must be positive, got {name}={value}.")


def _on_leaves(fn: Callable[[List[Tensor]], List[Tensor]]) -> GradientTransformation:
    """A stateless transformation mapping the flat list of update leaves with `fn` (no leaves: unchanged)."""

    def update(updates: Updates, params: Optional[Params]) -> Updates:
        del params
        leaves, spec = tree_flatten(updates)
        return tree_unflatten(list(fn(leaves)), spec) if leaves else updates

    return stateless(update)


def clip(max_delta: Union[float, Tensor]) -> GradientTransformation:
    """Clamp every element of every update to `[-max_delta, max_delta]` (optax's `clip`).

    Raises:
        ValueError: `max_delta` is a number `<= 0`.
    """
    _check_positive("clip", "max_delta", max_delta)
    return _on_leaves(lambda leaves: torch._foreach_minimum(torch._foreach_maximum(leaves, -max_delta), max_delta))


def clip_by_global_norm(max_norm: Union[float, Tensor]) -> GradientTransformation:
    """Scale all updates by `max_norm / norm` when their global L2 norm exceeds `max_norm`.

    The global norm is the L2 norm of all leaves together, in float32. Below the threshold the
    updates come back bit-identical (they are multiplied by exactly 1). A building block of
    `adamw` & co.: put it first in a `chain`.

    Args:
        max_norm: the largest allowed global norm (Python number or 0-d tensor).

    Returns:
        A stateless `GradientTransformation`.

    Raises:
        ValueError: `max_norm` is a number `<= 0`.

    References:
        Pascanu et al., On the difficulty of training recurrent neural networks, 2013
        (https://arxiv.org/abs/1211.5063).
    """
    _check_positive("clip_by_global_norm", "max_norm", max_norm)

    def clip(leaves: List[Tensor]) -> List[Tensor]:
        norm = global_norm(leaves)
        return _foreach.mul(leaves, torch.where(norm < max_norm, 1.0, max_norm / norm))

    return _on_leaves(clip)


def clip_by_block_rms(threshold: Union[float, Tensor]) -> GradientTransformation:
    """Divide each update leaf by `max(1, rms(leaf) / threshold)` (Adafactor's update clipping).

    Args:
        threshold: the largest allowed root-mean-square of one leaf (number or 0-d tensor).

    Returns:
        A stateless `GradientTransformation`; see `ember.optim.adafactor`.

    Raises:
        ValueError: `threshold` is a number `<= 0`.
    """
    _check_positive("clip_by_block_rms", "threshold", threshold)

    def clip(leaves: List[Tensor]) -> List[Tensor]:
        denom = _foreach.scalar_map(lambda r: torch.clamp_min(r / threshold, 1.0), _foreach.per_leaf_rms(leaves))
        return torch._foreach_div(leaves, denom)

    return _on_leaves(clip)
