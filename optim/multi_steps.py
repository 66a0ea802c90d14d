"""Gradient accumulation: apply the inner optimizer once every `k` calls, on the mean gradient.

Public names: `multi_steps`, `MultiStepsState`.

Semantics are `optax.MultiSteps` (with `use_grad_mean=True`): each call folds the gradients into
a running mean (Welford: `acc += (g - acc) / (n + 1)`); on the `k`-th call the inner optimizer
updates on that mean and its updates are returned, on the other calls the updates are zeros and
the inner state is unchanged. Nothing branches in Python on tensors: the inner update runs on
every call and `torch.where` keeps or drops its state, so the step traces once under
`torch.compile(fullgraph=True)` and torch_xla (at the cost of running the inner math `k` times).

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

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..core import pytree
from ..core.pytree import tree_flatten, tree_leaves, tree_unflatten
from ..core.tree_math import tree_zeros_like
from ..core.types import OptState, Params, Updates
from . import _foreach
from .base import GradientTransformation

__all__ = ["MultiStepsState", "multi_steps"]


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


def multi_steps(
    inner: GradientTransformation,
    every_k: int,
    *,
    accumulator_dtype: Optional[torch.dtype] = torch.float32,
) -> GradientTransformation:
    """Accumulate `every_k` gradients, then apply `inner` to their mean (optax.MultiSteps).

    Args:
        inner: the optimizer to apply every `every_k` calls.
        every_k: the number of calls (micro-batches) per inner update, at least 1.
        accumulator_dtype: dtype of the running mean (float32 by default, like optax; `None`
            keeps each param's dtype).

    Returns:
        A `GradientTransformation` with a `MultiStepsState`. Its updates are zeros except on
        every `every_k`-th call.

    Raises:
        TypeError: `every_k` is not an int.
        ValueError: `every_k < 1`.
    """
    if isinstance(every_k, bool) or not isinstance(every_k, int):
        raise TypeError(
            f"multi_steps(every_k=...) expects an int number of calls per update, got "
            f"{type(every_k).__name__} {every_k!r}."
        )
    if every_k < 1:
        raise ValueError(f"multi_steps(every_k=...) must be >= 1, got every_k={every_k}.")

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
        grads, spec = tree_flatten(updates)
        acc_old = tree_leaves(state.acc_grads)
        if grads:
            n = (state.mini_step + 1).to(torch.float32)
            delta = torch._foreach_sub(_foreach.cast(grads, _foreach.dtypes_of(acc_old)), acc_old)
            acc = list(torch._foreach_add(acc_old, torch._foreach_div(delta, n)))
        else:
            acc = []
        mean = tree_unflatten(_foreach.cast(acc, _foreach.dtypes_of(grads)), spec)
        inner_updates, inner_state = inner.update(mean, state.inner_state, params)

        emit = state.mini_step == every_k - 1
        keep = (~emit).to(torch.float32)
        old_leaves, old_spec = tree_flatten(state.inner_state)
        new_leaves = tree_leaves(inner_state)  # same structure as the old state, by construction
        kept = [torch.where(emit, n, o).to(o.dtype) for n, o in zip(new_leaves, old_leaves)]
        out_leaves, out_spec = tree_flatten(inner_updates)
        new_state = MultiStepsState(
            mini_step=torch.remainder(state.mini_step + 1, every_k),
            gradient_step=state.gradient_step + emit.to(state.gradient_step.dtype),
            inner_state=tree_unflatten(kept, old_spec),
            acc_grads=tree_unflatten(_foreach.mul(acc, keep), spec),
        )
        out = _foreach.mul(out_leaves, emit.to(torch.float32))
        return tree_unflatten(out, out_spec), new_state

    return GradientTransformation(init_fn, update_fn)
