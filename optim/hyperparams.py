"""Hyperparameters as tensors in the optimizer state: change the learning rate without recompiling.

Public names: `InjectHyperparamsState`, `inject_hyperparams`, `set_hyperparams`,
`get_hyperparams`.

`inject_hyperparams(factory)(**kwargs)` builds a transformation that keeps every numeric argument
of `factory` as a 0-d float32 tensor in its state (`state.hyperparams["learning_rate"]`) and
calls `factory` inside `update` with those tensors. A compiled step therefore reads the learning
rate from its input instead of baking a Python float into the graph: `set_hyperparams(opt_state,
learning_rate=1e-4)` takes effect at the next step without a recompile. A callable argument is a
schedule, evaluated at the state's step count inside `update`; its current value is stored in
`hyperparams` too, so a step can report the learning rate it used. Every alias in
`ember.optim.aliases` is built this way.

Example:
    >>> import torch
    >>> from ember import optim
    >>> tx = optim.inject_hyperparams(optim.scale)(step_size=-0.1)
    >>> state = tx.init({"w": torch.zeros(2)})
    >>> state = optim.set_hyperparams(state, step_size=-0.5)
    >>> updates, state = tx.update({"w": torch.ones(2)}, state)
    >>> updates["w"].tolist(), optim.get_hyperparams(state)["step_size"].item()
    ([-0.5, -0.5], -0.5)
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from ..core import pytree
from ..core.types import OptState, Params, PyTree, Updates
from . import _foreach
from .base import GradientTransformation

__all__ = [
    "InjectHyperparamsState",
    "get_hyperparams",
    "inject_hyperparams",
    "set_hyperparams",
]

_MSG_SCHEDULE_NOT_TENSOR = (
    "the schedule for hyperparameter '{name}' returned {value} ({kind}), but a schedule must "
    "return a 0-d tensor: a Python number would be baked into a compiled "
    "step as a constant (recompiling whenever it changes). Fix: return a tensor computed from "
    "the count, e.g. `lambda count: torch.as_tensor(0.1) * 0.99 ** count`, or use ember.optim's "
    "schedules (constant_schedule, linear_schedule, cosine_decay_schedule, "
    "warmup_cosine_decay_schedule, join_schedules)."
)


def _hyperparam_tensor(name: str, value: Any, device: torch.device) -> Tensor:
    """A numeric hyperparameter as a 0-d float32 tensor on `device`."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"hyperparameter '{name}' must be a scalar, got a tensor of shape "
                f"{tuple(value.shape)}. Pass a Python number or a 0-d tensor."
            )
        return value.reshape(()).to(device=device, dtype=torch.float32)
    return torch.tensor(float(value), dtype=torch.float32).to(device)


def _replacement(name: str, old: Tensor, value: Any) -> Tensor:
    """`value` as a tensor that can replace `old` in a compiled step without a recompile.

    Same dtype (float32), shape (0-d) and device as `old`; for a DTensor, the same mesh and
    placements.
    """
    new = _hyperparam_tensor(name, value, torch.device("cpu"))
    if _foreach.is_dtensor(old):
        return torch.full_like(old, new.item())  # host sync: outside the step, on a CPU scalar
    # On torch_xla a host-uploaded 0-d tensor is a graph constant (values 0 and 1) or a read-only
    # buffer shared with equal scalars; ember.core.jit(backend="xla") gives such inputs their own
    # buffers before tracing, so changing a hyperparameter this way never recompiles.
    return new.to(old.device)


def _eval_schedule(name: str, schedule: Callable[[Tensor], Any], count: Tensor) -> Tensor:
    """Evaluate `schedule(count)` and check it returned a 0-d tensor (float32, count's device)."""
    value = schedule(count)
    if not isinstance(value, Tensor) or value.ndim != 0:
        kind = (
            f"a tensor of shape {tuple(value.shape)}"
            if isinstance(value, Tensor)
            else f"a {type(value).__name__}"
        )
        shown = "a tensor" if isinstance(value, Tensor) else repr(value)
        raise TypeError(_MSG_SCHEDULE_NOT_TENSOR.format(name=name, value=shown, kind=kind))
    return value.to(device=count.device, dtype=torch.float32)


