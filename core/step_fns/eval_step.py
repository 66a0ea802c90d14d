"""`eval_step`: build a pure, deterministic `step(params_or_state, batch) -> metrics`.

Public names: `eval_step`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..tree_math import tree_cast
from ..types import Batch, Metrics
from ._common import check_builder_args, frozen_kwargs, is_state_like, split_loss_output
from .statistic_leaves import NO_STATISTICS, statistic_leaves_of
from .token_loss import TokenLoss

__all__ = ["eval_step"]


def eval_step(
    loss_fn: Callable[..., Any],
    *,
    compute_dtype: Optional[torch.dtype] = None,
) -> Callable[[Any, Batch], Metrics]:
    """Build a pure evaluation step from the same `loss_fn` a train step uses.

    `loss_fn(params, batch, *, key)` is called with `key=None`, so layers that draw randomness
    (dropout) must run deterministically when they get no key. No gradients are computed. A state
    with `frozen` parameters (`TrainStateWithFrozen`) passes them as `frozen=`, as `train_step` does.

    Args:
        loss_fn: `loss_fn(params, batch, *, key) -> loss | (loss, aux)`; loss 0-d or a
            `TokenLoss`, aux a dict of 0-d tensors.
        compute_dtype: floating dtype to cast floating params and batch leaves to (as in
            `train_step`), or None.

    Returns:
        `step(params_or_state, batch) -> metrics`: accepts a params pytree or a TrainState-like
        object (its `.params` are used) and returns `{"loss": float32, **aux (float32)}`; for a
        `TokenLoss`, `loss` is its mean and `tokens` its count.

    Raises:
        TypeError: `loss_fn` is not callable, or (when called) returns neither a loss nor
            `(loss, aux)`.
        ValueError: (when called) the loss or an aux metric is not 0-d.

    Example:
        >>> import torch
        >>> from ember.core.step_fns import eval_step
        >>> def loss_fn(params, batch, *, key):
        ...     err = batch["x"] @ params["w"] - batch["y"]
        ...     return (err ** 2).mean(), {"mae": err.abs().mean()}
        >>> step = eval_step(loss_fn)
        >>> metrics = step({"w": torch.ones(2)}, {"x": torch.eye(2), "y": torch.zeros(2)})
        >>> {k: v.item() for k, v in metrics.items()}
        {'loss': 1.0, 'mae': 1.0}
    """
    check_builder_args("eval_step", loss_fn, compute_dtype)
    statistics = statistic_leaves_of(loss_fn) or NO_STATISTICS  # kept in their own dtype, as in train_step

    def step(params_or_state: Any, batch: Batch) -> Metrics:
        params = params_or_state.params if is_state_like(params_or_state) else params_or_state
        read_only = frozen_kwargs(params_or_state, compute_dtype) if is_state_like(params_or_state) else {}
        with torch.no_grad():
            out = loss_fn(statistics.cast(params, compute_dtype), tree_cast(batch, compute_dtype), key=None,
                          **read_only)
        loss, aux = split_loss_output(out, reserved=("loss", "tokens"))
        if isinstance(loss, TokenLoss):
            metrics: Metrics = {"loss": loss.mean(), "tokens": loss.count.to(torch.float32)}
        else:
            metrics = {"loss": loss.to(torch.float32)}
        metrics.update({k: v.to(torch.float32) for k, v in aux.items()})
        return metrics

    return step
