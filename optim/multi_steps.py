"""Gradient accumulation: apply the inner optimizer once every `k` calls, on the mean gradient.

Public names: `multi_steps`, `MultiSteps`, `MultiStepsState`.

Semantics are `optax.MultiSteps`: each call folds the gradients into a running mean (Welford:
`acc += (g - acc) / (n + 1)`; a running sum with `use_grad_mean=False`); on the `k`-th call the inner optimizer
updates on that mean and its updates are returned, on the other calls the updates are zeros and
the inner state is unchanged. Nothing branches in Python on tensors: the inner update runs on
every call and `torch.where` keeps or drops its state, so the step traces once under
`torch.compile(fullgraph=True)` and torch_xla (at the cost of running the inner math `k` times).
`k` is an int, or optax's `every_k_schedule`: a function of the 0-d int64 `gradient_step` (a
growing batch size). `MultiSteps(opt, every_k_schedule=k)` is optax's class spelling of the same.

Example:
    >>> import torch
    >>> from ember import optim
    >>> tx = optim.multi_steps(optim.sgd(1.0), every_k=2)
    >>> params = {"w": torch.zeros(1)}
    >>> state = tx.init(params)
    >>> u1, state = tx.update({"w": torch.tensor([1.0])}, state, params)
    >>> u2, state = tx.update({"w": torch.tensor([3.0])}, state, params)
    >>> u1["w"].tolist() == [0.0], u2["w"].tolist()  # zeros, then -lr * mean(1, 3)
    (True, [-2.0])
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from ..core import pytree
from ..core.pytree import tree_flatten, tree_leaves, tree_unflatten
from ..core.tree_math import tree_zeros_like
from ..core.types import OptState, Params, Updates
from . import _foreach
from .base import GradientTransformation, require_transformation

__all__ = ["MultiSteps", "MultiStepsState", "multi_steps"]

EveryK = Union[int, Callable[[Tensor], Union[int, Tensor]]]
"""Calls per inner update: an int, or a function of the 0-d int64 `gradient_step` (optax's `every_k_schedule`)."""


@pytree.dataclass
class MultiStepsState:
    """State of `multi_steps`.

    Attributes:
        mini_step: 0-d int64 tensor, calls since the last inner update (0 .. k-1).
        gradient_step: 0-d int64 tensor, inner updates applied so far.
        inner_state: the inner optimizer's state (changes only on inner updates).
        acc_grads: running mean of this cycle's gradients (same structure as params).
    """

    mini_step: Tensor
    gradient_step: Tensor
    inner_state: OptState
    acc_grads: Updates


def _resolve_every_k(every_k: Any, every_k_schedule: Any, where: str) -> EveryK:
    """The one `k` of `every_k` (ember's name) and `every_k_schedule` (optax's), checked."""
    if every_k is not None and every_k_schedule is not None:
        raise ValueError(f"{where} got both every_k={every_k!r} and every_k_schedule={every_k_schedule!r}, "
                         "which are one argument (every_k_schedule is optax's name); pass only one.")
    k = every_k if every_k is not None else every_k_schedule
    if k is None:
        raise TypeError(f"{where} needs the number of calls per update: every_k=4 (or optax's every_k_schedule=4).")
    if callable(k) and not isinstance(k, int):
        return k
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(
            f"{where}: every_k expects an int number of calls per update (or a function of the "
            f"gradient step), got {type(k).__name__} {k!r}."
        )
    if k < 1:
        raise ValueError(f"{where}: every_k must be >= 1, got every_k={k}.")
    return k


def multi_steps(
    inner: GradientTransformation,
    every_k: Optional[EveryK] = None,
    *,
    every_k_schedule: Optional[EveryK] = None,
    use_grad_mean: bool = True,
    accumulator_dtype: Optional[torch.dtype] = torch.float32,
) -> GradientTransformation:
    """Accumulate `every_k` gradients, then apply `inner` to their mean (optax.MultiSteps).

    Args:
        inner: the optimizer to apply every `every_k` calls.
        every_k: the number of calls (micro-batches) per inner update, at least 1; or a function
            of the 0-d int64 `gradient_step` returning it (an int or a 0-d integer tensor).
        every_k_schedule: optax's name for `every_k` (give one of the two).
        use_grad_mean: average the accumulated gradients (default, as optax); False sums them.
        accumulator_dtype: dtype of the running mean (float32 by default, like optax; `None`
            keeps each param's dtype).

    Returns:
        A `GradientTransformation` with a `MultiStepsState`. Its updates are zeros except on
        every `every_k`-th call.

    Raises:
        TypeError: `every_k` is neither an int nor a function, is missing, or `inner` is not an
            ember transformation (an optax one is named).
        ValueError: `every_k < 1`, or both `every_k` and `every_k_schedule` are given.
    """
    require_transformation(inner, where="multi_steps(inner=...)")
    every_k = _resolve_every_k(every_k, every_k_schedule, "multi_steps(...)")

    def init_fn(params: Params) -> MultiStepsState:
        count = _foreach.zero_count(params)
        return MultiStepsState(
            mini_step=count,
            gradient_step=count.clone(),
            inner_state=inner.init(params),
            acc_grads=tree_zeros_like(params, dtype=accumulator_dtype),
        )

    def update_fn(
        updates: Updates, state: MultiStepsState, params: Optional[Params] = None
    ) -> Tuple[Updates, MultiStepsState]:
        k = every_k if isinstance(every_k, int) else every_k(state.gradient_step)
        grads, spec = tree_flatten(updates)
        acc_old = tree_leaves(state.acc_grads)
        if grads and use_grad_mean:
            n = (state.mini_step + 1).to(torch.float32)
            delta = torch._foreach_sub(_foreach.cast(grads, _foreach.dtypes_of(acc_old)), acc_old)
            acc = list(torch._foreach_add(acc_old, torch._foreach_div(delta, n)))
        elif grads:
            acc = list(torch._foreach_add(acc_old, _foreach.cast(grads, _foreach.dtypes_of(acc_old))))
        else:
            acc = []
        mean = tree_unflatten(_foreach.cast(acc, _foreach.dtypes_of(grads)), spec)
        inner_updates, inner_state = inner.update(mean, state.inner_state, params)

        emit = state.mini_step == k - 1
        keep = (~emit).to(torch.float32)
        old_leaves, old_spec = tree_flatten(state.inner_state)
        new_leaves = tree_leaves(inner_state)  # same structure as the old state, by construction
        kept = [torch.where(emit, n, o).to(o.dtype) for n, o in zip(new_leaves, old_leaves)]
        out_leaves, out_spec = tree_flatten(inner_updates)
        new_state = MultiStepsState(
            mini_step=torch.remainder(state.mini_step + 1, k),
            gradient_step=state.gradient_step + emit.to(state.gradient_step.dtype),
            inner_state=tree_unflatten(kept, old_spec),
            acc_grads=tree_unflatten(_foreach.mul(acc, keep), spec),
        )
        out = _foreach.mul(out_leaves, emit.to(torch.float32))
        return tree_unflatten(out, out_spec), new_state

    return GradientTransformation(init_fn, update_fn)


class MultiSteps:
    """optax's class spelling of `multi_steps`: `MultiSteps(opt, every_k_schedule=4)`.

    It is a gradient transformation itself (`init`, `update`), and has optax's
    `gradient_transformation()`, `has_updated(state)` and `inner_opt`.

    Args:
        opt: the optimizer to apply every `every_k_schedule` calls.
        every_k_schedule: an int, or a function of the 0-d int64 gradient step (see `multi_steps`).
        use_grad_mean: average (default) or sum the accumulated gradients.
        should_skip_update_fn: not supported (raises); `apply_if_finite` skips non-finite updates.
        accumulator_dtype: dtype of the accumulated gradients (float32 by default).

    Raises:
        TypeError: as `multi_steps`, or `should_skip_update_fn` is given.
        ValueError: as `multi_steps`.

    Example:
        >>> import torch
        >>> from ember import optim
        >>> tx = optim.MultiSteps(optim.sgd(1.0), every_k_schedule=2)
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> _, state = tx.update({"w": torch.ones(1)}, state)
        >>> bool(tx.has_updated(state))
        False
    """

    def __init__(
        self,
        opt: GradientTransformation,
        every_k_schedule: EveryK,
        use_grad_mean: bool = True,
        should_skip_update_fn: Optional[Callable[..., Any]] = None,
        accumulator_dtype: Optional[torch.dtype] = torch.float32,
    ) -> None:
        if should_skip_update_fn is not None:
            raise TypeError(
                "MultiSteps(should_skip_update_fn=...) is not supported in ember; to skip updates "
                "with non-finite gradients wrap the optimizer: MultiSteps(optim.apply_if_finite(opt, "
                "max_consecutive_errors), every_k_schedule=k)."
            )
        require_transformation(opt, where="MultiSteps(opt=...)")
        self.inner_opt = opt
        self._tx = multi_steps(opt, every_k_schedule=every_k_schedule, use_grad_mean=use_grad_mean,
                               accumulator_dtype=accumulator_dtype)
        self.init = self._tx.init
        self.update = self._tx.update

    def gradient_transformation(self) -> GradientTransformation:
        """The `(init, update)` pair, as optax's method returns it."""
        return self._tx

    def has_updated(self, state: MultiStepsState) -> Tensor:
        """0-d bool tensor: the last `update` applied the inner optimizer (no host sync)."""
        return torch.logical_and(state.mini_step == 0, state.gradient_step > 0)
