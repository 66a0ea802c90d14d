"""Private helpers shared by the step builders: argument checks, loss-output parsing, state checks."""

from __future__ import annotations

from typing import Any, Dict, Tuple, Union

import torch
from torch import Tensor

from ..pytree import tree_leaves_with_path
from ..tree_math import tree_cast
from ..transforms import check_scalar_loss
from .token_loss import TokenLoss

_MSG_BAD_LOSS_OUTPUT = (
    "loss_fn must return a 0-d loss tensor, a `TokenLoss(total, count)`, or a tuple `(loss, aux)` "
    "with aux a dict of 0-d tensors, got {got}. Right: `return loss` or `return loss, {{'accuracy': acc}}`."
)

_MSG_NOT_A_STATE = (
    "{fn} expects a TrainState-like pytree with `params`, `opt_state` and `step` fields, got "
    "{got}. Build one with `ember.TrainState.create(params=params, tx=tx, key=ember.random.key(0))`."
)

RESERVED_METRICS = ("loss", "tokens", "grad_norm", "update_norm", "lr", "skipped")


def describe(x: Any) -> str:
    """A short description of a value for error messages."""
    if isinstance(x, Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"an object of type {type(x).__name__}"


def is_state_like(x: Any) -> bool:
    """True if `x` has the fields a train step reads (`params`, `opt_state`, `step`)."""
    return all(hasattr(x, name) for name in ("params", "opt_state", "step"))


def check_state(x: Any, fn: str) -> None:
    """Raise `TypeError` with the fix when `x` is not TrainState-like."""
    if not is_state_like(x) or not callable(getattr(x, "replace", None)):
        raise TypeError(_MSG_NOT_A_STATE.format(fn=fn, got=describe(x)))


def check_builder_args(builder: str, loss_fn: Any, compute_dtype: Any) -> None:
    """The argument checks every step builder shares: a callable loss and a floating compute dtype."""
    if not callable(loss_fn):
        raise TypeError(
            f"{builder}(loss_fn, ...) expects a callable `loss_fn(params, batch, *, key)`, got {type(loss_fn).__name__}."
        )
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise TypeError(
            f"{builder}(compute_dtype=...) must be None or a floating torch.dtype such as torch.bfloat16, "
            f"got {compute_dtype!r}."
        )


def split_loss_output(
    out: Any, *, reserved: Tuple[str, ...] = ()
) -> Tuple[Union[Tensor, TokenLoss], Dict[str, Tensor]]:
    """Split `loss` or `(loss, aux)` (decided by structure at trace time) and validate both.

    The loss is a 0-d tensor or a `TokenLoss` (a NamedTuple, so told apart from `(loss, aux)` by type).
    """
    if isinstance(out, tuple) and not isinstance(out, TokenLoss) and len(out) == 2 and isinstance(out[1], dict):
        loss, aux = out
    else:
        loss, aux = out, {}
    if isinstance(loss, TokenLoss):
        check_token_loss(loss)
    elif isinstance(loss, Tensor):
        check_scalar_loss(loss, name="loss_fn", what="the loss")
    else:
        raise TypeError(_MSG_BAD_LOSS_OUTPUT.format(got=describe(out)))
    for name, value in aux.items():
        if not isinstance(name, str):
            raise TypeError(f"aux metric names must be strings, got {name!r}.")
        if name in reserved:
            raise ValueError(
                f"aux metric {name!r} collides with a metric the step computes itself "
                f"({', '.join(reserved)}); rename it, e.g. 'aux_{name}'."
            )
        if not isinstance(value, Tensor) or value.dim() != 0:
            raise ValueError(
                f"aux metric {name!r} must be a 0-d tensor, got {describe(value)}. Reduce it in "
                f"loss_fn (e.g. `.mean()`); metrics are scalars kept on device until logged."
            )
    return loss, aux


def check_token_loss(loss: TokenLoss) -> None:
    """Raise with the fix unless `loss` holds a 0-d floating total and a 0-d numeric count."""
    total, count = loss
    if not isinstance(total, Tensor) or total.dim() != 0 or not total.is_floating_point():
        raise ValueError(
            f"loss_fn returned a TokenLoss whose total is {describe(total)}; it must be a 0-d floating "
            f"tensor, the sum of the per-token losses: `TokenLoss(per_token.sum(), valid.sum())`."
        )
    if not isinstance(count, Tensor) or count.dim() != 0 or count.dtype == torch.bool or count.is_complex():
        raise ValueError(
            f"loss_fn returned a TokenLoss whose count is {describe(count)}; it must be a 0-d integer "
            f"or floating tensor, the number of valid tokens: `valid.sum()` (not the mask itself)."
        )


def frozen_kwargs(state: Any, compute_dtype: Any) -> Dict[str, Any]:
    """`{"frozen": state.frozen}` in the compute dtype for a loss function, or `{}` when the state holds none."""
    frozen = getattr(state, "frozen", None)
    return {} if frozen is None else {"frozen": tree_cast(frozen, compute_dtype)}


def learning_rates(opt_state: Any) -> Dict[str, Tensor]:
    """The step's learning rates: `lr`, the first leaf whose dotted path ends with `hyperparams.learning_rate`;
    `lr/<label>` for each such leaf inside a parameter group (under `inner_states.<label>`, `partition`'s) and for
    a group's own rate beside it (`hyperparams.<label>_learning_rate`, as `muon`'s `adam_learning_rate`)."""
    found: Dict[str, Tensor] = {}
    for path, leaf in tree_leaves_with_path(opt_state):
        parts = path.split(".")
        if not isinstance(leaf, Tensor) or len(parts) < 2 or parts[-2] != "hyperparams":
            continue
        if parts[-1] == "learning_rate":
            names = ["lr"] + (["lr/" + parts[parts.index("inner_states") + 1]] if "inner_states" in parts else [])
        elif parts[-1].endswith("_learning_rate"):
            names = ["lr/" + parts[-1][: -len("_learning_rate")]]
        else:
            continue
        rate = leaf.detach().to(torch.float32)
        for name in names:
            found.setdefault(name, rate)
    return found