def _fresh(hyperparams: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """Return the hyperparameters as new tensors (one `_foreach_mul` by 1, exact).

    torch_xla shares one device buffer between host-created scalars of equal value (say
    learning_rate == weight_decay == 1e-3), so a graph fed such a state differs from one fed
    distinct buffers: without this copy, the first `set_hyperparams` that splits two equal values
    recompiles the step. Returning computed outputs gives every hyperparameter its own buffer
    from the first step on.
    """
    if not hyperparams:
        return hyperparams
    return dict(zip(hyperparams, torch._foreach_mul(list(hyperparams.values()), 1.0)))


def _is_numeric(value: Any) -> bool:
    return _foreach.is_number(value) or isinstance(value, (Tensor, np.ndarray))


@pytree.dataclass
class InjectHyperparamsState:
    """State of an `inject_hyperparams` transformation.

    Attributes:
        count: 0-d int64 tensor, the number of updates so far (the schedules' argument).
        hyperparams: name -> 0-d float32 tensor: the constant hyperparameters, and for scheduled
            ones the value used by the latest update (at `init`, the value at count 0).
        inner_state: the state of the wrapped transformation.
        scheduled: names of the hyperparameters driven by a schedule (static, not leaves).
    """

    count: Tensor
    hyperparams: Dict[str, Tensor]
    inner_state: OptState
    scheduled: Tuple[str, ...] = pytree.field(static=True, default=())


def inject_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    *,
    static_args: Union[str, Iterable[str]] = (),
) -> Callable[..., GradientTransformation]:
    """Wrap a transformation factory so its numeric arguments live as tensors in the state.

    Arguments of the returned factory are sorted like optax's: names in `static_args`, bools,
    `None`, strings and other non-numeric values are passed to `inner_factory` unchanged (they
    can change the structure of the computation); Python numbers, numpy scalars and one-element
    tensors become 0-d float32 tensors in `state.hyperparams`; any other callable is a schedule
    `count -> 0-d tensor`, evaluated at the step count in every `update`. `inner_factory` is
    called once eagerly at construction (so bad arguments fail at the call site, with schedules
    replaced by their value at count 0), then inside `init` and each `update` with the tensors,
    so its building blocks must accept 0-d tensors for every numeric argument.

    Args:
        inner_factory: a function returning a `GradientTransformation`, e.g. `scale_by_adam`.
        static_args: names of callable arguments that are not schedules (a mask function), or
            of numeric arguments that must stay Python values (sizes, step offsets).

    Returns:
        A factory with `inner_factory`'s signature whose transformations have an
        `InjectHyperparamsState` state.

    Raises:
        ValueError: a name in `static_args` is not a parameter of `inner_factory`.
        TypeError: (from the returned factory) a schedule does not return a 0-d tensor.

    Example:
        >>> import torch
        >>> from ember import optim
        >>> adam = optim.inject_hyperparams(optim.scale_by_adam)(b1=0.8, b2=0.99)
        >>> state = adam.init({"w": torch.zeros(3)})
        >>> sorted(state.hyperparams), state.hyperparams["b1"].dtype
        (['b1', 'b2', 'eps', 'eps_root'], torch.float32)
    """
    static_names = {static_args} if isinstance(static_args, str) else set(static_args)
    signature = inspect.signature(inner_factory)
    unknown = static_names - set(signature.parameters)
    if unknown:
        raise ValueError(
            f"inject_hyperparams(static_args=...) names {sorted(unknown)}, which are not "
            f"parameters of {getattr(inner_factory, '__name__', inner_factory)}; its parameters "
            f"are {list(signature.parameters)}."
        )

    @functools.wraps(inner_factory)
    def wrapped_factory(*args: Any, **kwargs: Any) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        static: Dict[str, Any] = {}
        numeric: Dict[str, Any] = {}
        schedules: Dict[str, Callable[[Tensor], Any]] = {}
        for name, value in bound.arguments.items():
            if name in static_names or value is None or isinstance(value, (bool, str)):
                static[name] = value
            elif _is_numeric(value):
                numeric[name] = value
            elif callable(value):
                schedules[name] = value
            else:
                static[name] = value
        # Fail at the call site: check each value's type and the schedules' return type, and let
        # the factory validate the original Python values (range checks skip tensors).
        cpu_count = torch.zeros((), dtype=torch.int64)
        for k, v in numeric.items():
            _hyperparam_tensor(k, v, torch.device("cpu"))
        probe = {k: _eval_schedule(k, s, cpu_count) for k, s in schedules.items()}
        inner_factory(**static, **numeric, **probe)
        order = [n for n in bound.arguments if n in numeric or n in schedules]
        scheduled = tuple(n for n in order if n in schedules)

        def init_fn(params: Params) -> InjectHyperparamsState:
            count = _foreach.zero_count(params)
            hyperparams = {
                n: (
                    _eval_schedule(n, schedules[n], count)
                    if n in schedules
                    else _hyperparam_tensor(n, numeric[n], count.device)
                )
                for n in order
            }
            inner_state = inner_factory(**static, **hyperparams).init(params)
            return InjectHyperparamsState(
                count=count, hyperparams=hyperparams, inner_state=inner_state, scheduled=scheduled
            )

        def update_fn(
            updates: Updates, state: InjectHyperparamsState, params: Optional[Params] = None
        ) -> Tuple[Updates, InjectHyperparamsState]:
            hyperparams = dict(state.hyperparams)
            for n, s in schedules.items():
                hyperparams[n] = _eval_schedule(n, s, state.count)
            inner = inner_factory(**static, **hyperparams)
            updates, inner_state = inner.update(updates, state.inner_state, params)
            new_state = InjectHyperparamsState(
                count=state.count + 1,
                hyperparams=_fresh(hyperparams),
                inner_state=inner_state,
                scheduled=state.scheduled,
            )
            return updates, new_state

        return GradientTransformation(init_fn, update_fn)

    return wrapped_factory


