"""The contracts other layers implement: a gradient transformation and a model.

Public names: `GradientTransformation`, `Model`, `TransformInitFn`, `TransformUpdateFn`.

`core` states what it needs and checks it with `isinstance` (both are runtime-checkable
protocols: the methods' presence is checked, not their signatures). `ember.optim` builds
transformations (`ember.optim.GradientTransformation` is the NamedTuple implementing the
protocol, optax's shape); `ember.models` builds models.

Example:
    >>> import torch
    >>> class Halve:
    ...     def init(self, params): return {}
    ...     def update(self, updates, state, params=None): return {k: v / 2 for k, v in updates.items()}, state
    >>> isinstance(Halve(), GradientTransformation)
    True
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Tuple, runtime_checkable

from .types import Key, OptState, Params, Updates

__all__ = ["GradientTransformation", "Model", "TransformInitFn", "TransformUpdateFn"]

TransformInitFn = Callable[[Params], OptState]
"""`init(params) -> state`: build the state from the parameters (only shapes, dtypes, devices)."""

TransformUpdateFn = Callable[[Updates, OptState, Optional[Params]], Tuple[Updates, OptState]]
"""`update(updates, state, params=None) -> (updates, state)`: pure, out of place."""


@runtime_checkable
class GradientTransformation(Protocol):
    """Two pure functions turning gradients into updates: `init(params)` and `update(updates, state, params)`."""

    def init(self, params: Params) -> OptState: ...

    def update(self, updates: Updates, state: OptState, params: Optional[Params] = None) -> Tuple[Updates, OptState]: ...


@runtime_checkable
class Model(Protocol):
    """`init(key) -> params`, `apply(params, *inputs, key=None, **kw) -> outputs`, and `axes`: a tree
    shaped like params whose leaves are tuples of logical axis names, e.g. `("embed", "mlp")`."""

    axes: Any

    def init(self, key: Key) -> Params: ...

    def apply(self, params: Params, *inputs: Any, key: Optional[Key] = None, **kwargs: Any) -> Any: ...
