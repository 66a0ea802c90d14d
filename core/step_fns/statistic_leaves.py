"""`StatisticLeaves`: parameters a loss hands a statistic instead of a gradient, and the rule that moves them.

Public name: `StatisticLeaves`.

DeepSeek-V3's expert bias is a parameter (saved, restored and sharded with the others) that no loss
differentiates: the MoE layer adds a zero-valued term whose gradient with respect to the bias is
each expert's load, so the load is summed over microbatches and data-parallel ranks like any
gradient. A loss function whose params hold such leaves says so in its `statistic_leaves` attribute
(`ember.models.lm_loss` sets it), and `train_step` keeps them from the gradient transformation,
whoever built it: there they get a zero gradient (no `grad_norm`, clipping, weight decay or moments
see the statistic), they stay in their own dtype under `compute_dtype`, and `move` sets their new
value (kept with the rest when the step is skipped).

Example:
    >>> import torch
    >>> from ember.core.pytree import tree_map_with_path
    >>> rule = StatisticLeaves(mask=lambda p: tree_map_with_path(lambda path, _: path == "b", p),
    ...                        move=lambda load, b: b - 0.5 * torch.sign(load - load.mean()))
    >>> params, grads = {"w": torch.ones(2), "b": torch.zeros(2)}, {"w": torch.ones(2), "b": torch.tensor([3.0, 1.0])}
    >>> split = rule.split(params, grads)
    >>> split.grads["b"].tolist(), split.grads["w"].tolist()   # what the transformation sees
    ([0.0, 0.0], [1.0, 1.0])
    >>> split.moved(params, None)["b"].tolist()   # the busier entry goes down
    [-0.5, 0.5]
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
from torch import Tensor

from ..pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from ..tree_math import tree_cast
from ..types import Params, PyTree

__all__ = ["StatisticLeaves"]


class StatisticLeaves(NamedTuple):
    """Which leaves of the params get a statistic as their gradient, and how each moves.

    Attributes:
        mask: `mask(params) -> tree of bool` shaped like `params`, True at such leaves.
        move: `move(statistic, leaf) -> new leaf`, one leaf at a time (the statistic as the step
            accumulated and normalised it, in `accumulate_dtype`).
    """

    mask: Callable[[Params], PyTree]
    move: Callable[[Tensor, Tensor], Tensor]

    def marked(self, params: Params) -> Optional[List[bool]]:
        """The mask's leaves in `params`' leaf order, or None when no leaf is marked."""
        flags = [bool(m) for m in tree_leaves(self.mask(params))]
        return flags if any(flags) else None

    def cast(self, params: Params, dtype: Optional[torch.dtype]) -> Params:
        """`tree_cast(params, dtype)` but for the marked leaves, which keep their own dtype."""
        flags = self.marked(params) if dtype is not None else None
        if flags is None:
            return tree_cast(params, dtype)
        leaves, spec = tree_flatten(params)
        return tree_unflatten([t if keep else tree_cast(t, dtype) for t, keep in zip(leaves, flags)], spec)

    def split(self, params: Params, grads: PyTree) -> "Split":
        """The gradients the transformation sees (zero at the marked leaves) and the marked leaves' new values."""
        flags = self.marked(params)
        if flags is None:
            return Split(grads, {})
        g_leaves, spec = tree_flatten(grads)
        p_leaves = tree_leaves(params)
        moved = {i: self.move(g, p).to(p.dtype) for i, (g, p, m) in enumerate(zip(g_leaves, p_leaves, flags)) if m}
        zeroed = [torch.zeros_like(g) if m else g for g, m in zip(g_leaves, flags)]
        return Split(tree_unflatten(zeroed, spec), moved)


class Split(NamedTuple):
    """`StatisticLeaves.split`'s result: `grads` for the transformation, `moves` by leaf index."""

    grads: PyTree
    moves: Dict[int, Tensor]

    def moved(self, new_params: Params, ok: Optional[Tensor]) -> Params:
        """`new_params` with the marked leaves set to their moved values (kept as they were when `ok` is False)."""
        if not self.moves:
            return new_params
        leaves, spec = tree_flatten(new_params)
        for i, value in self.moves.items():
            leaves[i] = value if ok is None else torch.where(ok, value, leaves[i])
        return tree_unflatten(leaves, spec)


def statistic_leaves_of(loss_fn: Any) -> Optional[StatisticLeaves]:
    """The loss function's `statistic_leaves` (None when it has none), checked."""
    rule = getattr(loss_fn, "statistic_leaves", None)
    if rule is not None and not isinstance(rule, StatisticLeaves):
        raise TypeError(f"train_step: loss_fn.statistic_leaves must be an ember.core.step_fns.StatisticLeaves "
                        f"(mask, move) or None, got {type(rule).__name__}.")
    return rule


NO_STATISTICS = StatisticLeaves(mask=lambda params: tree_map(lambda _: False, params), move=lambda s, leaf: leaf)
"""The rule of a loss function without statistic leaves: nothing marked."""
