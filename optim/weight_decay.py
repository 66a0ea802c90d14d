"""Decoupled weight decay: add `weight_decay * param` to each update.

Public names: `add_decayed_weights`.

Example:
    >>> import torch
    >>> from ember import optim
    >>> params = {"w": torch.ones(2)}
    >>> tx = optim.add_decayed_weights(0.1)
    >>> updates, _ = tx.update({"w": torch.zeros(2)}, tx.init(params), params)
    >>> [round(v, 4) for v in updates["w"].tolist()]
    [0.1, 0.1]
"""

from __future__ import annotations

from typing import Optional, Union

from torch import Tensor

from ..core.pytree import tree_flatten, tree_leaves, tree_unflatten
from ..core.types import Params, Updates
from . import _foreach
from .base import NO_PARAMS_MSG, GradientTransformation, stateless
from .masking import Mask, masked

__all__ = ["add_decayed_weights"]


def add_decayed_weights(
    weight_decay: Union[float, Tensor] = 0.0,
    mask: Optional[Mask] = None,
) -> GradientTransformation:
    """Add `weight_decay * param` to each update (before the learning rate scales it).

    In a chain `scale_by_adam -> add_decayed_weights -> scale_by_learning_rate` this is AdamW's
    decoupled decay (Loshchilov & Hutter, 2019); before `trace` it is SGD's L2 penalty.

    Args:
        weight_decay: the decay rate (Python number or 0-d tensor; schedule it with
            `inject_hyperparams(add_decayed_weights, static_args="mask")(weight_decay=sched)`).
        mask: which parameters to decay: a pytree of bools or a function `params -> bools`,
            such as `decay_mask` (no decay on norms and biases). `None` decays every parameter.

    Returns:
        A `GradientTransformation` (stateless; wrapped in `masked` when a mask is given).

    Raises:
        TypeError: `weight_decay` is callable.
        ValueError: (from `update`) `params` is None.
    """
    if callable(weight_decay):
        raise TypeError(
            f"add_decayed_weights(weight_decay=...) expects a number or a 0-d tensor, got the "
            f"callable {weight_decay!r}. To schedule it, use "
            f"inject_hyperparams(add_decayed_weights, static_args='mask')(weight_decay=schedule)."
        )

    def decay(updates: Updates, params: Optional[Params]) -> Updates:
        if params is None:
            raise ValueError(NO_PARAMS_MSG.format(name="add_decayed_weights"))
        leaves, spec = tree_flatten(updates)
        decayed = _foreach.add_scaled(leaves, tree_leaves(params), weight_decay)
        return tree_unflatten(decayed, spec)

    tx = stateless(decay)
    return tx if mask is None else masked(tx, mask)
