"""The contracts other layers implement: a gradient transformation and a model.

Public names: `GradientTransformation`, `Model`, `TransformInitFn`, `TransformUpdateFn`,
`check_gradient_transformation`, `optax_origin`.

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

import sys
from typing import Any, Callable, Optional, Protocol, Tuple, runtime_checkable

from .types import Key, OptState, Params, Updates

__all__ = [
    "GradientTransformation",
    "Model",
    "TransformInitFn",
    "TransformUpdateFn",
    "check_gradient_transformation",
    "optax_origin",
]

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


_OPTAX_ALIASES = (  # (first building block of an optax alias's chain, another block it holds or None, alias)
    ("scale_by_adam", "add_decayed_weights", "adamw"),
    ("scale_by_adam", "masked", "adamw"),
    ("scale_by_adam", None, "adam"),
    ("scale_by_lion", None, "lion"),
    ("scale_by_factored_rms", None, "adafactor"),
    ("trace", None, "sgd"),
    ("identity", None, "sgd"),
)


def _cells(fn: Any) -> dict:
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, fn.__closure__ or ())}


def _optax_factory(update: Any) -> Any:
    """The optax factory behind an `update` function: a name, or a tuple of them for a chain."""
    while getattr(update, "__qualname__", "").startswith("with_extra_args_support"):
        update = _cells(update)["tx"].update
    factory = getattr(update, "__qualname__", "").split(".<locals>")[0].split(".")[0]
    cells = _cells(update)
    if factory == "inject_hyperparams":
        return cells["inner_factory"].__name__
    if factory == "chain":
        return tuple(_optax_factory(u) for u in cells["update_fns"])
    return factory


def optax_origin(obj: Any) -> Optional[str]:
    """The optax factory that built `obj` (`"adam"`, `"chain"`, `"clip_by_global_norm"`); None if not optax's."""
    if not type(obj).__module__.startswith("optax"):
        return None
    try:  # reads optax's closures (0.2.x) to name the alias; any other shape falls back to "chain"
        found = _optax_factory(obj.update)
    except Exception:  # noqa: BLE001  (only an error message is at stake)
        return type(obj).__name__ if type(obj).__name__ != "GradientTransformationExtraArgs" else "chain"
    if isinstance(found, str):
        return found
    names = [f if isinstance(f, str) else "chain" for f in found]
    for first, other, alias in _OPTAX_ALIASES:
        if names[:1] == [first] and (other is None or other in names):
            return alias
    return "chain"


def check_gradient_transformation(tx: Any, *, where: str) -> None:
    """Raise a one-line `TypeError` when `tx` is an optax object, naming ember's spelling of it.

    An optax transformation has `init` and `update`, so the protocol check alone accepts it, and
    it then fails deep inside on torch tensors ("Cannot interpret 'torch.float32' as a data type").

    Args:
        tx: the object passed where a gradient transformation is expected.
        where: the argument, as the message names it (`"chain(...) argument 0"`, `"train_step(tx=...)"`).
    """
    origin = optax_origin(tx)
    if origin is None:
        return
    optim = sys.modules.get(__name__.rsplit(".", 2)[0] + ".optim")  # no import: core stays below optim
    fix = (f"use ember.optim.{origin} (same name and arguments, on torch tensors)"
           if optim is not None and origin in getattr(optim, "__all__", ())
           else "build it from ember.optim's transformations, which run on torch tensors")
    raise TypeError(f"{where} got an optax GradientTransformation (optax.{origin}), which works on JAX arrays; {fix}.")
