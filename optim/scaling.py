"""Scaling updates by a constant, a learning rate, or a schedule.

Public names: `scale`, `scale_by_learning_rate`, `scale_by_schedule`, `ScaleByScheduleState`.

Example:
    >>> import torch
    >>> from ember import optim
    >>> tx = optim.scale_by_learning_rate(0.5)
    >>> updates, _ = tx.update({"w": torch.ones(2)}, tx.init({"w": torch.zeros(2)}))
    >>> updates["w"].tolist()
    [-0.5, -0.5]
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

from torch import Tensor

from ..core import pytree
from ..core.pytree import tree_flatten, tree_unflatten
from ..core.types import Params, Schedule, Updates
from . import _foreach
from .base import GradientTransformation, ScalarOrSchedule, stateless
from .hyperparams import _eval_schedule

__all__ = [
    "ScaleByScheduleState",
    "scale",
    "scale_by_learning_rate",
    "scale_by_schedule",
]


def _scale_leaves(updates: Updates, factor: Union[float, Tensor]) -> Updates:
    leaves, spec = tree_flatten(updates)
    return tree_unflatten(_foreach.mul(leaves, factor), spec)


def scale(step_size: Union[float, Tensor]) -> GradientTransformation:
    """Multiply every update by `step_size`.

    Args:
        step_size: a Python number or a 0-d tensor (an injected hyperparameter). A 0-d float32
            tensor does not promote low-precision updates: bf16 stays bf16.

    Returns:
        A stateless `GradientTransformation`.

    Raises:
        TypeError: `step_size` is callable (use `scale_by_schedule`).
    """
    if callable(step_size):
        raise TypeError(
            f"scale(step_size) expects a number or a 0-d tensor, got the callable {step_size!r}. "
            f"For a schedule use scale_by_schedule(schedule) or scale_by_learning_rate(schedule)."
        )

    return stateless(lambda updates, params: _scale_leaves(updates, step_size))


@pytree.dataclass
class ScaleByScheduleState:
    """State of `scale_by_schedule`: `count` is a 0-d int64 tensor (updates so far)."""

    count: Tensor


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply updates by `step_size_fn(count)`, with `count` the number of updates so far.

    Args:
        step_size_fn: a schedule `count -> 0-d tensor` (see `ember.optim.schedules`).

    Returns:
        A `GradientTransformation` with a `ScaleByScheduleState`.

    Raises:
        TypeError: (from `update`) the schedule does not return a 0-d tensor.
    """

    def init_fn(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=_foreach.zero_count(params))

    def update_fn(
        updates: Updates, state: ScaleByScheduleState, params: Optional[Params] = None
    ) -> Tuple[Updates, ScaleByScheduleState]:
        del params
        step_size = _eval_schedule("step_size", step_size_fn, state.count)
        return _scale_leaves(updates, step_size), ScaleByScheduleState(count=state.count + 1)

    return GradientTransformation(init_fn, update_fn)


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """Multiply updates by `-learning_rate` (gradient descent), or `+learning_rate`.

    Args:
        learning_rate: a Python number, a 0-d tensor, or a schedule `count -> 0-d tensor`.
        flip_sign: negate the learning rate (the default: updates are added to params).

    Returns:
        `scale(...)` for a constant, `scale_by_schedule(...)` for a schedule.
    """
    sign = -1 if flip_sign else 1
    if callable(learning_rate):
        return scale_by_schedule(
            lambda count: sign * _eval_schedule("learning_rate", learning_rate, count)
        )
    return scale(sign * learning_rate)
