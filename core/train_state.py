"""`TrainState`: the pytree a pure step consumes and returns.

Public names: `TrainState`, `TrainStateWithFrozen`.

Example:
    >>> import torch
    >>> from ember.core import TrainState, random
    >>> class SGD:  # any GradientTransformation; ember.optim builds real ones (`optim.sgd(0.1)`)
    ...     def init(self, params): return {}
    ...     def update(self, grads, state, params=None): return {k: -0.1 * g for k, g in grads.items()}, state
    >>> params = {"w": torch.zeros(3)}
    >>> state = TrainState.create(params=params, tx=SGD(), key=random.key(0))
    >>> state = state.apply_gradients(grads={"w": torch.ones(3)})
    >>> state.step.item(), state.params["w"].tolist()
    (1, [-0.10000000149011612, -0.10000000149011612, -0.10000000149011612])

Add fields by subclassing and decorating the subclass again:

    >>> from ember.core import pytree
    >>> @pytree.dataclass
    ... class EmaState(TrainState):
    ...     ema: dict = None
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from . import pytree
from .protocols import GradientTransformation, check_gradient_transformation
from .random import key as make_key
from .tree_math import apply_updates
from .types import Key, OptState, Params, Updates

__all__ = ["TrainState", "TrainStateWithFrozen"]

_MSG_NOT_A_TRANSFORMATION = (
    "TrainState.create(tx=...) expects a gradient transformation with `init(params)` and "
    "`update(grads, opt_state, params)`, got {got!r}. Build one with ember.optim, e.g. "
    "`tx=ember.optim.adamw(3e-4)`."
)


@pytree.dataclass
class TrainState:
    """Everything a training step reads and writes, as one pytree.

    Attributes:
        step: 0-d int64 tensor, the number of updates applied so far.
        params: the model parameters (pytree of tensors).
        opt_state: the optimizer state, from `tx.init(params)`.
        key: 0-d int64 RNG key; the step derives per-step randomness with `fold_in(key, step)`,
            so the key itself never changes and a resumed run draws the same numbers.
        skipped_steps: 0-d int64 tensor, how many steps were skipped for a non-finite loss or
            gradient (those steps advance `step` but leave params and opt_state untouched).
        tx: the gradient transformation (static: not a leaf).
    """

    step: Tensor
    params: Params
    opt_state: OptState
    key: Key
    skipped_steps: Tensor
    tx: Optional[GradientTransformation] = pytree.field(static=True, default=None)

    @classmethod
    def create(
        cls,
        *,
        params: Params,
        tx: GradientTransformation,
        key: Optional[Key] = None,
        **kwargs: Any,
    ) -> "TrainState":
        """A state at step 0 with `opt_state = tx.init(params)`; extra fields go in `**kwargs`."""
        check_gradient_transformation(tx, where="TrainState.create(tx=...)")
        if not isinstance(tx, GradientTransformation):
            raise TypeError(_MSG_NOT_A_TRANSFORMATION.format(got=tx))
        leaves = pytree.tree_leaves(params)
        device = leaves[0].device if leaves else None
        if key is None:
            key = make_key(0, device=device)
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return cls(
            step=zero,
            skipped_steps=zero.clone(),
            params=params,
            opt_state=tx.init(params),
            key=key,
            tx=tx,
            **kwargs,
        )

    def apply_gradients(self, *, grads: Updates, **kwargs: Any) -> "TrainState":
        """Run `tx.update` on `grads`, apply the updates, advance `step`; `kwargs` replace fields."""
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return self.replace(
            step=self.step + 1,
            params=apply_updates(self.params, updates),
            opt_state=opt_state,
            **kwargs,
        )


@pytree.dataclass
class TrainStateWithFrozen(TrainState):
    """A `TrainState` that also holds `frozen`: parameters the loss reads but never trains.

    A DPO reference model, a distillation teacher: `train_step` passes them to the loss function
    as `loss_fn(params, batch, key=key, frozen=state.frozen)`; they get no gradient, no optimizer
    state and no update, and `shard` places them like `params` when they share its structure.

    Example:
        >>> import torch
        >>> from ember import optim
        >>> state = TrainStateWithFrozen.create(params={"w": torch.ones(2)}, tx=optim.sgd(0.1),
        ...                                     frozen={"w": torch.ones(2)})
        >>> sorted(state.frozen), "frozen" in str(state.opt_state)
        (['w'], False)
    """

    frozen: Params = None
