"""Composing transformations: `chain` runs several in sequence.

Public names: `chain`.

Example:
    >>> import torch
    >>> from ember import optim
    >>> tx = optim.chain(optim.clip_by_global_norm(1.0), optim.scale(-0.1))
    >>> state = tx.init({"w": torch.zeros(2)})
    >>> updates, state = tx.update({"w": torch.tensor([3.0, 4.0])}, state)
    >>> [round(v, 4) for v in updates["w"].tolist()]
    [-0.06, -0.08]
"""

from __future__ import annotations

from typing import Optional, Tuple

from ..core.types import OptState, Params, Updates
from .base import GradientTransformation, require_transformation

__all__ = ["chain"]

_MSG_STATE_MISMATCH = (
    "chain of {n} transformations expected a tuple of {n} states, got {got}. The state does not "
    "come from this chain's `init`: call init first (`opt_state = tx.init(params)`) with the same "
    "transformation you pass to update."
)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply `transforms` one after the other; the state is the tuple of their states.

    Args:
        *transforms: the transformations, applied in order (the first sees the raw gradients).

    Returns:
        A `GradientTransformation` whose state is a tuple with one state per transformation.

    Raises:
        TypeError: an argument is not a `GradientTransformation` (no `init` / `update`), or is
            optax's (the message names the ember.optim spelling).
        ValueError: (from `update`) the state is not a tuple of `len(transforms)` states.
    """
    for i, tx in enumerate(transforms):
        require_transformation(tx, where=f"chain(...) argument {i}")
    n = len(transforms)

    def init_fn(params: Params) -> Tuple[OptState, ...]:
        return tuple(tx.init(params) for tx in transforms)

    def update_fn(
        updates: Updates, state: Tuple[OptState, ...], params: Optional[Params] = None
    ) -> Tuple[Updates, Tuple[OptState, ...]]:
        if not isinstance(state, tuple) or len(state) != n:
            got = (
                f"a tuple of {len(state)} states"
                if isinstance(state, tuple)
                else f"a {type(state).__name__}"
            )
            raise ValueError(_MSG_STATE_MISMATCH.format(n=n, got=got))
        new_state = []
        for tx, s in zip(transforms, state):
            updates, s = tx.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init_fn, update_fn)
