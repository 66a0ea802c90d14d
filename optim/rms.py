"""Gradients divided by the root of their squares' moving average (RMSProp's scaling), and NaNs set to zero.

Public names: `scale_by_rms`, `ScaleByRmsState`, `zero_nans`, `ZeroNansState` (optax's names and meaning).

Example:
    >>> import torch
    >>> from ember import optim
    >>> tx = optim.scale_by_rms(decay=0.0, eps=0.0)
    >>> updates, _ = tx.update({"w": torch.tensor([2.0, -0.5])}, tx.init({"w": torch.zeros(2)}))
    >>> updates["w"].tolist()
    [1.0, -1.0]
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..core import pytree
from ..core.pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from ..core.types import Params, Updates
from . import _foreach
from .base import GradientTransformation, Scalar

__all__ = ["ScaleByRmsState", "ZeroNansState", "scale_by_rms", "zero_nans"]


@pytree.dataclass
class ScaleByRmsState:
    """State of `scale_by_rms`: the 0-d int64 step `count` and the squares' moving average `nu`."""

    count: Tensor
    nu: Updates


def scale_by_rms(decay: Scalar = 0.9, eps: Scalar = 1e-8, initial_scale: float = 0.0, eps_in_sqrt: bool = True,
                 bias_correction: bool = False) -> GradientTransformation:
    """`g / sqrt(nu + eps)` (or `g / (sqrt(nu) + eps)` without `eps_in_sqrt`), `nu` the moving average of `g**2`
    starting at `initial_scale`, divided by `1 - decay**t` with `bias_correction` (optax's `scale_by_rms`;
    the count is kept either way)."""

    def init_fn(params: Params) -> ScaleByRmsState:
        return ScaleByRmsState(count=_foreach.zero_count(params),
                               nu=tree_map(lambda p: torch.full_like(p, initial_scale), params))

    def update_fn(updates: Updates, state: ScaleByRmsState,
                  params: Optional[Params] = None) -> Tuple[Updates, ScaleByRmsState]:
        del params
        grads, spec = tree_flatten(updates)
        count = state.count + 1 if bias_correction else state.count
        if not grads:
            return updates, state.replace(count=count)
        nu = _foreach.moment(torch._foreach_mul(grads, grads), tree_leaves(state.nu), decay)
        nu_hat = torch._foreach_div(nu, _foreach.bias_correction(decay, count)) if bias_correction else nu
        if eps_in_sqrt:  # optax's rounding: g * rsqrt(nu + eps), g * (1 / (sqrt(nu) + eps))
            scaling = torch._foreach_rsqrt(_foreach.add_scalar(nu_hat, eps))
        else:
            scaling = torch._foreach_reciprocal(_foreach.add_scalar(torch._foreach_sqrt(nu_hat), eps))
        return tree_unflatten(list(torch._foreach_mul(grads, scaling)), spec), ScaleByRmsState(
            count=count, nu=tree_unflatten(nu, spec))

    return GradientTransformation(init_fn, update_fn)


@pytree.dataclass
class ZeroNansState:
    """State of `zero_nans`: per leaf, a 0-d bool tensor saying whether the last update held a NaN."""

    found_nan: Updates


def zero_nans() -> GradientTransformation:
    """Every NaN of the updates replaced by 0, and which leaves held one recorded in the state (optax's
    `zero_nans`; Infs pass, and `apply_if_finite` skips a whole step instead)."""

    def init_fn(params: Params) -> ZeroNansState:
        return ZeroNansState(found_nan=tree_map(lambda p: torch.zeros((), dtype=torch.bool, device=p.device), params))

    def update_fn(updates: Updates, state: ZeroNansState,
                  params: Optional[Params] = None) -> Tuple[Updates, ZeroNansState]:
        del params, state
        found = tree_map(lambda u: torch.isnan(u).any(), updates)
        return tree_map(lambda u: torch.where(torch.isnan(u), torch.zeros_like(u), u), updates), ZeroNansState(found)

    return GradientTransformation(init_fn, update_fn)
