"""Adam's rescaling: bias-corrected first and second moment estimates.

Public names: `scale_by_adam`, `ScaleByAdamState`.

The full update equations, references and an example are on the aliases `ember.optim.adam` and
`ember.optim.adamw`.
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
from .base import GradientTransformation, Scalar

__all__ = ["ScaleByAdamState", "scale_by_adam"]



def _check_beta(fn: str, name: str, value: Scalar) -> None:
    if _foreach.is_number(value) and not 0.0 <= value < 1.0:
        raise ValueError(f"{fn}({name}=...) must be in [0, 1), got {name}={value}.")


@pytree.dataclass
class ScaleByAdamState:
    """State of `scale_by_adam`.

    Attributes:
        count: 0-d int64 tensor, the number of updates so far.
        mu: first moment, same structure as params (dtype `mu_dtype` or the param's).
        nu: second moment, same structure and dtypes as params.
    """

    count: Tensor
    mu: Updates
    nu: Updates


def scale_by_adam(
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-8,
    eps_root: Scalar = 0.0,
    *,
    mu_dtype: Optional[torch.dtype] = None,
    nesterov: bool = False,
) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moments: `m_hat / (sqrt(v_hat + eps_root) + eps)`.

    See `ember.optim.adam` for the equations. Every scalar may be a 0-d tensor.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root (a Python `0.0` skips the addition).
        mu_dtype: dtype of the first moment (default: the param's dtype).
        nesterov: NAdam's look-ahead, as optax's: `b1 * m_hat(t + 1) + (1 - b1) * g / (1 - b1^t)` in place of
            `m_hat`.

    Returns:
        A `GradientTransformation` with a `ScaleByAdamState`.

    Raises:
        ValueError: `b1` or `b2` is a number outside `[0, 1)`.
    """
    _check_beta("scale_by_adam", "b1", b1)
    _check_beta("scale_by_adam", "b2", b2)

    def init_fn(params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(
            count=_foreach.zero_count(params),
            mu=tree_zeros_like(params, dtype=mu_dtype),
            nu=tree_zeros_like(params),
        )

    def update_fn(
        updates: Updates, state: ScaleByAdamState, params: Optional[Params] = None
    ) -> Tuple[Updates, ScaleByAdamState]:
        del params
        grads, spec = tree_flatten(updates)
        count = state.count + 1
        if not grads:
            return updates, state.replace(count=count)
        mu_old, nu_old = tree_leaves(state.mu), tree_leaves(state.nu)
        mu = _foreach.moment(grads, mu_old, b1)
        nu = _foreach.moment(torch._foreach_mul(grads, grads), nu_old, b2)
        c2 = _foreach.bias_correction(b2, count)
        if nesterov:  # the corrected look-ahead moment, then a direction without the first correction
            out = _foreach.adam_direction(_foreach.look_ahead(mu, grads, b1, count), nu, (None, c2), eps, eps_root)
        else:
            out = _foreach.adam_direction(mu, nu, (_foreach.bias_correction(b1, count), c2), eps, eps_root)
        new_state = ScaleByAdamState(
            count=count,
            mu=tree_unflatten(_foreach.cast(mu, _foreach.dtypes_of(mu_old)), spec),
            nu=tree_unflatten(_foreach.cast(nu, _foreach.dtypes_of(nu_old)), spec),
        )
        return tree_unflatten(out, spec), new_state

    return GradientTransformation(init_fn, update_fn)
