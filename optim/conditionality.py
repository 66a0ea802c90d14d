"""Skip updates whose gradients are not finite: `apply_if_finite` (optax's semantics).

Public names: `apply_if_finite`, `ApplyIfFiniteState`.

The inner update runs on every call and `torch.where` keeps or drops its result, so the check
costs no host sync and the step traces once under `torch.compile(fullgraph=True)` and torch_xla.
A NaN in a dropped result never reaches the output: `where` selects, it does not multiply.

Example:
    >>> import torch
    >>> from ember import optim
    >>> tx = optim.apply_if_finite(optim.sgd(1.0), max_consecutive_errors=2)
    >>> state = tx.init({"w": torch.zeros(2)})
    >>> updates, state = tx.update({"w": torch.tensor([1.0, float("nan")])}, state)
    >>> updates["w"].tolist(), int(state.notfinite_count), bool(state.last_finite)
    ([0.0, 0.0], 1, False)
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from ..core import pytree
from ..core.pytree import tree_flatten, tree_leaves, tree_unflatten
from ..core.tree_math import tree_all_finite
from ..core.types import OptState, Params, Updates
from . import _foreach
from .base import GradientTransformation, require_transformation

__all__ = ["ApplyIfFiniteState", "apply_if_finite"]


@pytree.dataclass
class ApplyIfFiniteState:
    """State of `apply_if_finite` (optax's fields; counts are 0-d int64 where optax's are int32).

    Attributes:
        notfinite_count: consecutive updates with a NaN or Inf (reset to 0 by a finite one).
        last_finite: 0-d bool tensor, whether the last update was finite.
        total_notfinite: updates with a NaN or Inf since `init` (never reset).
        inner_state: the inner optimizer's state (unchanged by a skipped update).
    """

    notfinite_count: Tensor
    last_finite: Tensor
    total_notfinite: Tensor
    inner_state: OptState


def _select(cond: Tensor, new: List[Any], old: List[Any]) -> List[Any]:
    """`new if cond else old`, leaf by leaf, in the old leaves' dtypes (non-tensor leaves stay)."""
    return [torch.where(cond, n, o).to(o.dtype) if isinstance(o, Tensor) else o for n, o in zip(new, old)]


def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int) -> GradientTransformation:
    """Apply `inner` only to finite gradients; give up skipping after `max_consecutive_errors` in a row.

    A call whose gradients hold a NaN or Inf returns zero updates and leaves the inner state
    untouched, counting the skip in the state. Once more than `max_consecutive_errors`
    consecutive calls were non-finite, the update is applied anyway (optax.apply_if_finite).
    Finiteness is `ember.core.tree_math.tree_all_finite`: one float32 sum, so gradients whose
    sum overflows float32 also read as non-finite.

    Args:
        inner: the optimizer to protect.
        max_consecutive_errors: how many non-finite calls in a row are skipped (an int >= 0).

    Returns:
        A `GradientTransformation` with an `ApplyIfFiniteState`.

    Raises:
        TypeError: `max_consecutive_errors` is not an int, or `inner` is not an ember
            transformation (an optax one is named).
        ValueError: `max_consecutive_errors < 0`.
    """
    require_transformation(inner, where="apply_if_finite(inner=...)")
    if isinstance(max_consecutive_errors, bool) or not isinstance(max_consecutive_errors, int):
        raise TypeError(f"apply_if_finite(max_consecutive_errors=...) expects an int, got "
                        f"{type(max_consecutive_errors).__name__} {max_consecutive_errors!r}.")
    if max_consecutive_errors < 0:
        raise ValueError(f"apply_if_finite(max_consecutive_errors=...) must be >= 0, got {max_consecutive_errors}.")

    def init_fn(params: Params) -> ApplyIfFiniteState:
        zero = _foreach.zero_count(params)
        return ApplyIfFiniteState(
            notfinite_count=zero,
            last_finite=torch.ones((), dtype=torch.bool, device=zero.device),
            total_notfinite=zero.clone(),
            inner_state=inner.init(params),
        )

    def update_fn(
        updates: Updates, state: ApplyIfFiniteState, params: Optional[Params] = None
    ) -> Tuple[Updates, ApplyIfFiniteState]:
        finite = tree_all_finite(updates).to(state.notfinite_count.device)
        notfinite = (~finite).to(state.notfinite_count.dtype)
        notfinite_count = (state.notfinite_count + 1) * notfinite
        apply = finite | (notfinite_count > max_consecutive_errors)
        new_updates, new_inner = inner.update(updates, state.inner_state, params)
        out, out_spec = tree_flatten(new_updates)
        out = [torch.where(apply, u, 0.0) if isinstance(u, Tensor) else u for u in out]
        old_leaves, old_spec = tree_flatten(state.inner_state)
        inner_state = tree_unflatten(_select(apply, tree_leaves(new_inner), old_leaves), old_spec)
        return tree_unflatten(out, out_spec), ApplyIfFiniteState(
            notfinite_count=notfinite_count,
            last_finite=finite,
            total_notfinite=state.total_notfinite + notfinite,
            inner_state=inner_state,
        )

    return GradientTransformation(init_fn, update_fn)
