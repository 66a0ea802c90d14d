"""Parameter groups: a different transformation for each group of parameters (optax's `partition`).

Public names: `partition`, `PartitionState`.

`partition(transforms, param_labels)` labels every parameter (a tree of labels shaped like the params,
or a function `params -> such a tree`) and runs `transforms[label]` on the parameters with that label,
each through `masked`, so each group's state holds its own leaves only. The state keeps one entry per
group, keyed by its label, so a group's learning rate reads at `inner_states.<label>`.

Example:
    >>> import torch
    >>> from ember import optim
    >>> params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    >>> tx = optim.partition({"matrix": optim.sgd(0.5), "vector": optim.sgd(0.0)},
    ...                      lambda p: {k: "matrix" if v.ndim == 2 else "vector" for k, v in p.items()})
    >>> updates, _ = tx.update({"w": torch.ones(2, 2), "b": torch.ones(2)}, tx.init(params), params)
    >>> updates["w"][0, 0].item(), updates["b"][0].item()
    (-0.5, -0.0)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Mapping, Optional, Tuple, Union

from ..core import pytree
from ..core.pytree import check_same_structure, tree_leaves_with_path, tree_map
from ..core.types import OptState, Params, PyTree, Updates
from .base import GradientTransformation, require_transformation
from .masking import masked

__all__ = ["PartitionState", "partition"]

Labels = Union[PyTree, Callable[[Params], PyTree]]

_MSG_LABELS_FIX = (
    "param_labels must have exactly the structure of the params, with one label (a str or int naming a "
    "transformation) per parameter, or be a function `params -> such a tree`."
)


@pytree.dataclass
class PartitionState:
    """State of `partition`: each group's state (a `MaskedState` over its own leaves), keyed by its label."""

    inner_states: Dict[Hashable, OptState]


def _labels_of(param_labels: Labels, tree: PyTree, groups: Mapping[Hashable, Any]) -> PyTree:
    """The label tree for `tree`, checked: its structure, and every label naming a transformation."""
    labels = param_labels(tree) if callable(param_labels) else param_labels
    check_same_structure(labels, tree, what="param_labels and the params", fix=_MSG_LABELS_FIX)
    for path, label in tree_leaves_with_path(labels):
        if not isinstance(label, (str, int)) or isinstance(label, bool):
            raise TypeError(
                f"partition: the label of '{path}' is a {type(label).__name__} ({label!r}), expected a str or int "
                f"naming one of the transformations {sorted(map(str, groups))}. {_MSG_LABELS_FIX}"
            )
        if label not in groups:
            raise ValueError(
                f"partition: the parameter '{path}' is labelled {label!r}, which names no transformation; the "
                f"transformations are {sorted(map(str, groups))}. Add `{label!r}: <transformation>` to "
                f"`transforms`, or label the parameter with one of those."
            )
    return labels


def partition(transforms: Mapping[Hashable, GradientTransformation], param_labels: Labels) -> GradientTransformation:
    """Transform each group of parameters by its own transformation (optax's `partition`).

    Args:
        transforms: a mapping from label to the transformation of the parameters with that label.
        param_labels: a pytree with the structure of the params, holding one label (str or int) per
            parameter, or a function `params -> such a tree` (called with the params, or with the updates
            when `update` gets no params).

    Returns:
        A `GradientTransformation` with a `PartitionState`; each group's state covers only its own leaves.

    Raises:
        ValueError: a parameter's label names no transformation, or the labels' tree does not match the
            params (the message names the path).
        TypeError: a label is not a str or int, or a transformation is not an ember transformation.
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(
            f"partition(transforms=...) takes a non-empty mapping from label to transformation, e.g. "
            f"{{'muon': optim.muon(...), 'adamw': optim.adamw(...)}}; got {type(transforms).__name__} {transforms!r}."
        )
    for label, tx in transforms.items():
        require_transformation(tx, where=f"partition(transforms={{{label!r}: ...}})")

    def groups(tree: PyTree) -> Dict[Hashable, GradientTransformation]:
        """Each transformation masked to its group, the labels derived and checked once for all groups."""
        labels = _labels_of(param_labels, tree, transforms)
        return {label: masked(tx, tree_map(lambda leaf_label, label=label: leaf_label == label, labels))
                for label, tx in transforms.items()}

    def init_fn(params: Params) -> PartitionState:
        return PartitionState(inner_states={label: tx.init(params) for label, tx in groups(params).items()})

    def update_fn(
        updates: Updates, state: PartitionState, params: Optional[Params] = None
    ) -> Tuple[Updates, PartitionState]:
        new_states = {}
        for label, tx in groups(updates if params is None else params).items():
            updates, new_states[label] = tx.update(updates, state.inner_states[label], params)
        return updates, PartitionState(inner_states=new_states)

    return GradientTransformation(init_fn, update_fn)
