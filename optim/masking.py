"""Apply a transformation to some parameters only: `masked`, and nanoGPT's `decay_mask`.

Public names: `masked`, `MaskedState`, `decay_mask`.

The inner transformation sees the updates (and params) with every masked-out leaf replaced by a
`MaskedNode` (a pytree node with no leaves), so its state is only as large as the selected
parameters yet keeps the parameter tree's paths. Masked-out updates pass through unchanged.

Example:
    >>> import torch
    >>> from ember import optim
    >>> params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    >>> optim.decay_mask(params)
    {'w': True, 'b': False}
    >>> tx = optim.masked(optim.scale(0.0), optim.decay_mask)
    >>> updates, _ = tx.update({"w": torch.ones(2, 2), "b": torch.ones(2)}, tx.init(params), params)
    >>> updates["w"].sum().item(), updates["b"].sum().item()
    (0.0, 2.0)
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np

from ..core import pytree
from ..core.pytree import check_same_structure, tree_flatten, tree_map, tree_unflatten
from ..core.types import OptState, Params, PyTree, Updates
from .base import GradientTransformation, MaskedNode, require_transformation

__all__ = ["MaskedState", "decay_mask", "masked"]

Mask = Union[PyTree, Callable[[Params], PyTree]]

_MSG_MASK_FIX = (
    "The mask must have exactly the structure of the params, with a Python bool per parameter "
    "(True: transform it), or be a function `params -> such a tree` (e.g. optim.decay_mask)."
)


def decay_mask(params: Params) -> PyTree:
    """True for parameters with `ndim >= 2` (matrices, embeddings), False for norms and biases.

    nanoGPT's rule for which parameters get weight decay. Use it as
    `adamw(lr, mask=decay_mask)` or `add_decayed_weights(wd, mask=decay_mask)`.

    Args:
        params: the parameter pytree (only `ndim` is read; meta tensors work).

    Returns:
        A pytree of Python bools with the structure of `params`.
    """
    return tree_map(lambda p: p.ndim >= 2, params)


def _mask_flags(mask_tree: PyTree, tree: PyTree) -> List[bool]:
    check_same_structure(mask_tree, tree, what="the mask and the params", fix=_MSG_MASK_FIX)
    flags = []
    for path, flag in pytree.tree_leaves_with_path(mask_tree):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(
                f"mask leaf at '{path}' is a {type(flag).__name__} ({flag!r}), expected a Python "
                f"bool: the mask decides which parameters the inner transformation sees, which "
                f"must be known before tracing. {_MSG_MASK_FIX}"
            )
        flags.append(bool(flag))
    return flags


def _select(leaves: List[Any], flags: List[bool], spec: Any) -> PyTree:
    return tree_unflatten([x if f else MaskedNode() for x, f in zip(leaves, flags)], spec)


@pytree.dataclass
class MaskedState:
    """State of `masked`: the inner state, built over the selected parameters only."""

    inner_state: OptState


def masked(inner: GradientTransformation, mask: Mask) -> GradientTransformation:
    """Apply `inner` to the parameters where `mask` is True; pass the other updates through.

    Args:
        inner: the transformation to apply to the selected parameters.
        mask: a pytree of Python bools with the structure of the params, or a function
            `params -> mask` (called with the params, or with the updates when `update` gets no
            params), such as `decay_mask`.

    Returns:
        A `GradientTransformation` with a `MaskedState`.

    Raises:
        ValueError: the mask's tree does not match the params (the message names the paths).
        TypeError: a mask leaf is not a Python bool, or `inner` is not an ember transformation.
    """
    require_transformation(inner, where="masked(inner=...)")

    def mask_for(tree: PyTree) -> PyTree:
        return mask(tree) if callable(mask) else mask

    def init_fn(params: Params) -> MaskedState:
        leaves, spec = tree_flatten(params)
        flags = _mask_flags(mask_for(params), params)
        return MaskedState(inner_state=inner.init(_select(leaves, flags, spec)))

    def update_fn(
        updates: Updates, state: MaskedState, params: Optional[Params] = None
    ) -> Tuple[Updates, MaskedState]:
        leaves, spec = tree_flatten(updates)
        flags = _mask_flags(mask_for(updates if params is None else params), updates)
        sub_params = None
        if params is not None:
            param_leaves, param_spec = tree_flatten(params)
            if param_spec != spec:
                check_same_structure(updates, params, what="the updates and the params")
            sub_params = _select(param_leaves, flags, spec)
        sub_updates = _select(leaves, flags, spec)
        new_sub, inner_state = inner.update(sub_updates, state.inner_state, sub_params)
        new_leaves = spec.flatten_up_to(new_sub)
        out = [n if f else u for n, u, f in zip(new_leaves, leaves, flags)]
        return tree_unflatten(out, spec), MaskedState(inner_state=inner_state)

    return GradientTransformation(init_fn, update_fn)
