"""The gradient-transformation interface: two pure functions in a NamedTuple (optax's shape).

Public names: `GradientTransformation`, `TransformInitFn`, `TransformUpdateFn`, `EmptyState`,
`MaskedNode`, `ScalarOrSchedule`, `identity`, `apply_updates`.

A transformation turns gradients into updates. `init(params)` builds its state (a pytree of
tensors: moments, a 0-d int64 step count, ...), and `update(updates, state, params=None)` returns
`(new_updates, new_state)` without touching its inputs. Both are pure and trace whole under
`torch.compile(fullgraph=True)` and torch_xla. `apply_updates(params, updates)` adds the result.

Example:
    >>> import torch
    >>> from ember import optim
    >>> tx = optim.identity()
    >>> state = tx.init({"w": torch.zeros(2)})
    >>> updates, state = tx.update({"w": torch.ones(2)}, state)
    >>> optim.apply_updates({"w": torch.zeros(2)}, updates)["w"].tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Tuple, Union

from torch import Tensor

from ..core import pytree
from ..core.pytree import MaskedNode as MaskedNode
from ..core.protocols import TransformInitFn as TransformInitFn
from ..core.protocols import check_gradient_transformation
from ..core.protocols import TransformUpdateFn as TransformUpdateFn
from ..core.tree_math import apply_updates as apply_updates
from ..core.types import Params, Schedule, Updates

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "MaskedNode",
    "ScalarOrSchedule",
    "TransformInitFn",
    "TransformUpdateFn",
    "apply_updates",
    "identity",
    "stateless",
]

Scalar = Union[float, Tensor]
"""A hyperparameter inside a chain: a Python number, or the 0-d tensor `inject_hyperparams` passes."""

ScalarOrSchedule = Union[float, Tensor, Schedule]
"""A hyperparameter: a Python number, a 0-d tensor, or a schedule `count -> 0-d float32 tensor`."""

NO_PARAMS_MSG = (
    "{name}.update needs `params` (it reads the parameter values), but got params=None. "
    "Call `tx.update(grads, opt_state, params)`."
)


class GradientTransformation(NamedTuple):
    """A pair of pure functions `(init, update)` that turn gradients into updates.

    The NamedTuple implementing `ember.core.protocols.GradientTransformation`, the contract
    `TrainState` and `train_step` check.

    Attributes:
        init: `init(params) -> state`.
        update: `update(updates, state, params=None) -> (updates, state)`.
    """

    init: TransformInitFn
    update: TransformUpdateFn


@pytree.dataclass
class EmptyState:
    """The state of a stateless transformation: a pytree node with no leaves."""


def require_transformation(tx: object, *, where: str) -> None:
    """Raise a one-line `TypeError` unless `tx` is a gradient transformation (optax's are named as such).

    Args:
        tx: what was passed.
        where: the argument, as the message names it (`"masked(inner=...)"`).
    """
    check_gradient_transformation(tx, where=where)
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"{where} should be a GradientTransformation with init and update, got "
            f"{type(tx).__name__} {tx!r}. Did you pass a factory without calling it "
            f"(e.g. `optim.scale_by_adam` instead of `optim.scale_by_adam()`)?"
        )


def stateless(f: Callable[[Updates, Optional[Params]], Updates]) -> GradientTransformation:
    """A transformation with no state from `f(updates, params) -> updates` (it keeps an `EmptyState`).

    Args:
        f: a pure function of the updates and the (optional) params.

    Returns:
        A `GradientTransformation` whose `init` returns `EmptyState()` and whose `update` applies `f`.

    Example:
        >>> import torch
        >>> halve = stateless(lambda updates, params: {k: v / 2 for k, v in updates.items()})
        >>> halve.update({"w": torch.ones(2)}, halve.init({}))[0]["w"].tolist()
        [0.5, 0.5]
    """

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(
        updates: Updates, state: EmptyState, params: Optional[Params] = None
    ) -> Tuple[Updates, EmptyState]:
        return f(updates, params), state

    return GradientTransformation(init_fn, update_fn)


def identity() -> GradientTransformation:
    """A transformation that returns the updates unchanged (and keeps an `EmptyState`).

    Returns:
        The identity `GradientTransformation`.
    """
    return stateless(lambda updates, params: updates)
