"""Lion's rescaling: the sign of an interpolation between the gradient and its momentum.

Public names: `scale_by_lion`, `ScaleByLionState`.

The update equations, reference and an example are on the alias `ember.optim.lion`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..core import pytree
from ..core.pytree import tree_flatten, tree_leaves, tree_unflatten
from ..core.tree_math import tree_zeros_like
from ..core.types import Params, Updates
from . import _foreach
from .adam import _check_beta
from .base import GradientTransformation, Scalar

__all__ = ["ScaleByLionState", "scale_by_lion"]



@pytree.dataclass
class ScaleByLionState:
    """State of `scale_by_lion`.

    Attributes:
        count: 0-d int64 tensor, the number of updates so far.
        mu: the momentum, same structure as params (dtype `mu_dtype` or the param's).
    """

    count: Tensor
    mu: Updates


def scale_by_lion(
    b1: Scalar = 0.9,
    b2: Scalar = 0.99,
    *,
    mu_dtype: Optional[torch.dtype] = None,
) -> GradientTransformation:
    """Rescale updates to `sign((1 - b1) * g + b1 * m)`, then update `m` with rate `b2`.

    Args:
        b1: interpolation weight of the momentum in the update.
        b2: decay of the momentum.
        mu_dtype: dtype of the momentum (default: the param's dtype).

    Returns:
        A `GradientTransformation` with a `ScaleByLionState`; see `ember.optim.lion`.

    Raises:
        ValueError: `b1` or `b2` is a number outside `[0, 1)`.
    """
    _check_beta("scale_by_lion", "b1", b1)
    _check_beta("scale_by_lion", "b2", b2)

    def init_fn(params: Params) -> ScaleByLionState:
        return ScaleByLionState(
            count=_foreach.zero_count(params), mu=tree_zeros_like(params, dtype=mu_dtype)
        )

    def update_fn(
        updates: Updates, state: ScaleByLionState, params: Optional[Params] = None
    ) -> Tuple[Updates, ScaleByLionState]:
        del params
        grads, spec = tree_flatten(updates)
        count = state.count + 1
        if not grads:
            return updates, state.replace(count=count)
        mu_old = tree_leaves(state.mu)
        out = _foreach.sign(_foreach.moment(grads, mu_old, b1))
        mu = _foreach.cast(_foreach.moment(grads, mu_old, b2), _foreach.dtypes_of(mu_old))
        return tree_unflatten(out, spec), ScaleByLionState(count=count, mu=tree_unflatten(mu, spec))

    return GradientTransformation(init_fn, update_fn)