def _is_inject_state(x: Any) -> bool:
    return isinstance(x, InjectHyperparamsState)


def _inject_states(tree: PyTree) -> list:
    nodes = pytree.tree_leaves(tree, is_leaf=_is_inject_state)
    return [n for n in nodes if _is_inject_state(n)]


def get_hyperparams(opt_state: PyTree) -> Dict[str, Tensor]:
    """All hyperparameters in `opt_state` (or in any pytree holding it, like a `TrainState`).

    Args:
        opt_state: an optimizer state containing one or more `InjectHyperparamsState`.

    Returns:
        name -> 0-d float32 tensor; when several injected states hold the same name, the first
        one in tree order wins. Empty if `opt_state` holds no `InjectHyperparamsState`.
    """
    out: Dict[str, Tensor] = {}
    for node in _inject_states(opt_state):
        for name, value in node.hyperparams.items():
            out.setdefault(name, value)
    return out


def set_hyperparams(opt_state: PyTree, **values: Union[float, Tensor]) -> PyTree:
    """Return `opt_state` with hyperparameters replaced in every `InjectHyperparamsState` in it.

    The new values keep the old tensors' dtype (float32), shape and device, so a compiled step
    that takes the state as input does not recompile.

    Args:
        opt_state: an optimizer state (or any pytree holding one, like a `TrainState`).
        **values: name -> new value (Python number or one-element tensor).

    Returns:
        A new pytree; the input is not modified.

    Raises:
        ValueError: `opt_state` holds no `InjectHyperparamsState`, a name is unknown (the message
            lists the known names), a name is driven by a schedule, or a value is not a scalar.

    Example:
        >>> import torch
        >>> from ember import optim
        >>> tx = optim.adamw(1e-3)
        >>> state = optim.set_hyperparams(tx.init({"w": torch.zeros(2)}), learning_rate=3e-4)
        >>> round(optim.get_hyperparams(state)["learning_rate"].item(), 6)
        0.0003
    """
    nodes = _inject_states(opt_state)
    if not nodes:
        raise ValueError(
            "set_hyperparams found no InjectHyperparamsState in the given state, so there are no "
            "tensor hyperparameters to set. Build the optimizer with an ember.optim alias (adamw, "
            "sgd, ...) or wrap its factory with optim.inject_hyperparams(...)."
        )
    known = sorted({n for node in nodes for n in node.hyperparams})
    for name in values:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ValueError(
                f"set_hyperparams got unknown hyperparameter '{name}'; the state knows "
                f"{known}.{hint}"
            )
        if all(name in node.scheduled for node in nodes if name in node.hyperparams):
            raise ValueError(
                f"hyperparameter '{name}' is driven by a schedule, so setting it would have no "
                f"effect (the schedule overwrites it at every update). Build the optimizer with a "
                f"constant {name} to set it by hand, or change the schedule."
            )

    def replace(node: Any) -> Any:
        if not _is_inject_state(node):
            return node
        new = dict(node.hyperparams)
        for name, value in values.items():
            if name in new and name not in node.scheduled:
                new[name] = _replacement(name, new[name], value)
        return node.replace(hyperparams=new)

    return pytree.tree_map(replace, opt_state, is_leaf=_is_inject_state)
