"""Schedule-free optimization: no decay schedule, an average of the iterates instead (optax.contrib's).

Public names: `schedule_free`, `schedule_free_adamw`, `schedule_free_eval_params`, `ScheduleFreeState`.

`schedule_free(base, lr)` keeps the base optimizer's iterate `z` in its state and trains the parameters at
`y = b1 * x + (1 - b1) * z`, where `x` is a running average of the `z`s weighted by `max_lr ** weight_lr_power`
(Defazio et al., 2024). Evaluate at `x`: `schedule_free_eval_params(state, params)`. The meaning, the state's
fields and its quirks (the learning-rate schedule sees a step count that starts at 1) are optax's.

Example:
    >>> import torch
    >>> from ember import optim
    >>> tx = optim.schedule_free_adamw(1e-2, warmup_steps=10)
    >>> params = {"w": torch.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": torch.ones(2)}, state, params)
    >>> eval_params = optim.schedule_free_eval_params(state, optim.apply_updates(params, updates))
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..core import pytree
from ..core.pytree import tree_flatten, tree_map
from ..core.types import OptState, Params, Updates
from . import _foreach
from .base import GradientTransformation, Scalar, ScalarOrSchedule, require_transformation
from .combining import chain
from .hyperparams import inject_hyperparams
from .rms import scale_by_rms
from .scaling import scale_by_learning_rate
from .schedules import warmup_constant_schedule
from .weight_decay import add_decayed_weights

__all__ = ["ScheduleFreeState", "schedule_free", "schedule_free_adamw", "schedule_free_eval_params"]


@pytree.dataclass
class ScheduleFreeState:
    """State of `schedule_free` (optax's fields; the count is int64, 1 before the first update).

    Attributes:
        b1: the interpolation between the average `x` and the iterate `z` (0-d).
        weight_sum: the sum of the averaging weights so far.
        step_count: 1 + the number of updates so far.
        max_lr: the largest learning rate so far.
        base_optimizer_state: the base optimizer's state.
        z: the base optimizer's iterate (params' structure).
    """

    b1: Tensor
    weight_sum: Tensor
    step_count: Tensor
    max_lr: Tensor
    base_optimizer_state: OptState
    z: Params


def schedule_free(base_optimizer: GradientTransformation, learning_rate: ScalarOrSchedule, b1: Scalar = 0.9,
                  weight_lr_power: float = 2.0, state_dtype: Optional[torch.dtype] = None) -> GradientTransformation:
    """`base_optimizer` made schedule-free: optax.contrib's `schedule_free`.

    Args:
        base_optimizer: the optimizer whose iterate `z` is averaged; it applies `learning_rate` itself.
        learning_rate: the rate (a number or a schedule of the step count) that weighs the average.
        b1: where the gradient is taken, between the average (1) and the iterate (0).
        weight_lr_power: each iterate's weight is `max_lr ** weight_lr_power`.
        state_dtype: dtype of `z` (default: the params').
    """
    require_transformation(base_optimizer, where="schedule_free(base_optimizer=...)")

    def init_fn(params: Params) -> ScheduleFreeState:
        device = _foreach.device_of(params)
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return ScheduleFreeState(
            b1=torch.as_tensor(b1, dtype=torch.float32, device=device).clone(), weight_sum=zero, max_lr=zero.clone(),
            step_count=torch.ones((), dtype=torch.int64, device=device),
            base_optimizer_state=base_optimizer.init(params),
            z=tree_map(lambda p: p.detach().clone() if state_dtype is None else p.detach().to(state_dtype), params))

    def update_fn(grads: Updates, state: ScheduleFreeState,
                  params: Optional[Params] = None) -> Tuple[Updates, ScheduleFreeState]:
        if params is None:
            raise ValueError("schedule_free's update needs the params: tx.update(grads, state, params).")
        lr = learning_rate(state.step_count) if callable(learning_rate) else learning_rate
        max_lr = torch.maximum(state.max_lr, torch.as_tensor(lr, dtype=torch.float32, device=state.max_lr.device))
        weight = max_lr ** weight_lr_power
        total = state.weight_sum + weight
        ck = torch.where(torch.isnan(weight) | torch.isnan(total), torch.full_like(weight, float("nan")),
                         torch.nan_to_num(weight / total, nan=0.0, posinf=float("inf")))
        base_updates, base_state = base_optimizer.update(grads, state.base_optimizer_state, params)
        z = tree_map(lambda zi, ui: (zi + ui).to(zi.dtype), state.z, base_updates)
        b = state.b1
        x = tree_map(lambda yi, zi_old, zi: (1.0 - ck) * ((yi - (1.0 - b) * zi_old) / b) + ck * zi,
                     params, state.z, z)
        updates = tree_map(lambda xi, zi, yi: b * xi + (1.0 - b) * zi - yi, x, z, params)
        return updates, ScheduleFreeState(b1=state.b1, weight_sum=total, step_count=state.step_count + 1,
                                          max_lr=max_lr, base_optimizer_state=base_state, z=z)

    return GradientTransformation(init_fn, update_fn)


def schedule_free_eval_params(state: OptState, params: Params) -> Params:
    """The average `x = (y - (1 - b1) z) / b1` to evaluate at, from the params `y` and an optimizer state that
    holds one `ScheduleFreeState` (`schedule_free_adamw`'s, or one inside a chain)."""
    is_state = lambda x: isinstance(x, ScheduleFreeState)  # noqa: E731
    found = [x for x in tree_flatten(state, is_leaf=is_state)[0] if is_state(x)]
    if len(found) != 1:
        raise TypeError(f"schedule_free_eval_params needs an optimizer state holding one ScheduleFreeState (from "
                        f"schedule_free or schedule_free_adamw), got {len(found)} in the {type(state).__name__} given.")
    sf = found[0]
    return tree_map(lambda yi, zi: (yi - (1.0 - sf.b1) * zi) / sf.b1, params, sf.z)


def _schedule_free_adamw(learning_rate: Scalar, b1: Scalar, b2: Scalar, eps: Scalar, weight_decay: Scalar, *,
                         warmup_steps: Optional[int], weight_lr_power: float,
                         state_dtype: Optional[torch.dtype]) -> GradientTransformation:
    lr: ScalarOrSchedule = learning_rate
    if warmup_steps is not None:
        lr = warmup_constant_schedule(0.0, learning_rate, warmup_steps)
    base = chain(scale_by_rms(decay=b2, eps=eps, eps_in_sqrt=False, bias_correction=True),
                 add_decayed_weights(weight_decay), scale_by_learning_rate(lr))
    return schedule_free(base, lr, b1=b1, weight_lr_power=weight_lr_power, state_dtype=state_dtype)


def schedule_free_adamw(learning_rate: ScalarOrSchedule = 0.0025, warmup_steps: Optional[int] = None,
                        b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                        weight_lr_power: float = 2.0, state_dtype: Optional[torch.dtype] = None) -> GradientTransformation:
    """Schedule-free AdamW (optax.contrib's `schedule_free_adamw`): bias-corrected RMS scaling, decoupled weight
    decay and the rate (after a linear warmup of `warmup_steps`), made schedule-free. Its hyperparameters are
    0-d tensors in the state (`inject_hyperparams`): changing the peak rate never recompiles."""
    return inject_hyperparams(_schedule_free_adamw, static_args=("warmup_steps", "weight_lr_power", "state_dtype"))(
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, warmup_steps=warmup_steps,
        weight_lr_power=weight_lr_power, state_dtype=state_dtype)
