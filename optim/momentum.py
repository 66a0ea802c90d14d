"""Momentum: `trace` (heavy-ball / Nesterov, as in SGD) and `ema` (exponential moving average).

Public names: `trace`, `TraceState`, `ema`, `EmaState`.

`trace` keeps `t = decay * t + g` (torch.optim.SGD's momentum buffer, no dampening); `ema` keeps
`m = decay * m + (1 - decay) * g`, optionally debiased. The equations of SGD with momentum are on
the alias `ember.optim.sgd`.
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

__all__ = ["EmaState", "TraceState", "ema", "trace"]



@pytree.dataclass
class TraceState:
    """State of `trace`: `trace` has the structure of params (`accumulator_dtype` or theirs)."""

    trace: Updates


def trace(
    decay: Scalar,
    nesterov: bool = False,
    *,
    accumulator_dtype: Optional[torch.dtype] = None,
) -> GradientTransformation:
    """Momentum: `t = decay * t + g`; the update is `t`, or `g + decay * t` with Nesterov.

    Args:
        decay: the momentum coefficient (number or 0-d tensor).
        nesterov: use Nesterov's look-ahead form (as `torch.optim.SGD(nesterov=True)`).
        accumulator_dtype: dtype of the trace (default: the param's dtype).

    Returns:
        A `GradientTransformation` with a `TraceState`; see `ember.optim.sgd`.
    """

    def init_fn(params: Params) -> TraceState:
        return TraceState(trace=tree_zeros_like(params, dtype=accumulator_dtype))

    def update_fn(
        updates: Updates, state: TraceState, params: Optional[Params] = None
    ) -> Tuple[Updates, TraceState]:
        del params
        grads, spec = tree_flatten(updates)
        if not grads:
            return updates, state
        old = tree_leaves(state.trace)
        new = _foreach.add_scaled(grads, old, decay)
        out = _foreach.add_scaled(grads, new, decay) if nesterov else new
        new_trace = tree_unflatten(_foreach.cast(new, _foreach.dtypes_of(old)), spec)
        return tree_unflatten(out, spec), TraceState(trace=new_trace)

    return GradientTransformation(init_fn, update_fn)


@pytree.dataclass
class EmaState:
    """State of `ema`: `count` is a 0-d int64 tensor, `ema` has the structure of params."""

    count: Tensor
    ema: Updates


def ema(
    decay: Scalar,
    debias: bool = True,
    *,
    accumulator_dtype: Optional[torch.dtype] = None,
) -> GradientTransformation:
    """Exponential moving average `m = decay * m + (1 - decay) * g`; the update is `m`.

    Args:
        decay: the averaging coefficient (number or 0-d tensor).
        debias: divide the update by `1 - decay ** count` (Adam's bias correction).
        accumulator_dtype: dtype of the average (default: the param's dtype).

    Returns:
        A `GradientTransformation` with an `EmaState` (used by `ember.optim.adafactor`'s momentum).
    """

    def init_fn(params: Params) -> EmaState:
        return EmaState(
            count=_foreach.zero_count(params),
            ema=tree_zeros_like(params, dtype=accumulator_dtype),
        )

    def update_fn(
        updates: Updates, state: EmaState, params: Optional[Params] = None
    ) -> Tuple[Updates, EmaState]:
        del params
        grads, spec = tree_flatten(updates)
        count = state.count + 1
        if not grads:
            return updates, state.replace(count=count)
        old = tree_leaves(state.ema)
        new = _foreach.moment(grads, old, decay)
        out = new
        if debias:
            out = list(torch._foreach_div(new, _foreach.bias_correction(decay, count)))
        new_state = EmaState(
            count=count, ema=tree_unflatten(_foreach.cast(new, _foreach.dtypes_of(old)), spec)
        )
        return tree_unflatten(out, spec), new_state

    return GradientTransformation(init_fn, update_fn)
